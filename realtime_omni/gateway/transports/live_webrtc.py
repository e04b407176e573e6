"""OpenAI's Live API over WebRTC: the Live events on the call's data channel, the audio on its
media tracks, around the same `Session` and `LiveCall` as the WebSocket (`live.py`).

    POST /v1/live/sessions              JSON {"session": {...session.start's session...},
                                        "transport": {"type": "webrtc", "sdp": offer}}
                                        -> 201 {"session": {"id"}, "transport": {"type":
                                        "webrtc", "sdp": answer}}, Location:
                                        /v1/live/sessions/<id>
    POST /v1/live/sessions/{id}/hangup  end the session (`close_requested`) -> 200

The shape is the openai SDK's `client.live.create(session=..., transport=...)` (openai 3.60,
`LiveCreateParams` / `LiveCreateResponse`): the startup configuration comes with the offer, so
there is no `session.start` on the channel, and the client waits for `session.started` there
before it sends a command. The session object is checked as `session.start`'s is (refused by
name, 400), less `audio.format`: WebRTC negotiates its audio on the media transport (Opus).

The client's audio track feeds the session as on `/v1/webrtc/offer` (`webrtc.py`), continuously:
the input clock is the track's. The server's track plays the session's voice, silence included,
so its frames are the output clock (`out_ms`: the frames sent, 20 ms each) that
`session.output_transcript.delta` and `session.delegation.created` are stamped on. The data
channel ("oai-events", which the client creates) carries the Live client and server events
exactly as the WebSocket does, audio events aside (`session.input_audio.append` is refused: audio
goes on the track; `session.output_audio.delta` is never sent). Sidebands attach as to a
WebSocket session (`/v1/live/sessions/{id}/attach`).

`session.closed` goes on the channel and to the sidebands with its reason: `close_requested`
(`session.close`, after the answer in flight finishes, at most `CLOSE_DRAIN_S`; or the hangup
route), `remote_hangup` (the peer closed its connection: DTLS close), `connection_lost` (ICE
failed, never connected, or the caller's audio stopped during a server drain), `expired` (the
server ended it: its drain ran out, or it shut down).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from realtime_omni.gateway.auth import grant_of
from realtime_omni.gateway.config import merge
from realtime_omni.gateway.protocol.events import ProtocolError, event_id, loads
from realtime_omni.gateway.protocol.live import LiveError, StartConfig, live_error, parse_start
from realtime_omni.gateway.transports.live import CLOSE_DRAIN_S, TICK_S, LiveCall
from realtime_omni.gateway.transports.webrtc import (
    MAX_BUFFERED_BYTES,
    MAX_OFFER_BYTES,
    SignallingError,
    WebRtcCall,
    WebRtcCalls,
    read_bytes,
)
from realtime_omni.gateway.transports.webrtc_media import PLAYOUT_FRAME_SAMPLES

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
MAX_BODY = 4 * MAX_OFFER_BYTES  # an offer and its session (startup history included)
FLUSH_S = 2.0  # after session.closed: how long the data channel may take to deliver it


class LiveWebRtcCall(WebRtcCall):
    """A WebRTC call that speaks the Live API on its data channel (`LiveCall` translates)."""

    def __init__(
        self, calls: WebRtcCalls, session: Session, config: StartConfig, registry: dict[str, Any]
    ) -> None:
        super().__init__(calls, session)
        self.live = LiveCall(session, config, calls.gw)
        self.live.audio_on_track = True  # `session.input_audio.append` is refused
        self.registry = registry  # app.state.live: the sidebands find the session there
        self.reason: str | None = None  # session.closed's, once the call is ending

    # ---- setup: the startup history, then session.started before anything else ---------

    def opening(self) -> list[dict[str, Any]]:
        return []

    async def answer(self, sdp: str) -> str:
        for item in self.live.config.history_events():
            await self.session.handle(item)  # ProtocolError: the route answers 400
        self.live.live.started_s = time.monotonic()
        self.registry[self.id] = self.live
        self.send_event({"type": "session.started", "session": self.live.resource()})
        answer = await super().answer(sdp)
        self._spawn(self._watch_close())
        return answer

    # ---- events ------------------------------------------------------------------------

    def _clock(self) -> None:
        self.live.out_samples = self.track.frames * PLAYOUT_FRAME_SAMPLES

    def send_event(self, event: dict[str, Any]) -> None:
        """A Live event on the data channel (kept until it opens) and to the sidebands; the
        track's `output_audio_buffer.*` (Realtime's WebRTC events) are not Live events."""
        if event["type"].startswith("output_audio_buffer."):
            return
        if "event_id" not in event:
            event = {"event_id": event_id(), **event}
            self.live.log("live", event)  # the Live API, whichever transport
            self.live.publish(event)
        ch = self.channel
        if ch is None or ch.readyState != "open":
            self._backlog.append(event)
            return
        ch.send(json.dumps(event))
        if ch.bufferedAmount > MAX_BUFFERED_BYTES:
            self.end(f"the client left {ch.bufferedAmount} bytes of events unread")

    async def _pump_events(self) -> None:
        while True:
            ev = await self.session.next_event()
            self._clock()
            for reply in await self.live.run(self.live.live.server(ev, self.live.out_ms)):
                self.send_event(reply)

    async def _handle_inbox(self) -> None:
        while True:
            raw = await self._inbox.get()
            if isinstance(raw, bytes):
                raw = raw.decode("utf-8", "replace")
            self._clock()
            for reply in await self.live.handle(raw):
                self.send_event(reply)

    # ---- the end -------------------------------------------------------------------------

    async def _watch_close(self) -> None:
        """`session.close` (from the channel or a sideband): the answer in flight may finish,
        up to `CLOSE_DRAIN_S`; then the usage, `session.closed`, and the call ends."""
        await self.live.close_requested.wait()
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while self.live.live.responding and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        with contextlib.suppress(Exception):
            await self.session.cancel_response("client_cancelled")
        self.send_event({"type": "session.usage.updated", "usage": self.live.live.usage()})
        await self.finish(self.live.live.closing or "close_requested")

    async def finish(self, reason: str) -> None:
        """Send `session.closed` and let the data channel deliver it, then end the call."""
        self._closed_event(reason)
        deadline = time.monotonic() + FLUSH_S
        while time.monotonic() < deadline and not self._delivered():
            await asyncio.sleep(TICK_S)
        self.end(f"session.closed ({reason})")

    def _delivered(self) -> bool:
        """Nothing of the channel's is left unacknowledged (a closing peer connection aborts
        its SCTP association, and what it still held is lost)."""
        ch, sctp = self.channel, self.pc.sctp
        if ch is None or ch.readyState != "open":
            return True
        if ch.bufferedAmount:
            return False
        queues = ("_outbound_queue", "_sent_queue", "_data_channel_queue")
        return sctp is None or not any(getattr(sctp, q, None) for q in queues)

    def _closed_event(self, reason: str) -> None:
        if self.reason is not None:
            return
        self.reason = reason
        closed = self.live.end(reason)  # to the sidebands, which then end
        ch = self.channel
        if ch is not None and ch.readyState == "open":
            with contextlib.suppress(Exception):
                ch.send(json.dumps({"event_id": event_id(), **closed}))

    def end(self, reason: str) -> None:
        if self.reason is None:  # the connection's doing, not a close
            lost = "remote_hangup" if reason == "connection closed" else "connection_lost"
            self._closed_event(lost)
        super().end(reason)

    async def close(self) -> None:
        self._closed_event("expired")  # ended by the server (its drain's deadline, shutdown)
        self.registry.pop(self.id, None)
        await super().close()


# ---- routes ----------------------------------------------------------------------------


def _refusal(status: int, e: ProtocolError) -> JSONResponse:
    return JSONResponse(live_error(e), status_code=status)


def _parse(body: bytes, gw: Host) -> tuple[StartConfig, str]:
    """The request's startup configuration and offer; `LiveError` naming what is refused."""
    data = loads(body, "the body")
    if not isinstance(data, dict):
        raise LiveError("the body must be a JSON object {session, transport}", param="body")
    transport = data.get("transport")
    if not isinstance(transport, dict) or transport.get("type") != "webrtc":
        raise LiveError("transport: {type: webrtc, sdp}", param="transport.type")
    if not isinstance(transport.get("sdp"), str) or not transport["sdp"]:
        raise LiveError("transport.sdp: the SDP offer, a string", param="transport.sdp")
    session = data.get("session")
    if isinstance(session, dict) and (session.get("audio") or {}).get("format") is not None:
        raise LiveError(
            "session.audio.format: WebRTC negotiates its audio on the media track (Opus)",
            param="session.audio.format",
        )
    return parse_start(session, gw.voices), transport["sdp"]


async def create_session(request: Request) -> Response:
    gw: Host = request.app.state.gateway
    calls: WebRtcCalls = request.app.state.webrtc
    registry: dict[str, Any] = request.app.state.live
    grant = grant_of(request.scope)
    try:
        raw = await read_bytes(request, MAX_BODY)
        config, sdp = await asyncio.to_thread(_parse, raw, gw)  # a megabyte: off the loop
        settings = merge(grant.session or {}, config.realtime_session())

        def make(calls: WebRtcCalls, session: Session) -> WebRtcCall:
            return LiveWebRtcCall(calls, session, config, registry)

        call, answer = await calls.create(sdp, settings, grant, make, "live_webrtc")
    except SignallingError as e:
        return e.response()
    except ProtocolError as e:
        return _refusal(400, e)
    body = {
        "session": {"id": call.id},
        "transport": {"type": "webrtc", "sdp": answer},
    }
    headers = {"Location": f"/v1/live/sessions/{call.id}"}
    return JSONResponse(body, status_code=201, headers=headers)


async def hangup(request: Request) -> Response:
    """End a Live session (`close_requested`), WebRTC or WebSocket: 200, or 404 for none. A
    client secret ends its own only."""
    live: LiveCall | None = request.app.state.live.get(request.path_params["session_id"])
    grant = grant_of(request.scope)
    if live is None or not request.app.state.gateway.auth.owns(grant, live.session.owner):
        return SignallingError(404, "no such session", "session_not_found").response()
    call = request.app.state.webrtc.calls.get(live.id)
    if isinstance(call, LiveWebRtcCall):
        await call.finish("close_requested")
        await call.ended.wait()
    else:  # a WebSocket session: its connection drains and closes
        live.live.closing = live.live.closing or "close_requested"
        live.close_requested.set()
    return Response(status_code=200)


def routes() -> list[Route]:
    return [
        Route("/v1/live/sessions", create_session, methods=["POST"]),
        Route("/v1/live/sessions/{session_id}/hangup", hangup, methods=["POST"]),
    ]
