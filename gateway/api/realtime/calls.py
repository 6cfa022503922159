"""``POST /v1/realtime/calls``: OpenAI Realtime over WebRTC, signalled with one HTTP call.

The body is the browser's SDP offer, as ``application/sdp``, or as OpenAI
also allows a multipart form with ``sdp`` and ``session`` (a session
configuration as JSON). The answer is ``201`` with the SDP answer and
``Location: /v1/realtime/calls/{call_id}``. A browser authenticates with a
client secret (``client_secrets.py``), whose session configuration the call
starts from (the form's ``session`` applies over it); a backend may use its key.

The media then flows peer to peer with the replica that answered
(``webrtc.py``): a call cannot move, its conversation can (the sessions are
in Redis). A caller whose call broke off (its replica died, the network
changed) offers again with ``?session_id=<the session.created id>`` and
``&last_event_id=<the last event it got>``, to any replica, as a WebSocket
resumes: the conversation goes on, and the answer in flight continues from
that event. ``POST /v1/realtime/calls/{call_id}/hangup`` ends a call, on any
replica: the edge may send it to one that does not hold the call, which
asks the one that does through Redis.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from gateway import errors
from gateway.api.realtime.client_secrets import session_config
from gateway.api.realtime.router import new_connection, receive_event
from gateway.api.realtime.webrtc import CALLS, Calls
from gateway.web.resources import CLIENT_SESSION, get_identity, get_resources

router = APIRouter(prefix="/v1/realtime", tags=["realtime"])

SDP = "application/sdp"

_OFFER_BODY = {"requestBody": {"required": True, "content": {
    SDP: {"schema": {"type": "string"}},
    "multipart/form-data": {"schema": {"type": "object", "required": ["sdp"], "properties": {
        "sdp": {"type": "string", "description": "the SDP offer"},
        "session": {"type": "string", "description": "a Realtime session configuration, as JSON"}}}},
}}}


def get_calls(request: Request) -> Calls:
    calls: Calls = request.scope["state"][CALLS]
    return calls


async def read_offer(request: Request) -> tuple[str, dict[str, Any] | None]:
    """The SDP offer and the form's session configuration, if the body is a form."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == SDP:
        return (await request.body()).decode("utf-8", "replace"), None
    if content_type != "multipart/form-data":
        raise errors.InvalidRequest("send the SDP offer as application/sdp, or a multipart form with sdp "
                                    "and session", param="content-type")
    form = await request.form()
    sdp, session = await _text(form.get("sdp")), await _text(form.get("session"))
    if sdp is None:
        raise errors.ValidationFailed("the form needs an sdp field with the offer", param="sdp")
    if session is None:
        return sdp, None
    try:
        parsed = json.loads(session)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise errors.ValidationFailed("session is a JSON object (a session configuration)", param="session")
    return sdp, parsed


async def _text(field: UploadFile | str | None) -> str | None:
    """A form field's text, sent as a plain field or as a part with a file name."""
    if field is None or isinstance(field, str):
        return field
    return (await field.read()).decode("utf-8", "replace")


@router.post("/calls", status_code=201, response_class=Response, openapi_extra=_OFFER_BODY,
             responses={201: {"content": {SDP: {"schema": {"type": "string"}}},
                              "description": "the SDP answer; Location names the call"},
                        **errors.error_responses(errors.InvalidRequest, errors.ValidationFailed,
                                                 errors.UnsupportedModality, errors.ModelNotFound,
                                                 errors.Unauthorized, errors.TooManyRequests,
                                                 errors.CapacityExhausted, errors.SessionNotFound,
                                                 errors.StoreUnavailable)})
async def create_call(request: Request, identity: Annotated[str, Depends(get_identity)],
                      model: str | None = None, session_id: str | None = None,
                      last_event_id: str | None = None) -> Response:
    resources, calls = get_resources(request), get_calls(request)
    offer, form_session = await read_offer(request)
    if "m=audio" not in offer and "m=application" not in offer:
        raise errors.InvalidRequest("the body is not an SDP offer with audio or a data channel", param="sdp")
    sessions = [s for s in (request.scope["state"].get(CLIENT_SESSION), form_session) if s]
    config = session_config(resources, model or next((s["model"] for s in reversed(sessions) if "model" in s), None))
    for session in sessions:
        config.update(session)
    resources.service.check_enabled()
    limit = resources.settings.webrtc_max_calls
    if limit and len(calls) >= limit:
        raise errors.CapacityExhausted(f"this replica holds {limit} calls already; try again or another replica")
    call = calls.new(identity)
    metrics, settings = resources.metrics, resources.settings

    async def send(event: dict[str, Any]) -> None:
        metrics.realtime_event("out", event["type"])
        await call.send(event)

    connection, budget = new_connection(resources, identity, config, send)
    call.attach(connection, lambda raw, handle: receive_event(raw, handle, send, settings, budget))
    if session_id is not None:  # a call that broke off, offered again: its conversation, from its last event
        try:
            await connection.restore(session_id, last_event_id)
        except Exception:
            await call.close()
            raise
    try:
        answer = await call.answer(offer)
    except Exception as exc:  # aiortc's own errors for an offer it cannot take (ValueError, its InvalidStateError)
        await call.close()
        raise errors.InvalidRequest(f"the SDP offer cannot be answered: {exc}", param="sdp") from exc
    return Response(answer, status_code=201, media_type=SDP, headers={"Location": f"/v1/realtime/calls/{call.id}"})


@router.post("/calls/{call_id}/hangup", status_code=200, response_class=Response,
             responses=errors.error_responses(errors.CallNotFound, errors.Unauthorized, errors.TooManyRequests,
                                                 errors.StoreUnavailable))
async def hang_up(call_id: str, request: Request, identity: Annotated[str, Depends(get_identity)]) -> Response:
    """Any replica answers: the process that holds the call ends it (through Redis when it is another)."""
    if not await get_calls(request).hang_up(get_resources(request).store, call_id, identity):
        raise errors.CallNotFound(f"no call {call_id!r}", param="call_id")
    return Response(status_code=200)
