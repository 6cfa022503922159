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

Other families (SentencePiece/Metaspace, prefix spaces, lstrip/rstrip added
tokens) break those assumptions, so every tokenizer is checked once against a
probe text split at every position. One that fails keeps all text pending until
the end of input: still exact, just not incremental.
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from uuid import uuid4

logger = logging.getLogger(__name__)

#: Trailing pre-tokens kept pending; see the module docstring for why one is
#: not enough.
HELD_PRE_TOKENS = 2

#: Exercises what moves byte-level pre-token boundaries: contractions cut
#: before their letters, whitespace runs before text and newlines, digit runs,
#: punctuation runs, combining marks, multi-byte characters and emoji.
_PROBE_TEXT = (
    "Hello, world! It's 2024-05-06; we'll see...  Don't, they're, I'm, you've, she'd, "
    "'ll 're 've.\n\n\n  indented\tline\t\twith   spaces 1234567 3.14159 $100 a+b=c "
    "(x) [y] {z} \"quoted\" ?!... café naïve cafe\u0301 日本語のテキスト 🙂👍🏽 Ωμέγα "
    "WORD'S\r\n\r\n trailing   \n \n x \n\t\n end."
)


class HfTokenizer(Protocol):
    """The part of a Hugging Face fast tokenizer this module uses."""

    backend_tokenizer: Any

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class StreamingTokenizer:
    """The boundary rules of one tokenizer, checked once, shared by all streams.

    Build one per engine (the self-check tokenizes a few hundred short texts)
    and open an :class:`IncrementalTokenizer` per session.
    """

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self.tokenizer = tokenizer
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

    def open(self, prefix: str = "", suffix: str = "") -> IncrementalTokenizer:
        """Start a stream that begins with ``prefix`` and ends with ``suffix``."""
        return IncrementalTokenizer(self, prefix=prefix, suffix=suffix)

    def chat_frame(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """Render the chat template around one streamed user turn.

        Returns the text before and after the user's content. The template is
        rendered once with a unique sentinel as the content and split there, so
        the whole stream tokenizes exactly like the one-shot rendered prompt.
        """
        sentinel = f"OmniGatewayInput{uuid4().hex}"
        conversation = [*messages, {"role": "user", "content": sentinel}]
        rendered = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        if not isinstance(rendered, str) or rendered.count(sentinel) != 1:
            raise ValueError("the chat template does not place the user input verbatim")
        prefix, suffix = rendered.split(sentinel)
        return prefix, suffix

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
        if backend is None:
            return "it has no fast (tokenizers) backend"
        self._pre_tokenizer = backend.pre_tokenizer
        if self._pre_tokenizer is None:
            return "it has no pre-tokenizer, so BPE may merge across any boundary"
        added = list(backend.get_added_tokens_decoder().values())
        if any(t.lstrip or t.rstrip or t.single_word for t in added):
            return "an added token strips whitespace or matches single words only"
        contents = sorted({t.content for t in added if t.content}, key=len, reverse=True)
        if any(a != b and a.startswith(b) for a in contents for b in contents):
            return "an added token is a prefix of another one"
        if contents:
            # Longest first: Python's alternation then matches leftmost-longest,
            # like the tokenizers library's added-token split.
            self._added_re = re.compile("|".join(map(re.escape, contents)))
            self._added_prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c)))
            self._max_prefix_len = max(len(c) for c in contents) - 1
        return None

    def _passes_self_check(self) -> bool:
        decoder = self.tokenizer.backend_tokenizer.get_added_tokens_decoder()
        added = [decoder[i].content for i in sorted(decoder)] or [""]
        first, last = added[0], added[-1]
        probe = (
            f"{first}sys\n\n{_PROBE_TEXT}{last} x{first}\n"
            f"{first[:-1]} partial{last}{first}y \n"
        )
        try:
            expected = self.encode(probe)
            splits: list[list[str]] = [list(probe)]
            splits += [[probe[:i], probe[i:]] for i in range(1, len(probe))]
            return all(self._run(pieces) == expected for pieces in splits)
        except Exception:
            logger.debug("tokenizer self-check raised", exc_info=True)
            return False

    def _run(self, pieces: Sequence[str]) -> list[int]:
        stream = IncrementalTokenizer(self, incremental=True)
        ids: list[int] = []
        for piece in pieces:
            ids += stream.push(piece)
        return ids + stream.finish()


class IncrementalTokenizer:
    """One stream of text (prefix, pushed pieces, suffix) turned into token ids.

    ``push`` accepts UTF-8 bytes split anywhere (even inside a character) or
    ``str``; it returns the ids that became final. ``finish`` returns the rest.
    """

    def __init__(
        self,
        rules: StreamingTokenizer,
        prefix: str = "",
        suffix: str = "",
        *,
        incremental: bool | None = None,
    ) -> None:
        self._rules = rules
        self._incremental = rules.incremental if incremental is None else incremental
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The prefix is pending text like any other: tokenizing it separately
        # would fix a boundary the one-shot tokenization may merge across.
        self._pending = prefix
        self._suffix = suffix
        self._committed = 0
        self._finished = False

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

    def push(self, data: bytes | str) -> list[int]:
        """Append a piece of the input; return the ids that became final."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        raw = data if isinstance(data, bytes) else data.encode()
        text = self._decoder.decode(raw)
        if not text:
            return []
        self._pending += text
        if not self._incremental:
            return []
        return self._commit(self._rules.split_point(self._pending))

    def finish(self) -> list[int]:
        """End the input: append the suffix and return all remaining ids."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._pending += self._decoder.decode(b"", final=True) + self._suffix
        return self._commit(len(self._pending))

    def _commit(self, cut: int) -> list[int]:
        if cut <= 0:
            return []
        ids = self._rules.encode(self._pending[:cut])
        self._pending = self._pending[cut:]
        self._committed += len(ids)
        return ids
