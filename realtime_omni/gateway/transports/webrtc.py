"""WebRTC calls: signalling routes and one aiortc peer connection around one `Session` per call.

Routes (`routes()`, mounted by `app.create_app`):

    POST   /v1/webrtc/offer    JSON {"sdp", "type": "offer"} -> 200 {"sdp", "type": "answer",
                               "session_id"}
    POST   /v1/whip            an application/sdp offer -> 201, the answer as application/sdp,
                               Location: /v1/whip/<session_id>   (WHIP, RFC 9725)
    DELETE /v1/whip/<id>       hang up (any call, however it was made) -> 200

Refusals are JSON `{"error": {"message", "code"}}`: 400 a malformed body or SDP (the reason in
the message), 404 an unknown session, 413 an offer over `MAX_OFFER_BYTES`, 415 WHIP without
`application/sdp`, 429 a client secret at its own limit of live sessions, 503 the server at
`max_sessions` (WebSocket sessions count too): at either limit, a new offer takes the place of
the oldest call of the same grant (key, secret) that has not connected yet, which ends; none, and
the offer is refused. A call made with a client secret starts with the secret's session settings.

A call: the client's audio track (Opus) feeds `Session.push_audio` as each packet arrives
(`webrtc_input.py`, in place of aiortc's jitter buffer);
its video, when sent, the session's latest frame; the server's track plays the session's voice
(`webrtc_media.PlayoutTrack`). The client creates a data channel labelled "oai-events" (OpenAI's
WebRTC convention): the server sends every server event on it as JSON text, `session.created`
first, then what the session emits plus `output_audio_buffer.started|stopped`, and handles the
client events it receives exactly as the WebSocket API does (`error` answers a refused one).
Events made before the channel opens wait, at most `MAX_BACKLOG` of them (the oldest go).

A call ends on DELETE, when its peer connection goes `failed` or `closed` (ICE failure, DTLS
teardown, consent lost), when it has not connected `CONNECT_TIMEOUT_S` after the answer, when the
client stops reading the data channel (`MAX_BUFFERED_BYTES`), in a drain when its caller's audio
has stopped (`WebRtcCalls.end_silent`: a peer gone without hanging up, which ICE takes ~30 s to
notice, does not hold the server's exit), and at shutdown. Ending is
idempotent: the session closes (its response aborted in every stage and awaited), the media and
event tasks are cancelled, the peer connection closes and the call leaves the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc import sdp as aiortc_sdp
from aiortc.mediastreams import MediaStreamTrack
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from realtime_omni.aio import within
from realtime_omni.errors import ConfigError, OmniError
from realtime_omni.gateway.auth import Grant, grant_of
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.protocol.events import ProtocolError, error_event, loads_off_loop
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.channel import EventChannel
from realtime_omni.gateway.transports.ice import rtc_configuration, use_host_addresses
from realtime_omni.gateway.transports.webrtc_input import listen
from realtime_omni.gateway.transports.webrtc_media import PLAYOUT_RATE_HZ, PlayoutTrack, pump_video

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host

log = logging.getLogger(__name__)

EVENTS_LABEL = "oai-events"
MAX_OFFER_BYTES = 256 << 10  # a browser's audio+video offer is 5-20 KB
MAX_MEDIA_SECTIONS = 8  # a browser's call offers 1-3: audio, video, the events channel
# Each candidate an offer names gets STUN checks from this server: UDP to addresses of the
# offerer's choosing. A browser names a few per interface.
MAX_ICE_CANDIDATES = 32
CONNECT_TIMEOUT_S = 30.0  # from the answer to `connected`; then the call is dropped
MAX_BACKLOG = 256  # server events kept while the data channel is not open
MAX_INBOX = 256  # client events received and not yet handled; more get an error
MAX_BUFFERED_BYTES = 8 << 20  # data-channel bytes the client has not taken; more ends the call
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class SignallingError(OmniError):
    """A refused offer or hang-up: the HTTP status and a message for the client."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _malformed(what: str, e: Exception) -> SignallingError:
    """400 for an offer aiortc could not take; its exception's words stay in the log."""
    log.info("%s: %r", what, e)
    return SignallingError(400, f"{what} (the server could not parse or answer it)", "invalid_sdp")


def check_offer(text: str, denied: Sequence[IPNetwork] = ()) -> str:
    """The offer as the server will take it, for every WebRTC route: refused (413) past
    `MAX_OFFER_BYTES`, (400) with more media sections or ICE candidates than a call needs
    (counted before parsing: 800 m= lines held the event loop 0.4 s in aiortc's parser), or one
    that aiortc would accept but that can never connect; its candidates in a `denied` network
    taken out (the server would send STUN checks there)."""
    if len(text.encode()) > MAX_OFFER_BYTES:
        raise SignallingError(413, f"an offer is at most {MAX_OFFER_BYTES} bytes", "too_large")
    lines = text.splitlines()
    for prefix, limit, what, code in (
        ("m=", MAX_MEDIA_SECTIONS, "media sections (m=)", "too_many_media_sections"),
        ("a=candidate:", MAX_ICE_CANDIDATES, "ICE candidates", "too_many_ice_candidates"),
    ):
        n = sum(1 for line in lines if line.startswith(prefix))
        if n > limit:
            raise SignallingError(400, f"the offer has {n} {what}; at most {limit}", code)
    try:
        desc = aiortc_sdp.SessionDescription.parse(text)
    except Exception as e:  # aiortc's parser raises many types for many faults
        raise _malformed("malformed SDP offer", e) from None
    if not desc.media:
        raise SignallingError(400, "the SDP offer has no media section (m=)", "invalid_sdp")
    for i, m in enumerate(desc.media):
        where = f"media section {i} ({m.kind})"
        if m.ice is None or not m.ice.usernameFragment or not m.ice.password:
            raise SignallingError(400, f"{where} has no a=ice-ufrag / a=ice-pwd", "invalid_sdp")
        if m.dtls is None or not m.dtls.fingerprints:
            raise SignallingError(400, f"{where} has no DTLS a=fingerprint", "invalid_sdp")
    kept = [line for line in lines if not _denied_candidate(line, denied)]
    if len(kept) < len(lines):
        log.info("offer: %d ICE candidates in denied networks left out", len(lines) - len(kept))
        return "\r\n".join(kept) + "\r\n"
    return text


def denied_networks(cidrs: Sequence[str]) -> list[IPNetwork]:
    """The config's `ice_denied_networks`; ConfigError for one that is not a network."""
    try:
        return [ipaddress.ip_network(c, strict=False) for c in cidrs]
    except ValueError as e:
        raise ConfigError(
            f"ice_denied_networks: {e}. Fix: CIDR networks, as 169.254.0.0/16"
        ) from None


def _denied_candidate(line: str, denied: Sequence[IPNetwork]) -> bool:
    """An `a=candidate:` line (RFC 8839: foundation, component, transport, priority, address,
    port, typ ...) whose address lies in a denied network; a name (mDNS) is not an address."""
    if not denied or not line.startswith("a=candidate:"):
        return False
    fields = line.split()
    try:
        address = ipaddress.ip_address(fields[4])
    except (IndexError, ValueError):
        return False
    return any(address in net for net in denied)


class WebRtcCall:
    """One peer connection and its session. Made by `WebRtcCalls.create`; ended by `close`."""

    def __init__(self, calls: WebRtcCalls, session: Session) -> None:
        self.calls, self.session, self.id = calls, session, session.id
        self.pc = RTCPeerConnection(calls.rtc_config)
        self.track = PlayoutTrack(session, self.send_event)
        self.channel: RTCDataChannel | None = None
        self.events = EventChannel(session, calls.gw.event_log, "webrtc")
        self.connected = asyncio.Event()
        self.ended = asyncio.Event()  # set as the call closes (a sideband connection ends too)
        # When the caller's audio last arrived (monotonic s; from its track's announcement until
        # a first frame); None: the caller sends no audio.
        self.audio_at: float | None = None
        self._backlog: deque[dict[str, Any]] = deque(maxlen=MAX_BACKLOG)
        self._inbox: asyncio.Queue[str | bytes] = asyncio.Queue(MAX_INBOX)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    # ---- setup -------------------------------------------------------------------------

    async def answer(self, sdp: str) -> str:
        """Apply the offer and return the answer, every ICE candidate in it. `SignallingError`
        (400) for an offer that cannot be answered (`check_offer` has passed it)."""
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as e:  # aiortc's parser raises many types for many faults
            raise _malformed("malformed SDP offer", e) from None
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio and self.pc.sctp is None:
            raise SignallingError(
                400, "the offer has neither an audio track nor a data channel", "invalid_sdp"
            )
        if audio:
            self.pc.addTrack(self.track)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as e:
            raise _malformed("the offer cannot be answered", e) from None
        for event in self.opening():
            self.send_event(event)
        self._spawn(self._pump_events())
        self._spawn(self._handle_inbox())
        self._spawn(self._watch_connect())
        return self.pc.localDescription.sdp

    def opening(self) -> list[dict[str, Any]]:
        """The first events on the data channel (a Live call's differ: `live_webrtc.py`)."""
        return self.events.opening()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("call %s: a task failed", self.id, exc_info=t.exception())
            self.end("internal error")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.audio_at = time.monotonic()
            receiver = next(
                (t.receiver for t in self.pc.getTransceivers() if t.receiver.track is track), None
            )
            wait = self.calls.gw.config.realtime.webrtc_reorder_packets
            self._spawn(listen(track, receiver, self.session, wait, self._heard))
        elif track.kind == "video":
            self._spawn(pump_video(track, self.session))

    def _heard(self) -> None:
        self.audio_at = time.monotonic()

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_LABEL or self.channel is not None:
            log.info("call %s: ignoring data channel %r", self.id, channel.label)
            return
        self.channel = channel
        channel.on("open", self._flush_backlog)
        channel.on("message", self._on_message)
        channel.on("close", lambda: setattr(self, "channel", None))
        self._flush_backlog()

    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self.connected.set()
        elif state in ("failed", "closed"):
            self.end(f"connection {state}")

    async def _watch_connect(self) -> None:
        with contextlib.suppress(TimeoutError):
            await within(self.connected.wait(), CONNECT_TIMEOUT_S)
            return
        self.end(f"not connected {CONNECT_TIMEOUT_S:.0f} s after the answer")

    # ---- events ------------------------------------------------------------------------

    def send_event(self, event: dict[str, Any]) -> None:
        """Send a server event on the data channel, or keep it until the channel opens."""
        ch = self.channel
        if ch is None or ch.readyState != "open":
            if len(self._backlog) == MAX_BACKLOG:
                log.warning("call %s: no open data channel; dropping old events", self.id)
            self._backlog.append(event)
            return
        wire = self.events.outgoing(event)
        if wire is not None:
            ch.send(json.dumps(wire))
        if ch.bufferedAmount > MAX_BUFFERED_BYTES:
            self.end(f"the client left {ch.bufferedAmount} bytes of events unread")

    def _flush_backlog(self) -> None:
        ch = self.channel
        while self._backlog and ch is not None and ch.readyState == "open":
            self.send_event(self._backlog.popleft())

    async def _pump_events(self) -> None:
        while True:
            self.send_event(await self.session.next_event())

    def _on_message(self, raw: str | bytes) -> None:
        try:
            self._inbox.put_nowait(raw)
        except asyncio.QueueFull:
            self.send_event(
                error_event(
                    f"more than {MAX_INBOX} client events waiting; this one was dropped",
                    "rate_limit_exceeded",
                )
            )

    async def _handle_inbox(self) -> None:
        limit = self.calls.gw.config.max_message_bytes
        while True:
            raw = await self._inbox.get()
            if isinstance(raw, bytes):
                raw = raw.decode("utf-8", "replace")
            err = await self.session.handle_text(raw, limit)
            if err is not None:
                self.send_event(err)

    # ---- teardown ----------------------------------------------------------------------

    def end(self, reason: str) -> None:
        """Close the call in the background (from callbacks that cannot await)."""
        if not self._closed:
            log.info("call %s ends: %s", self.id, reason)
            self.calls.track_task(self.close())

    async def close(self) -> None:
        """Close the session, the tasks and the peer connection; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.ended.set()
        self.calls.forget(self)
        self.track.stop()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await release(self.calls.gw, self.session)
        finally:
            await self.pc.close()


class WebRtcCalls:
    """The live calls of one gateway, and the counters of those that ended."""

    def __init__(self, gw: Host) -> None:
        self.gw = gw
        self.rtc_config = rtc_configuration(gw.config.ice_servers)
        self.denied = denied_networks(gw.config.ice_denied_networks)
        use_host_addresses(gw.config.ice_host_addresses)
        self.calls: dict[str, WebRtcCall] = {}
        self.totals = {"calls": 0, "frames": 0, "frames_late": 0, "resyncs": 0}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def create(
        self,
        sdp: str,
        settings: dict[str, Any] | None = None,
        grant: Grant | None = None,
        make: Callable[[WebRtcCalls, Session], WebRtcCall] | None = None,
        transport: str = "webrtc",
    ) -> tuple[WebRtcCall, str]:
        """A call for this offer, and its answer; `settings` (a session object: a client
        secret's, a call's) apply before `session.created`; `grant` asks for it; `make` builds
        the call (a Live call: `live_webrtc.py`). `SignallingError` on refusal; a refused or
        failed offer leaves nothing behind."""
        grant = grant or Grant("open")
        sdp = check_offer(sdp, self.denied)  # before a session or a pending call's place
        while (refused := self.gw.refusal(grant)) is not None:
            # An offer that never connected (no ICE yet) yields its place to a new one of the
            # same grant, oldest first: unanswered POSTs cannot lock their own caller out for
            # CONNECT_TIMEOUT_S each, nor take another's place.
            pending = [
                c
                for c in self.calls.values()
                if not c.connected.is_set() and c.session.owner == grant.owner
            ]
            if not pending or self.gw.draining:
                secret = ("client_secret_session_limit", "client_secret_used")
                status = 429 if refused[1] in secret else 503
                raise SignallingError(status, *refused)
            old = pending[0]
            self.forget(old)  # out of the registry and the count now; it closes in the background
            self.gw.sessions.discard(old.session)
            self.gw.auth.uncount(old.session.owner)  # it never connected: no call was made
            old.end("its place went to a newer offer before it connected")
        session = admit(
            self.gw, output_rate_hz=PLAYOUT_RATE_HZ, transport=transport, owner=grant.owner
        )
        call = (make or WebRtcCall)(self, session)
        self.calls[call.id] = call
        self.totals["calls"] += 1
        try:
            if settings:
                session.configure(settings)  # checked when the secret or call was made
            await session.start()
            return call, await call.answer(sdp)
        except BaseException:
            await call.close()
            raise

    def end_silent(self, quiet_s: float) -> None:
        """End, in the background, every call whose caller has sent no audio for `quiet_s`
        (the drain's check for peers gone without hanging up); calls that send none stay."""
        now = time.monotonic()
        for call in list(self.calls.values()):
            if call.audio_at is not None and now - call.audio_at > quiet_s:
                call.end(f"no audio from the caller for {now - call.audio_at:.1f} s in a drain")

    def forget(self, call: WebRtcCall) -> None:
        if self.calls.pop(call.id, None) is call:
            self.totals["frames"] += call.track.frames
            self.totals["frames_late"] += call.track.frames_late
            self.totals["resyncs"] += call.track.resyncs

    def track_task(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def stats(self) -> dict[str, float]:
        """Calls live and made, and the output frames sent and late, ended calls included."""
        live = list(self.calls.values())
        return {
            "live": len(live),
            "calls": self.totals["calls"],
            "frames": self.totals["frames"] + sum(c.track.frames for c in live),
            "frames_late": self.totals["frames_late"] + sum(c.track.frames_late for c in live),
            "resyncs": self.totals["resyncs"] + sum(c.track.resyncs for c in live),
            # The latest frames of the live calls: the most any left after its due time.
            "lateness_ms_max": round(
                max((x for c in live for x in c.track.lateness_ms), default=0), 1
            ),
        }

    async def close(self) -> None:
        for call in list(self.calls.values()):
            await call.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# ---- routes ----------------------------------------------------------------------------


async def read_bytes(request: Request, limit: int, what: str = "the body") -> bytes:
    """The body, refused (413) past `limit` bytes before more than that is read."""
    too_large = SignallingError(413, f"{what} is at most {limit} bytes", "too_large")
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def read_body(request: Request) -> str:
    """An offer's body as text (at most `MAX_OFFER_BYTES`)."""
    try:
        return (await read_bytes(request, MAX_OFFER_BYTES, "an offer")).decode("utf-8")
    except UnicodeDecodeError:
        raise SignallingError(400, "the body is not UTF-8 text", "invalid_sdp") from None


async def offer_endpoint(request: Request) -> Response:
    calls: WebRtcCalls = request.app.state.webrtc
    try:
        raw = await read_body(request)
        try:
            data = await loads_off_loop(raw, "the body")
        except ProtocolError as e:
            raise SignallingError(400, str(e), "invalid_json") from None
        if not isinstance(data, dict) or data.get("type") != "offer":
            raise SignallingError(400, 'the body must be {"sdp": ..., "type": "offer"}')
        if not isinstance(data.get("sdp"), str):
            raise SignallingError(400, "sdp must be a string", "invalid_sdp")
        grant = grant_of(request.scope)
        call, answer = await calls.create(data["sdp"], grant.session, grant)
    except SignallingError as e:
        return e.response()
    return JSONResponse({"sdp": answer, "type": "answer", "session_id": call.id})


async def whip_endpoint(request: Request) -> Response:
    calls: WebRtcCalls = request.app.state.webrtc
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if kind != "application/sdp":
            raise SignallingError(
                415, f"WHIP takes Content-Type application/sdp, not {kind or 'none'!r}"
            )
        grant = grant_of(request.scope)
        call, answer = await calls.create(await read_body(request), grant.session, grant)
    except SignallingError as e:
        return e.response()
    return sdp_answer(answer, f"/v1/whip/{call.id}")


def sdp_answer(answer: str, location: str) -> Response:
    """201 with the answer as application/sdp and the call's URL (WHIP, OpenAI's calls)."""
    return Response(
        answer, status_code=201, media_type="application/sdp", headers={"Location": location}
    )


async def end_call(request: Request, call_id: str) -> Response:
    """Hang up a call by its id (the session's): 200, or 404 for none. A client secret hangs up
    its own calls only (another's is 404, as one that does not exist)."""
    call = request.app.state.webrtc.calls.get(call_id)
    grant = grant_of(request.scope)
    if call is None or not request.app.state.gateway.auth.owns(grant, call.session.owner):
        return SignallingError(404, "no such call", "call_not_found").response()
    await call.close()
    return Response(status_code=200)


async def whip_delete_endpoint(request: Request) -> Response:
    return await end_call(request, request.path_params["session_id"])


def routes() -> list[Route]:
    return [
        Route("/v1/webrtc/offer", offer_endpoint, methods=["POST"]),
        Route("/v1/whip", whip_endpoint, methods=["POST"]),
        Route("/v1/whip/{session_id}", whip_delete_endpoint, methods=["DELETE"]),
    ]
