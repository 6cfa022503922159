"""Boundary-safe incremental tokenization of streamed text.

The engine prefills a session's input while it is still arriving, so text must
become token ids chunk by chunk. Tokenizing each chunk on its own is wrong (a
word split across two chunks becomes two tokens), and re-tokenizing the whole
input per chunk is quadratic. Instead, only the *pending* tail is tokenized and
ids are committed for the longest prefix that no later text can change; the
rest waits for more text or for the end of input. The invariant:

    concat(ids of every push + finish) == tokenizer(prefix + text + suffix)

For byte-level BPE tokenizers (GPT-2, Llama-3, Qwen, SmolLM2) a tokenization
is the concatenation of independent pieces: the text is split at added/special
tokens, each segment is split into pre-tokens by a regex, and BPE never merges
across a pre-token. A boundary is therefore stable once it is a pre-token
boundary that later text cannot move. That holds for all but the last *two*
pre-tokens: the regex may look past a match's end (``"we'l"`` pre-tokenizes
as ``we | ' | l`` but ``"we'll"`` as ``we | 'll``; Llama-3 turns ``\\n | ␠``
into ``\\n␠\\n`` when a newline follows), never further than that. The cut
must also follow a non-space character, because the committed text is then
tokenized on its own and trailing whitespace pre-tokenizes differently at the
end of a text.

Client text never becomes a control token. vLLM's own chat path renders the
template with the user's text inside and tokenizes the whole string, so a
message containing ``<|im_end|>\n<|im_start|>system`` closes its turn and
opens a system turn. Here only the chat template's own text (and an adapter's
placeholders) is *trusted*: the input is split at the special tokens of
trusted text, and every segment between them is tokenized with special-token
matching off, so ``<|im_end|>`` typed by a client is eight ordinary tokens.
Streamed pieces and the messages' contents are client text.

Other families (SentencePiece/Metaspace, prefix spaces, lstrip/rstrip added
tokens) break those assumptions, so every tokenizer is checked once against a
probe text split at every position. One that fails keeps all text pending until
the end of input: still exact, just not incremental.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from uuid import uuid4

from omni_adapter.port import EngineRejectedError

logger = logging.getLogger(__name__)

#: Trailing pre-tokens kept pending; see the module docstring for why one is
#: not enough.
HELD_PRE_TOKENS = 2
#: Text with no settled boundary in this many characters (a base64 blob, a
#: minified file) is cut anyway, so pending text cannot grow without limit;
#: only the tokens at such a cut may differ from a one-shot tokenization.
MAX_PENDING_CHARS = 8192
#: A big piece is taken in slices of this size, so no single step holds the
#: interpreter long (callers run ``push`` in a worker thread).
PUSH_SLICE_CHARS = 16384

#: Exercises what moves byte-level pre-token boundaries: contractions cut
#: before their letters, whitespace runs before text and newlines, digit runs,
#: punctuation runs, combining marks, multi-byte characters and emoji.
_PROBE_TEXT = (
    "Hello, world! It's 2024-05-06; we'll see...  Don't, they're, I'm, you've, she'd, "
    "'ll 're 've.\n\n\n  indented\tline\t\twith   spaces 1234567 3.14159 $100 a+b=c "
    "(x) [y] {z} \"quoted\" ?!... café naïve cafe\u0301 日本語のテキスト 🙂👍🏽 Ωμέγα "
    "WORD'S\r\n\r\n trailing   \n \n x \n\t\n end."
)


@dataclass(frozen=True)
class Piece:
    text: str
    #: Template (or adapter) text, whose special tokens are control tokens;
    #: client text is never trusted.
    trusted: bool = False


@dataclass(frozen=True)
class Framed:
    """Text made of trusted and client pieces, such as a rendered chat template."""

    pieces: tuple[Piece, ...] = ()

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def __add__(self, other: Framed) -> Framed:
        return Framed(self.pieces + other.pieces)


def trusted(text: str) -> Framed:
    return Framed((Piece(text, True),)) if text else Framed()


def client(text: str) -> Framed:
    return Framed((Piece(text, False),)) if text else Framed()


def _unhide(text: str, contents: Sequence[str], hidden: re.Pattern[str]) -> Framed:
    """``text`` with each hidden message's key (``hidden``: its number) back as the client's text.
    One pass, whatever the number of messages (an alternation of every key was quadratic: 10,000
    messages held the GIL for seconds)."""
    pieces: list[Piece] = []
    at = 0
    for match in hidden.finditer(text):
        pieces += [*trusted(text[at:match.start()]).pieces, *client(contents[int(match.group(1))]).pieces]
        at = match.end()
    return Framed((*pieces, *trusted(text[at:]).pieces))


@contextlib.contextmanager
def _unicode_checked(text: str) -> Iterator[None]:
    """A text UTF-8 cannot hold (a lone surrogate: JSON's ``\\ud800`` escape) is the client's error,
    not the ``TypeError`` tokenizers raise for it (a 500)."""
    try:
        yield
    except (TypeError, UnicodeEncodeError) as exc:
        try:
            text.encode()
        except UnicodeEncodeError:
            raise EngineRejectedError("the text is not valid Unicode (a lone surrogate)") from exc
        raise


class HfTokenizer(Protocol):
    """The part of a Hugging Face fast tokenizer this module uses."""

    backend_tokenizer: Any

    def encode(self, text: str, *, add_special_tokens: bool = ..., split_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class StreamingTokenizer:
    """The boundary rules of one tokenizer, checked once, shared by all streams.

    Build one per engine (the self-check tokenizes a few hundred short texts)
    and open an :class:`IncrementalTokenizer` per session.
    """

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer
        #: The same tokenizer with special-token matching off, for client text.
        self._plain: Any = None
        #: Special tokens: control tokens where trusted text has them.
        self._special_re: re.Pattern[str] | None = None
        self._special_ids: dict[str, int] = {}
        #: The most UTF-8 bytes one token covers: pending text of n bytes is at
        #: least n / this many tokens, which counts toward the context early.
        self.max_token_bytes = _max_token_bytes(tokenizer)
        #: Non-special added tokens still split client text into segments.
        self._added_re: re.Pattern[str] | None = None
        self._added_prefixes: frozenset[str] = frozenset()
        self._max_prefix_len = 0
        self._pre_tokenizer: Any = None
        reason = self._load_rules()
        if reason is None and not self._passes_self_check():
            reason = "the self-check (probe text split at every position) failed"
        #: False when streams hold all text until the end of input.
        self.incremental = reason is None
        if reason is not None:
            logger.warning(
                "tokenizer %s is not boundary-safe (%s); streamed text will be "
                "tokenized only at the end of input",
                type(tokenizer).__name__,
                reason,
            )

    def open(self, prefix: Framed | str = "", suffix: Framed | str = "") -> IncrementalTokenizer:
        """Start a stream that begins with ``prefix`` and ends with ``suffix`` (plain strings are trusted)."""
        return IncrementalTokenizer(self, prefix=prefix, suffix=suffix)

    @functools.cached_property
    def raw_frame(self) -> tuple[Framed, Framed]:
        """What a raw prompt (vLLM's ``/v1/completions``) is framed with: the special tokens the
        tokenizer adds around any text (a BOS for most models), as vLLM's tokenization adds them."""
        probe = "x"
        bare = self.tokenizer.encode(probe, add_special_tokens=False)
        framed = self.tokenizer.encode(probe, add_special_tokens=True)
        at = next((i for i in range(len(framed) - len(bare) + 1) if framed[i:i + len(bare)] == bare), None)
        if at is None:
            return trusted(""), trusted("")
        before, after = framed[:at], framed[at + len(bare):]
        return (trusted(self.tokenizer.decode(before)) if before else trusted(""),
                trusted(self.tokenizer.decode(after)) if after else trusted(""))

    def chat_frame(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
                   streamed: Mapping[str, Any] | None = None,
                   template_kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False) -> tuple[Framed, Framed]:
        """Render the chat template around one streamed turn.

        Returns the text before and after the streamed content. The template is
        rendered once with unique sentinels as the streamed content and as each
        message's text, and split there: the template's own text is trusted,
        the messages' text is client text, and the whole stream tokenizes
        like the one-shot rendered prompt (with client text kept plain).
        ``streamed``: the streamed message's other fields (default: the user's);
        ``tools`` go to a template that renders them (see ``takes_tools``).
        ``template_kwargs``: a request's variables for the template (``template_variables``).
        ``add_generation_prompt`` and ``continue_final_message``: the template's flags, as vLLM
        passes a request's (the streamed turn left open: nothing after it).
        """
        tag = uuid4().hex
        contents: list[str] = []

        def hide(text: str) -> str:
            contents.append(text)
            return f"OmniGatewayText{len(contents) - 1}x{tag}"

        conversation = [_with_hidden_text(m, hide) for m in messages]
        sentinel = f"OmniGatewayInput{tag}"
        conversation.append({"role": "user", **(streamed or {}), "content": sentinel})
        # Tools are rendered as vLLM renders them (as JSON, by the template).
        extra: dict[str, Any] = self.template_variables(template_kwargs or {})
        if tools:
            extra["tools"] = list(tools)
        rendered = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **extra
        )
        if not isinstance(rendered, str) or rendered.count(sentinel) != 1:
            raise ValueError("the chat template does not place the user input verbatim")
        before, after = rendered.split(sentinel)
        hidden = re.compile(f"OmniGatewayText([0-9]+)x{tag}")
        return _unhide(before, contents, hidden), _unhide(after, contents, hidden)

    def template_variables(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Those of a request's ``chat_template_kwargs`` the template reads, as vLLM passes them
        (``{"enable_thinking": false}``); the others are left out. The rendering's own arguments
        and the special tokens' names are never a request's. A value is rendered as the
        template's own text, so none may hold a control token."""
        taken = {name: value for name, value in given.items() if name in self._template_reads}
        for name, value in taken.items():
            if any(self.has_control_tokens(text) for text in _strings_in(value)):
                raise ValueError(f"chat_template_kwargs.{name} holds a control token of the model")
        return taken

    @functools.cached_property
    def _template_reads(self) -> frozenset[str]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not isinstance(template, str):
            return frozenset()  # none, or several named templates: no request variables
        try:
            from jinja2 import meta
            from transformers.utils.chat_template_utils import _compile_jinja_template

            # transformers' own environment (its extensions), as vLLM reads the variables.
            variables = meta.find_undeclared_variables(_compile_jinja_template(template).environment.parse(template))
        except Exception:
            logger.exception("the chat template's variables could not be read; requests set none")
            return frozenset()
        own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        specials = set(getattr(self.tokenizer, "special_tokens_map", {}) or {})
        return frozenset(variables - own - specials - _RENDERING_ARGUMENTS)

    def has_control_tokens(self, text: str) -> bool:
        return bool(self._special_re.search(text)) if self._special_re is not None else \
            any(token in text for token in getattr(self.tokenizer, "all_special_tokens", ()))

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (SmolLM2's ignores them)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            with_tools = self.tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
        except Exception:
            return False
        return bool(with_tools != self.tokenizer.apply_chat_template(probe, tokenize=False))

    def encode(self, text: str) -> list[int]:
        """Trusted text: its special tokens are control tokens."""
        with _unicode_checked(text):
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Client text: ``<|im_end|>`` in it is ordinary text."""
        with _unicode_checked(text):
            if self._plain is None:  # no fast backend to clone
                return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
            # encode_batch releases the GIL while it works (encode does not), so
            # other threads (the event loop) run meanwhile.
            return list(self._plain.encode_batch([text], add_special_tokens=False)[0].ids)

    def split_trusted(self, text: str) -> list[str | int]:
        """Trusted text as plain runs and the ids of its special tokens, in order."""
        if self._special_re is None:
            return [text] if text else []
        out: list[str | int] = []
        at = 0
        for match in self._special_re.finditer(text):
            if match.start() > at:
                out.append(text[at:match.start()])
            out.append(self._special_ids[match.group()])
            at = match.end()
        if at < len(text):
            out.append(text[at:])
        return out

    def split_point(self, pending: str) -> int:
        """Length of the longest prefix of ``pending`` whose ids are final."""
        start = 0
        if self._added_re is not None:
            # An added token is a segment boundary: nothing after it changes
            # the ids before it.
            for match in self._added_re.finditer(pending):
                start = match.end()
        end = self._partial_added_token_start(pending, start)
        pieces = self._pre_tokenizer.pre_tokenize_str(pending[start:end])
        index = len(pieces) - HELD_PRE_TOKENS
        # The committed text is tokenized on its own, where trailing
        # whitespace pre-tokenizes differently ("\n\n" at the end of text is
        # one pre-token, before "Hello" it is two): cut after non-space only.
        while index > 0 and pending[start + pieces[index][1][0] - 1].isspace():
            index -= 1
        return start if index <= 0 else start + pieces[index][1][0]

    def _partial_added_token_start(self, pending: str, start: int) -> int:
        """Where a possibly unfinished added token (``"<|im_"``) begins.

        The text before it is treated as if the segment ended there, which is
        safe either way: if the token completes, it does end there; if not, it
        is an ordinary prefix of longer text.
        """
        longest = min(self._max_prefix_len, len(pending) - start)
        for size in range(longest, 0, -1):
            if pending[-size:] in self._added_prefixes:
                return len(pending) - size
        return len(pending)

    def _load_rules(self) -> str | None:
        """Read the added tokens and pre-tokenizer; return why not incremental."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decoder = (backend.get_added_tokens_decoder() if backend is not None
                   else getattr(self.tokenizer, "added_tokens_decoder", {}))
        specials = {t.content: i for i, t in decoder.items() if t.content and t.special}
        if specials:
            # Longest first: Python's alternation then matches leftmost-longest,
            # like the tokenizers library's added-token split.
            self._special_re = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
            self._special_ids = specials
        if backend is None:
            return "it has no fast (tokenizers) backend"
        if specials:
            from tokenizers import Tokenizer

            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.encode_special_tokens = True
        self._pre_tokenizer = backend.pre_tokenizer
        if self._pre_tokenizer is None:
            return "it has no pre-tokenizer, so BPE may merge across any boundary"
        added = list(decoder.values())
        if any(t.lstrip or t.rstrip or t.single_word for t in added):
            return "an added token strips whitespace or matches single words only"
        contents = sorted({t.content for t in added if t.content and not t.special}, key=len, reverse=True)
        if any(a != b and a.startswith(b) for a in contents for b in contents):
            return "an added token is a prefix of another one"
        if contents:
            self._added_re = re.compile("|".join(map(re.escape, contents)))
            self._added_prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c)))
            self._max_prefix_len = max(len(c) for c in contents) - 1
        return None

    def _passes_self_check(self) -> bool:
        """Split the probe at every position: each run must give the one-shot ids.

        Twice: with control-token look-alikes in the client text (they stay
        plain), and between two trusted special tokens, against the
        tokenizer's own one-shot encoding of the whole text.
        """
        decoder = self.tokenizer.backend_tokenizer.get_added_tokens_decoder()
        added = [decoder[i].content for i in sorted(decoder)] or [""]
        first, last = added[0], added[-1]
        look_alikes = f"{first}sys\n\n{_PROBE_TEXT}{last} x{first}\n{first[:-1]} partial{last}{first}y \n"
        prefix, suffix = f"{first}sys\n\n", f"{last} x{first}\n"
        try:
            checks = [(Framed(), look_alikes, Framed(), self.encode_plain(look_alikes)),
                      (trusted(prefix), _PROBE_TEXT, trusted(suffix), self.encode(prefix + _PROBE_TEXT + suffix))]
            for before, text, after, expected in checks:
                splits: list[list[str]] = [list(text)]
                splits += [[text[:i], text[i:]] for i in range(1, len(text))]
                if not all(self._run(before, pieces, after) == expected for pieces in splits):
                    return False
            return True
        except Exception:
            logger.debug("tokenizer self-check raised", exc_info=True)
            return False

    def _run(self, prefix: Framed, pieces: Sequence[str], suffix: Framed) -> list[int]:
        stream = IncrementalTokenizer(self, prefix, suffix, incremental=True)
        ids: list[int] = []
        for piece in pieces:
            ids += stream.push(piece)
        return ids + stream.finish()


def _max_token_bytes(tokenizer: HfTokenizer) -> int:
    try:
        # Not in HfTokenizer: a tokenizer without it takes the safe bound below.
        vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
        # Byte-level tokens spell one character per byte; others at most 4 bytes a character.
        return max(1, max(len(token.encode()) for token in vocab))
    except Exception:
        return 64


#: What ``apply_chat_template`` gives every template, set by the engine, never by a request.
_RENDERING_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                  "add_generation_prompt", "continue_final_message", "tokenize"})


def _strings_in(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings_in(item)


def _with_hidden_text(message: Mapping[str, Any], hide: Any) -> dict[str, Any]:
    """The message with its text (a string or text parts) replaced by sentinels."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": hide(content)}
    if isinstance(content, list):
        parts = [{**p, "text": hide(p["text"])} if isinstance(p, Mapping) and isinstance(p.get("text"), str)
                 else p for p in content]
        return {**message, "content": parts}
    return dict(message)


class IncrementalTokenizer:
    """One stream of text (prefix, pushed pieces, suffix) turned into token ids.

    ``push`` accepts UTF-8 bytes split anywhere (even inside a character) or
    ``str``; it returns the ids that became final. ``finish`` returns the rest.
    Pushed text is client text unless pushed as ``trusted``. The text after
    the last trusted special token is held in ``pending_text``: it has no
    control tokens, so it is tokenized plainly as its boundaries settle.
    """

    def __init__(
        self,
        rules: StreamingTokenizer,
        prefix: Framed | str = "",
        suffix: Framed | str = "",
        *,
        incremental: bool | None = None,
    ) -> None:
        self._rules = rules
        self._incremental = rules.incremental if incremental is None else incremental
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        #: Ids final but not returned yet (the prefix's, until the first push).
        self._ready: list[int] = []
        self._suffix = trusted(suffix) if isinstance(suffix, str) else suffix
        self._committed = 0
        self._finished = False
        # The prefix's tail is pending text like any other: tokenizing it
        # separately would fix a boundary the one-shot tokenization may merge across.
        self._take(trusted(prefix) if isinstance(prefix, str) else prefix)

    @property
    def committed_tokens(self) -> int:
        """Ids returned so far."""
        return self._committed

    @property
    def pending_text(self) -> str:
        """Text received but not yet tokenized (it may still change)."""
        return self._pending

    @property
    def incremental(self) -> bool:
        return self._incremental

    @property
    def pending_tokens_at_least(self) -> int:
        """A lower bound on the tokens the pending text will become."""
        return -(-len(self._pending.encode()) // self._rules.max_token_bytes)

    def push(self, data: bytes | str, *, trusted_text: bool = False) -> list[int]:
        """Append a piece of the input; return the ids that became final."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        raw = data if isinstance(data, bytes) else data.encode()
        text = self._decoder.decode(raw)
        # Trusted text's special tokens are the model's; the runs between them are plain text,
        # taken as client text is (in slices, the pending text bounded).
        for part in self._rules.split_trusted(text) if trusted_text else [text]:
            if isinstance(part, int):
                self._settle(len(self._pending))
                self._ready.append(part)
                continue
            for at in range(0, len(part), PUSH_SLICE_CHARS):
                self._pending += part[at:at + PUSH_SLICE_CHARS]
                if self._incremental:
                    self._settle(self._rules.split_point(self._pending))
                    while len(self._pending) > MAX_PENDING_CHARS:
                        self._settle(MAX_PENDING_CHARS // 2)
        return self._drain()

    def finish(self) -> list[int]:
        """End the input: append the suffix and return all remaining ids."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._pending += self._decoder.decode(b"", final=True)
        self._take(self._suffix)
        self._settle(len(self._pending))
        return self._drain()

    def _take(self, framed: Framed) -> None:
        """Add text; at each trusted special token everything before it is final."""
        for piece in framed.pieces:
            if not piece.trusted:
                self._pending += piece.text
                continue
            for part in self._rules.split_trusted(piece.text):
                if isinstance(part, str):
                    self._pending += part
                else:
                    self._settle(len(self._pending))
                    self._ready.append(part)

    def _settle(self, cut: int) -> None:
        if cut <= 0:
            return
        self._ready += self._rules.encode_plain(self._pending[:cut])
        self._pending = self._pending[cut:]

    def _drain(self) -> list[int]:
        ids, self._ready = self._ready, []
        self._committed += len(ids)
        return ids
