"""``POST /v1/realtime/client_secrets``: a short-lived secret for a browser (OpenAI's shape).

The app's backend calls it with its real credentials and gives the browser
``value``; the browser opens ``/v1/realtime`` or ``/v1/realtime/calls`` with
it until ``expires_at``. The optional ``session`` is checked now, as a
``session.update`` would be, so a bad configuration fails here and not in
the browser; connections made with the secret start from it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from gateway import errors
from gateway.api.realtime.config import TRANSCRIPTION, RealtimeConfig
from gateway.api.realtime.events import new_id
from gateway.service.models import StrictModel
from gateway.web.client_secrets import mint
from gateway.web.resources import Resources, get_identity, get_resources

router = APIRouter(prefix="/v1/realtime", tags=["realtime"])


class ExpiresAfter(StrictModel):
    anchor: Literal["created_at"] = "created_at"
    #: OpenAI's bounds: ten seconds to two hours, ten minutes unless asked.
    seconds: int = Field(600, ge=10, le=7200)


class ClientSecretRequest(StrictModel):
    expires_after: ExpiresAfter = Field(default_factory=ExpiresAfter)
    #: A Realtime session configuration (``session.update``'s ``session``), ``model`` included.
    session: dict[str, Any] | None = None


class ClientSecret(BaseModel):
    #: The secret (``ek_...``): shown once, kept in Redis only as a digest.
    value: str
    #: Unix seconds.
    expires_at: int
    #: The session a connection made with it starts with.
    session: dict[str, Any]


def session_config(resources: Resources, model: str | None, *, transcribing: bool = False) -> RealtimeConfig:
    """A connection's starting configuration, for ``model`` (404 if it is not served; ``None``: the first).

    ``transcribing`` (``?intent=transcription``): a transcription session, where ``model`` is
    the recognizer's name (frameworks send OpenAI's): any is taken, as on ``/v1/audio/transcriptions``.
    """
    capabilities = resources.engine.capabilities
    served = capabilities.model_names
    if transcribing:
        model = None
    elif model is not None and model not in served:
        raise errors.ModelNotFound(f"model {model!r} is not served here (served: {', '.join(served)})",
                                   param="model")
    config = RealtimeConfig(model=model or served[0], can_speak="audio" in capabilities.output_modalities,
                            can_transcribe=capabilities.transcription, can_change_speed=capabilities.speech_speed)
    if transcribing:
        config.update({"type": TRANSCRIPTION})
    return config


@router.post("/client_secrets", response_model=ClientSecret,
             responses=errors.error_responses(errors.InvalidJson, errors.ValidationFailed,
                                              errors.UnsupportedModality, errors.ModelNotFound,
                                              errors.Unauthorized, errors.TooManyRequests,
                                              errors.StoreUnavailable))
async def create_client_secret(body: ClientSecretRequest, request: Request,
                               identity: Annotated[str, Depends(get_identity)]) -> ClientSecret:
    resources = get_resources(request)
    session = body.session
    model = session.get("model") if session else None
    if model is not None and not isinstance(model, str):
        raise errors.ValidationFailed("session.model is a string", param="session.model")
    config = session_config(resources, model)
    if session:
        config.update(session)  # refused now, with the field named, rather than at connect time
    value, record = await mint(resources.store, identity, session, body.expires_after.seconds)
    return ClientSecret(value=value, expires_at=record.expires_at, session=config.session_object(new_id("sess")))
