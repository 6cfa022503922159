"""Function calling in the ``vllm`` adapter, through vLLM's own tool-call support.

Three parts, each vLLM's own wherever vLLM has one:

* **What the model is told.** A chat template that renders ``tools`` gets
  them as they are. One that ignores them (SmolLM2's) gets the tools in the
  system prompt, in the format its model family was taught (SmolLM2's model
  card: the tools in ``<tools>...</tools>``, calls written as
  ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``), and the
  conversation's earlier calls as that same text.
* **What the model may say.** ``required`` and a named function become
  structured output with the JSON schema vLLM's own server derives from the
  tools (``ToolParser.adjust_request``), so even the 135M default model
  emits a call with valid arguments. ``auto`` is free text.
* **What the answer holds.** vLLM's parser (``Parser.parse_delta``, the one
  its chat server streams with) splits the text into content and tool-call
  deltas: the JSON of ``required`` / named, the model's own format for
  ``auto`` (vLLM's ``xlam`` parser reads SmolLM2's ``<tool_call>[...]``).

vLLM is imported lazily, as everywhere in the adapter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omni_adapter.port import EngineRejectedError, TextDelta, ToolCallDelta

if TYPE_CHECKING:
    from vllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: The parser for the default model: SmolLM2's call format is xLAM's.
DEFAULT_TOOL_CALL_PARSER = "xlam"

#: SmolLM2's function-calling system prompt (its model card), for templates without tools.
TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, answer the question directly.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, the output MUST strictly adhere to the following format, with no other text:\n"
    '<tool_call>[\n{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)


def calls_as_text(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` as the text the model writes for them
    (for a template that knows no tools; others get the message as it is)."""
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    written = json.dumps([{"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}
                          for c in calls], ensure_ascii=False)
    text = f"{message.get('content') or ''}<tool_call>{written}</tool_call>"
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # as the client gave it


def tools_in_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation told about ``tools`` in its system prompt (the first message, or a new one)."""
    block = TOOL_PROMPT.format(tools=json.dumps([t["function"] for t in tools], ensure_ascii=False))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def calls_tools(tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] | None) -> bool:
    """Whether a request may call functions (tools given, and not ``tool_choice: none``)."""
    return bool(tools) and tool_choice != "none"


class ToolCallParser:
    """One answer's text through vLLM's parser: content and tool-call deltas.

    ``structured_outputs`` is what the final input must carry (``required`` /
    a named function), ``None`` for ``auto``. Not ``parallel``: at most one
    call, as vLLM's server does it (``required``'s schema holds one item, so the
    answer ends after it; with ``auto`` later calls are left out).
    """

    def __init__(self, parser_cls: Any, tokenizer: Any, tools: Sequence[Mapping[str, Any]],
                 tool_choice: str | Mapping[str, Any] | None, *, parallel: bool = True) -> None:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest(messages=[], tools=list(tools), tool_choice=tool_choice or "auto",
                                            parallel_tool_calls=parallel)
            self._parser = parser_cls(tokenizer, request.tools)
            self._request = self._parser.adjust_request(request)
        except (ValidationError, ValueError) as exc:
            raise EngineRejectedError(f"invalid tools or tool_choice: {exc}") from exc
        self._relay = CallRelay(tools, parallel=parallel)
        #: A named function: OpenAI's finish reason stays ``stop``.
        self.named = isinstance(tool_choice, Mapping)

    @property
    def called(self) -> bool:
        """Some call was emitted (the answer's finish reason is then ``tool_calls``)."""
        return self._relay.called

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None:
        params: StructuredOutputsParams | None = self._request.structured_outputs
        return params

    def parse(self, text: str, token_ids: Sequence[int], *, finished: bool) -> list[TextDelta | ToolCallDelta]:
        # No reasoning parser: an empty prompt tells it no reasoning is open.
        delta = self._parser.parse_delta(text, list(token_ids), self._request, prompt_token_ids=[],
                                         finished=finished)
        calls = [ToolCallDelta(call.index, call.id, call.function.name if call.function is not None else None,
                               (call.function.arguments if call.function is not None else None) or "")
                 for call in (delta.tool_calls if delta is not None else ())]
        return self._relay.events(delta.content or "" if delta is not None else "", calls, finished=finished)


class CallRelay:
    """An answer's parsed content and call pieces as the answer's events, vLLM's parser's in
    process or ``vllm serve``'s: content that may be a call's start held back (``CallStart``),
    calls to undeclared functions left out, one call only without ``parallel``."""

    def __init__(self, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> None:
        #: Some call was emitted (the answer's finish reason is then ``tool_calls``).
        self.called = False
        self._declared = {t["function"]["name"] for t in tools}
        #: The model's call index -> the answer's (calls to undeclared functions are left out).
        self._indices: dict[int, int] = {}
        self._dropped: set[int] = set()
        self._parallel = parallel
        self._held = CallStart()

    def events(self, content: str, calls: Sequence[ToolCallDelta], *,
               finished: bool) -> list[TextDelta | ToolCallDelta]:
        content = self._held.content(content)
        events: list[TextDelta | ToolCallDelta] = []
        for call in calls:
            if call.id is None and call.name is None and not call.arguments:
                continue
            index = self._index_of(call.index, call.name)
            if index is None:
                continue
            self.called = True
            events.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        if calls:
            self._held.drop()  # what was held was a call's start (one left out too)
        if finished:
            content += self._held.release()  # it was not a call after all
        return [TextDelta(content), *events] if content else events

    def _index_of(self, model_index: int, name: str | None) -> int | None:
        """The call's index in the answer; ``None`` for a call to a function the request did not
        declare. A small model writes those ("capital" for a question about one): no client
        can run them (the OpenAI Agents SDK reports an error), so they are left out."""
        if model_index in self._dropped:
            return None
        if model_index not in self._indices:
            if name is not None and name not in self._declared:
                logger.warning("the model called an undeclared function %r: left out of the answer", name)
                self._dropped.add(model_index)
                return None
            if self._indices and not self._parallel:
                self._dropped.add(model_index)  # one call asked for: the first stands
                return None
            self._indices[model_index] = len(self._indices)
        return self._indices[model_index]


#: What begins a call in the formats vLLM's parsers read, and never begins an answer's words.
CALL_OPENERS = ("<tool_call>", "[TOOL_CALLS]")


class CallStart:
    """Content that may be the start of a call, held back until it is known to be or not to be.

    vLLM's streaming parsers tell a call's opening tag as content until it is whole (SmolLM2
    writes ``<tool_call>`` in five tokens: ``<``, ``tool``, ``_``, ``call``, ``>``), and the
    ``xlam`` parser the text after a tag that follows words until ``"arguments"`` shows. Its
    non-streaming parse, which ``vllm serve`` uses for a whole answer, leaves both out of the
    content: so do these answers, streamed or not. ``vllm serve`` streams with the same parser,
    so the ``openai-http`` adapter holds the sidecar's content back with this too (``CallRelay``).
    """

    def __init__(self) -> None:
        self._held = ""

    def content(self, text: str) -> str:
        """What of the held text and ``text`` is content for sure; the rest is held."""
        text = self._held + text
        cut = _call_start(text)
        self._held = text[cut:]
        return text[:cut]

    def drop(self) -> None:
        self._held = ""

    def release(self) -> str:
        text, self._held = self._held, ""
        return text


def _call_start(text: str) -> int:
    """Where in ``text`` a call may begin: a whole opener, or one's start at its end."""
    whole = [at for at in (text.find(opener) for opener in CALL_OPENERS) if at >= 0]
    if whole:
        return min(whole)
    longest = max(len(opener) for opener in CALL_OPENERS)
    for at in range(max(0, len(text) - longest + 1), len(text)):
        if any(opener.startswith(text[at:]) for opener in CALL_OPENERS):
            return at
    return len(text)


def tool_call_parser_class(name: str, tokenizer: Any) -> Any:
    """vLLM's parser class for ``name`` (``--tool-call-parser``), checked against the tokenizer."""
    from vllm.parser.parser_manager import ParserManager

    return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, tokenizer=tokenizer)


def conversation(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                 tool_choice: str | Mapping[str, Any] | None, takes_tools: bool,
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages to render and the tools to hand the template.

    A template that takes tools gets both as they are; for one that does not,
    the tools are told in the system prompt and earlier calls become text.
    With ``tool_choice: none`` (or no tools) the model is not told of any tool,
    and such a template does not see earlier calls either, as ``vllm serve``
    renders them: written out, they are a format the model copies into an answer
    that may not call (the results after them say what was found).
    """
    calling = calls_tools(tools, tool_choice)
    if takes_tools:
        return [dict(m) for m in messages], [dict(t) for t in tools] if calling else []
    if not calling:
        return [_without_calls(m) for m in messages], []
    return tools_in_prompt([calls_as_text(m) for m in messages], tools), []


def _without_calls(message: Mapping[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return dict(message)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": message.get("content") or ""}
