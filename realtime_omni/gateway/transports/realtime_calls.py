"""OpenAI's browser flow: client secrets, WebRTC calls at `/v1/realtime/calls`, and the sideband
WebSocket that controls a call from a server.

    POST /v1/realtime/client_secrets   JSON {"session": {...}, "expires_after": {"anchor":
                                       "created_at", "seconds": 600}} with an API key -> 200
                                       {"value": "ek_...", "expires_at", "session"}
    POST /v1/realtime/calls            an SDP offer: raw `application/sdp`, or multipart
                                       form-data with `sdp` and `session` (JSON) -> 201, the
                                       answer as application/sdp, Location:
                                       /v1/realtime/calls/<call_id>
    POST /v1/realtime/calls/<id>/hangup  end the call -> 200
    WS   /v1/realtime?call_id=<id>     the sideband: every event of that call's session, and
                                       client events for it (`realtime_ws.sideband`)

A call made with a client secret starts with the secret's session settings, then the call's
own `session` over them; with an API key, with the call's alone. Settings a call asks for that
the server refuses fail the call (400), so no call starts other than asked. The call's events
go on its data channel as with `/v1/webrtc/offer`; a sideband connection gets a copy of each
from when it attaches and may send client events; it ends with the call (or on its own, and
the call goes on).
"""

from __future__ import annotations

import asyncio
import email.message
import email.parser
import email.policy
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from realtime_omni.gateway.auth import grant_of
from realtime_omni.gateway.config import merge
from realtime_omni.gateway.media.echo_canceller import EchoCanceller
from realtime_omni.gateway.protocol.events import ProtocolError, loads_off_loop
from realtime_omni.gateway.protocol.session_update import apply_session_update
from realtime_omni.gateway.protocol.settings import SESSION_TYPES, Settings, new_settings
from realtime_omni.gateway.transports.webrtc import (
    MAX_OFFER_BYTES,
    SignallingError,
    WebRtcCalls,
    end_call,
    read_bytes,
    sdp_answer,
)

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host

log = logging.getLogger(__name__)
MAX_CALL_BODY = 4 * MAX_OFFER_BYTES  # an offer and its session settings
MAX_FORM_PARTS = 8  # OpenAI's clients send two: sdp and session


def _refusal(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"type": "invalid_request_error", "code": code, "message": message, "param": param}
    return JSONResponse({"error": body}, status_code=status)


def _check_settings(gw: Host, session: Any, where: str) -> Settings:
    """The settings a session would have from `session`; 400 for any the server would not
    apply, naming the fields."""
    kind = session.get("type") if isinstance(session, dict) else None
    base = new_settings(kind if kind in SESSION_TYPES else "realtime")
    try:
        s, refused = apply_session_update(base, session, gw.voices, EchoCanceller.available())
    except ProtocolError as e:  # not an object at all
        refused = [e]
    if refused:
        fields = "; ".join(str(e) for e in refused)
        raise SignallingError(400, f"{where}: {fields}", "invalid_session")
    return s


async def client_secrets(request: Request) -> Response:
    """Mint a client secret (a secret never reaches this route: `auth.may_reach`)."""
    gw: Host = request.app.state.gateway
    try:
        data = await loads_off_loop(await read_bytes(request, MAX_CALL_BODY) or b"{}", "the body")
    except SignallingError as e:
        return e.response()
    except ProtocolError as e:
        return _refusal(400, str(e), "invalid_json")
    if not isinstance(data, dict):
        return _refusal(400, "the body must be a JSON object", "invalid_json")
    session = data.get("session") or {}
    expires = data.get("expires_after") or {}
    ttl = expires.get("seconds") if isinstance(expires, dict) else expires
    if ttl is not None and (type(ttl) is not int or not 10 <= ttl <= 7200):
        return _refusal(400, "expires_after.seconds must be 10..7200", "invalid_value")
    try:
        shown = _check_settings(gw, session, "session")
    except SignallingError as e:
        return _refusal(400, str(e), "invalid_value", "session")
    value, expires_at = gw.auth.mint(session, ttl, minted_by=grant_of(request.scope).owner)
    return JSONResponse(
        {"value": value, "expires_at": expires_at, "session": shown.to_openai("sess_pending")}
    )


def _parse_form(kind: str, body: bytes) -> dict[str, str]:
    """multipart/form-data fields as text (the standard library's MIME parser), at most
    `MAX_FORM_PARTS` parts: the parser's time grows with them (20,000 parts of a 1 MiB body
    held the event loop 6.7 s). `SignallingError` for a form that is none, or too many parts."""
    header = email.message.Message()
    header["content-type"] = kind
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary:
        raise SignallingError(400, "a multipart/form-data body needs a boundary", "invalid_form")
    if body.count(b"--" + boundary.encode("utf-8", "replace")) > MAX_FORM_PARTS + 1:
        raise SignallingError(413, f"a form has at most {MAX_FORM_PARTS} parts", "too_large")
    head = f"Content-Type: {kind}\r\nMIME-Version: 1.0\r\n\r\n".encode("utf-8", "replace")
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    fields = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            try:
                fields[name] = payload.decode("utf-8") if isinstance(payload, bytes) else ""
            except UnicodeDecodeError:
                raise SignallingError(
                    400, f"the form's {name!r} is not UTF-8 text", "invalid_form"
                ) from None
    return fields


async def create_call(request: Request) -> Response:
    gw: Host = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    grant = grant_of(request.scope)
    kind = request.headers.get("content-type", "")
    try:
        body = await read_bytes(request, MAX_CALL_BODY)
        if kind.split(";")[0].strip().lower() == "application/sdp":
            sdp, session = body.decode("utf-8", "replace"), {}
        elif kind.lower().startswith("multipart/form-data"):
            # Off the event loop: a 1 MiB part of short lines takes the parser ~0.1 s.
            fields = await asyncio.to_thread(_parse_form, kind, body)
            if "sdp" not in fields:
                raise SignallingError(400, "the form has no `sdp` field", "invalid_sdp")
            sdp = fields["sdp"]
            try:
                session = await loads_off_loop(fields.get("session") or "{}", "`session`")
            except ProtocolError as e:
                raise SignallingError(400, str(e), "invalid_json") from None
            _check_settings(gw, session, "session")
        else:
            raise SignallingError(
                415, "send the offer as application/sdp, or multipart/form-data with `sdp`"
            )
        session = session if isinstance(session, dict) else {}
        bound = (grant.session or {}).get("type")
        if bound is not None and session.get("type", bound) != bound:
            # A secret minted for transcription must not start an answering session.
            raise SignallingError(
                400,
                f"session.type: this client secret's session is a {bound} session; a call it "
                "starts cannot change its type",
                "invalid_session",
            )
        settings = merge(grant.session or {}, session)
        call, answer = await calls.create(sdp, settings, grant)
    except SignallingError as e:
        return e.response()
    return sdp_answer(answer, f"/v1/realtime/calls/{call.id}")


async def hangup(request: Request) -> Response:
    return await end_call(request, request.path_params["call_id"])


def routes() -> list[Route]:
    return [
        Route("/v1/realtime/client_secrets", client_secrets, methods=["POST"]),
        Route("/v1/realtime/calls", create_call, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", hangup, methods=["POST"]),
    ]
