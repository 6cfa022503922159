"""omni_client: a Python client for omni-gateway's streaming-input sessions.

Sync and async, over httpx; it imports nothing of the server. ::

    from omni_client import Client, TextDelta

    with Client("http://127.0.0.1:8080") as client:
        session = client.create_session(messages=[{"role": "system", "content": "Be brief."}],
                                         temperature=0, max_tokens=32)
        session.send("What is the capital ")
        session.send("of France?")
        session.finish()
        for event in session.answer():
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)

``send`` numbers the chunks and repeats a failed one under the same
sequence id (the gateway keeps one copy); ``answer()`` reconnects with
``Last-Event-ID`` by itself; failures are :class:`OmniError` subclasses
carrying the gateway's error envelope.
"""

from omni_client.answer import (
    AnswerEvent,
    AudioDelta,
    Finished,
    Result,
    TextDelta,
    Transcript,
    UsageReport,
)
from omni_client.async_client import DEFAULT_URL, AsyncClient, AsyncSession, ChunkAck, FinishAck
from omni_client.audio import read_wav, wav_bytes
from omni_client.chunks import Chunk
from omni_client.errors import (
    APIError,
    AuthenticationFailed,
    BadRequest,
    Conflict,
    ModelNotFound,
    NotFound,
    OmniError,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    SessionExpired,
    SessionFailed,
    SessionNotFound,
    TransportFailed,
)
from omni_client.retry import RetryPolicy
from omni_client.sync_client import Client, Session

__all__ = [
    "APIError", "AnswerEvent", "AsyncClient", "AsyncSession", "AudioDelta", "AuthenticationFailed", "BadRequest",
    "Chunk", "ChunkAck", "Client", "Conflict", "DEFAULT_URL", "FinishAck", "Finished", "ModelNotFound", "NotFound",
    "OmniError",
    "PayloadTooLarge", "RateLimited", "Result", "RetryPolicy", "ServerError", "Session", "SessionExpired",
    "SessionFailed", "SessionNotFound", "TextDelta", "Transcript", "TransportFailed", "UsageReport",
    "read_wav", "wav_bytes",
]
