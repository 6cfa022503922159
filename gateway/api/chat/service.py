"""Chat completions as sessions whose input has already ended.

A request becomes one session: the messages before the last are its
history, the last (the user's) becomes its chunks, the last chunk ends the
input. From there it is any session: the same runner, identity, limits,
capability checks and errors; its answer is streamed from the session's
output frames or read from its stored result, so any replica can serve it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

import anyio
from sse_starlette import ServerSentEvent

from gateway import errors
from gateway.api.chat.audio_files import RATE, decoded
from gateway.api.chat.models import (
    AudioPart,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ImagePart,
)
from gateway.api.chunks import b64decode_in_slices, record_from_json
from gateway.domain.policies import StartPolicy
from gateway.domain.states import SessionState
from gateway.service.models import (
    FILE_AUDIO_FORMATS,
    ChatMessage,
    ChunkIn,
    CreateSessionRequest,
    GenerationOptions,
    RefusalPart,
    TextPart,
)
from gateway.service.sessions import MAX_RESULT_WAIT_SEC, SessionService
from gateway.store.records import ChunkRecord
from gateway.store.session_hash import SessionRecord
from gateway.work.draining import Draining

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+);base64,(?P<data>.*)$", re.DOTALL)


class ChatService:
    def __init__(self, sessions: SessionService, max_chunk_bytes: int, draining: Draining) -> None:
        self._sessions = sessions
        self._max_chunk_bytes = max_chunk_bytes
        self._draining = draining

    async def start(self, identity: str, body: ChatCompletionRequest, idempotency_key: str | None = None) -> str:
        """Open the session of a request, its input complete; returns the session id.

        A repeat with the same ``idempotency_key`` gets the first one's session (its
        further chunks are duplicates then, or the ones the first try did not send)."""
        if body.stream_options is not None and not body.stream:
            raise errors.InvalidRequest("stream_options is only allowed with stream: true",
                                        param="stream_options")
        *history, last = body.messages
        # Whoever's it is, the last message is the streamed input and the assistant answers it, as
        # vLLM renders the conversation: a system message alone (the assistant speaks first), or an
        # assistant's message (a new turn after it).
        if last.role == "assistant" and last.tool_calls:
            raise errors.ValidationFailed("the last message calls functions: send their results (tool messages) "
                                          "after it", param=f"messages.{len(history)}.tool_calls")
        if last.role == "assistant":  # its words as a history message says them (a refusal's, a transcript's)
            last = last.model_copy(update={"content": last.as_history().get("content")})
        where = f"messages.{len(history)}.content"
        chunks = await anyio.to_thread.run_sync(self._input_chunks, last, where) if _holds_mp3(last) else \
            self._input_chunks(last, where)  # (FFmpeg decodes mp3 off the loop)
        for chunk in chunks:
            self._sessions.check_input_modality(chunk, param=f"messages.{len(history)}.content")
        options = body.model_dump(include=set(GenerationOptions.model_fields), by_alias=True)  # json_schema's schema
        options["chat_template_kwargs"] = _template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
        if body.audio is not None and body.audio.format in FILE_AUDIO_FORMATS:
            options["audio"]["format"] = None  # the session keeps wav; the door encodes the file
        request = CreateSessionRequest(
            **options, start_policy=StartPolicy.ON_END_ONLY, input_role=last.role, input_tool_call_id=last.tool_call_id,
            messages=[_history_message(m, f"messages.{i}.content") for i, m in enumerate(history)])
        return await self.open(identity, request, chunks, idempotency_key)

    async def open(self, identity: str, request: CreateSessionRequest, chunks: list[ChunkRecord],
                   idempotency_key: str | None = None) -> str:
        """Open a session with its whole input (``chunks``, the last one ending it); its id.

        An input past the model's context is OpenAI's 400 ``context_length_exceeded``, named as
        the chat's ``messages`` (a door whose input is another field renames it: ``named_as``)."""
        try:
            record, _ = await self._sessions.create(identity, request, chunks[0], idempotency_key)
            try:
                for chunk in chunks[1:]:
                    await self._sessions.append(identity, record.session_id, chunk)
            except BaseException:
                await self.cancel(identity, record.session_id)
                raise
        except errors.ContextLengthExceeded as exc:
            raise _prompt_too_long(exc) from None
        return record.session_id

    def text_input(self, text: str) -> list[ChunkRecord]:
        """A door's whole text input as its one chunk; its errors (a lone surrogate, too big) are
        named as a chat's input is, ``messages`` (the door renames it: ``named_as``)."""
        try:
            return [record_from_json(ChunkIn(sequence_id=0, text=text, end_of_input=True), self._max_chunk_bytes)]
        except errors.GatewayError as exc:
            exc.param = "messages"
            raise

    async def answered(self, identity: str, session_id: str, queue_timeout_sec: float) -> SessionRecord:
        """The session once it completed (its ``chat.completion`` in ``result``); its error if it failed.

        An answer that no replica took up within ``queue_timeout_sec`` (every
        engine slot busy) is given up: the session is cancelled and the caller
        gets 503 ``capacity_exhausted`` with ``Retry-After``, not a request
        that hangs until some proxy's timeout.
        """
        deadline = time.monotonic() + queue_timeout_sec
        while True:
            left = deadline - time.monotonic()
            record = await self._sessions.result(identity, session_id, MAX_RESULT_WAIT_SEC if left <= 0 else left)
            if record.state.is_terminal:
                break
            if record.lease_epoch == 0 and time.monotonic() >= deadline:  # never taken up by a runner
                await self.cancel(identity, session_id)
                raise errors.CapacityExhausted(
                    f"no engine slot was free for {queue_timeout_sec:g} s; the request was dropped, retry later")
        if record.state is SessionState.COMPLETED and record.result is not None:
            return record
        failure = errors.from_envelope(record.error or {})
        if failure.code == errors.PromptTooLong.code:  # the engine found it (a sidecar counts itself)
            raise errors.PromptTooLong(failure.message, param="messages")
        raise failure

    async def cancel(self, identity: str, session_id: str) -> None:
        """Stop the session's work (nobody waits for its answer any more); whatever state it is in."""
        with anyio.CancelScope(shield=True), contextlib.suppress(errors.GatewayError):
            await self._sessions.cancel(identity, session_id)

    async def stream(self, identity: str, session_id: str) -> AsyncGenerator[ServerSentEvent, None]:
        """The session's frames; a client that leaves early cancels the session.

        A stream this replica ends because it stops (gateway/work/draining.py)
        leaves the session running: its client resumes it from another replica.
        """
        ended = False
        try:
            events = await self._sessions.events(identity, session_id, "0-0")
            if events is not None:  # None only after the final frame, and this read starts at the first
                async for event in events:
                    yield event
            ended = True
        finally:
            if not ended and not self._draining.closing.is_set():
                # Nobody will read the rest of this answer: stop the engine work.
                await self.cancel(identity, session_id)

    def _input_chunks(self, message: ChatCompletionMessage, where: str) -> list[ChunkRecord]:
        """The chunks of the user's message, in order; adjacent text parts are one chunk (blocking:
        mp3 audio is decoded)."""
        parts = [TextPart(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content or []
        if message.role == "tool" and not all(isinstance(p, TextPart) for p in parts):
            raise errors.ValidationFailed("a function's result is text", param=where)
        chunks: list[ChunkIn] = []
        texts: list[str] = []

        def close_text() -> None:
            if text := "\n".join(t for t in texts if t):
                chunks.append(ChunkIn(sequence_id=0, text=text))
            texts.clear()

        for i, part in enumerate(parts):
            if isinstance(part, TextPart):
                texts.append(part.text)
                continue
            close_text()
            if isinstance(part, AudioPart) and part.input_audio.format == "mp3":
                chunks.append(_decoded_mp3(part.input_audio.data, f"{where}.{i}.input_audio.data",
                                           self._max_chunk_bytes))
            elif isinstance(part, AudioPart):
                chunks.append(ChunkIn(sequence_id=0, modality="audio", payload=part.input_audio.data,
                                      format=part.input_audio.format))
            elif isinstance(part, ImagePart):  # a refusal part is an assistant's: never in the input
                match = _DATA_URL.match(part.image_url.url)
                if match is None:
                    raise errors.ValidationFailed("images must be data: URLs with base64 content",
                                                  param=f"{where}.{i}.image_url.url")
                chunks.append(ChunkIn(sequence_id=0, modality="image", payload=match["data"],
                                      mime_type=match["mime"]))
        close_text()
        if not chunks and message.role == "tool":
            # A function that returned nothing: its empty result is still the input (a chunk
            # of the sessions API carries a byte; this one is made here, whole).
            return [ChunkRecord(0, "text", b"", end_of_input=True)]
        if not chunks:
            raise errors.EmptyInput("the last message has no content", param=where)
        records = []
        for seq, chunk in enumerate(chunks):
            chunk = chunk.model_copy(update={"sequence_id": seq, "end_of_input": seq == len(chunks) - 1})
            try:
                records.append(record_from_json(chunk, self._max_chunk_bytes))
            except errors.InvalidPayload as exc:
                exc.param = where
                raise
        return records


def _template_kwargs(given: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """The chat template's variables as vLLM makes them: a reasoning effort is the template's
    ``reasoning_effort``, and turns thinking on or off (``enable_thinking``) unless the request
    set that itself."""
    if effort is None:
        return given
    return {"enable_thinking": effort != "none", **(given or {}), "reasoning_effort": effort}


def _prompt_too_long(exc: errors.ContextLengthExceeded) -> errors.PromptTooLong:
    tokens, limit = exc.details.get("prompt_tokens"), exc.details.get("max_input_tokens")
    return errors.PromptTooLong(
        f"the input takes at least {tokens} tokens, more than the model's context allows ({limit} tokens for "
        "it): shorten it", param="messages", prompt_tokens=tokens, max_input_tokens=limit)


def _history_message(message: ChatCompletionMessage, where: str) -> ChatMessage:
    """An earlier turn as session history, which is text (and function calls)."""
    if isinstance(message.content, list) and not all(isinstance(p, TextPart | RefusalPart) for p in message.content):
        raise errors.ValidationFailed("only the last message may carry audio or images", param=where)
    return message


def _holds_mp3(message: ChatCompletionMessage) -> bool:
    return isinstance(message.content, list) and any(
        isinstance(part, AudioPart) and part.input_audio.format == "mp3" for part in message.content)


def _decoded_mp3(data: str, where: str, max_bytes: int) -> ChunkIn:
    """An mp3 ``input_audio`` (OpenAI takes wav and mp3) as the pcm16 the engines read."""
    try:
        mp3 = b64decode_in_slices(data)
    except (binascii.Error, ValueError) as exc:
        raise errors.InvalidPayload("input_audio data is not valid base64", param=where) from exc
    pcm = decoded(mp3, max_bytes, param=where)
    return ChunkIn(sequence_id=0, modality="audio", payload=base64.b64encode(pcm).decode(), format="pcm16",
                   sample_rate=RATE)
