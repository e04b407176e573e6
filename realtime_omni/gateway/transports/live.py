"""`/v1/live/sessions`: OpenAI's full-duplex Live API over a WebSocket, around one `Session`
(the same session, turn-taking and pipeline as `/v1/realtime`; `protocol/live.py` translates).

    WS /v1/live/sessions                 first message `session.start`, answered by
                                         `session.started`; then audio both ways, continuously
    WS /v1/live/sessions/{id}/attach     the sideband: a copy of the session's Live events (not
                                         its audio) and Live client events for it

The server owns every turn: the session's VAD ends a turn and answers, speech over the answer
cuts it (the session flushes its audio), no client event cancels one. Output is a real-time
stream of `session.output_audio.delta`, silence included, so the client's clock and the
transcripts' `start_ms` / `end_ms` are the audio's; answer audio may run `send_ahead_ms` ahead.
`session.close` lets the answer in flight finish (at most `CLOSE_DRAIN_S`), then sends
`session.usage.updated` and `session.closed` and closes the socket.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime_omni.aio import ReadPace, within
from realtime_omni.gateway.auth import grant_of
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.media.input_buffer import b64_seconds
from realtime_omni.gateway.protocol.events import (
    INLINE_JSON_BYTES,
    ProtocolError,
    audio_too_fast,
    checked_event_id,
    event_id,
    loads_off_loop,
)
from realtime_omni.gateway.protocol.live import (
    LiveError,
    LiveProtocol,
    StartConfig,
    Step,
    live_error,
    parse_start,
)
from realtime_omni.gateway.transports.channel import closed_by_client, message_text

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host
    from realtime_omni.gateway.session.driver import Session

log = logging.getLogger(__name__)
TICK_S = 0.02
SILENCE_MIN_S = 0.04  # silence goes out in pieces at least this long (half the events)
START_TIMEOUT_S = 10.0  # for the first message, session.start
SEND_TIMEOUT_S = 10.0  # a client that reads nothing for this long is dropped
CLOSE_DRAIN_S = 3.0  # session.close: the answer in flight may finish this long
LISTENER_EVENTS = 10000  # a sideband this far behind is dropped


class LiveCall:
    """One Live session: its `Session`, its translation state and its attached sidebands.
    `handle` takes a Live client event from any connection and returns the replies for that
    connection; events for everyone go out through `publish` (the main connection's send loop
    calls it)."""

    def __init__(self, session: Session, config: StartConfig, gw: Host) -> None:
        self.session, self.config, self.gw = session, config, gw
        self.live = LiveProtocol(config)
        self.listeners: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.ended = asyncio.Event()
        self.close_requested = asyncio.Event()
        self.out_samples = 0  # output sent so far: the session's output clock
        self.audio_on_track = False  # WebRTC: input audio comes on the media track only
        # It lasts `realtime.live_max_session_s` at most, then ends with reason `expired`.
        max_s = gw.config.realtime.live_max_session_s
        self.expires_at = int(time.time() + max_s)
        self._expiry = asyncio.get_running_loop().call_later(max_s, self._expire)

    @property
    def id(self) -> str:
        return self.session.id

    @property
    def out_ms(self) -> int:
        return self.out_samples * 1000 // self.session.output_rate

    def resource(self) -> dict[str, Any]:
        return self.config.to_live(self.id, self.expires_at)

    def _expire(self) -> None:
        self.live.closing = self.live.closing or "expired"
        self.close_requested.set()

    def log(self, label: str, event: dict[str, Any]) -> None:
        if self.gw.event_log is not None:
            self.gw.event_log.write(self.id, label, False, event)

    async def run(self, step: Step) -> list[dict[str, Any]]:
        """Carry out a step; the Live events it makes for the connection that caused it."""
        replies = list(step.send)
        for ev in step.handle:
            try:
                await self.session.handle(ev)
            except ProtocolError as e:
                if not self.live.refused(ev, e):
                    replies.append(live_error(e))
        if step.audio is not None and len(step.audio):
            self.session.push_audio(step.audio, self.config.format.rate_hz, paid=True)
        if step.close is not None:
            self.close_requested.set()
        for r in replies:
            if r["type"] == "session.updated":
                r["session"] = self.resource()
        return replies

    async def handle(self, raw: str) -> list[dict[str, Any]]:
        """One Live client event as received (a message of at most `max_message_bytes`); the
        replies (acks, errors) for its sender."""
        limit = self.gw.config.max_message_bytes
        if len(raw) > limit:
            return [live_error(LiveError(f"a message is at most {limit} bytes", code="too_large"))]
        client_event_id = None
        try:
            ev = await loads_off_loop(raw, "the event")
            client_event_id = checked_event_id(ev)
            audio = isinstance(ev, dict) and ev.get("type") == "session.input_audio.append"
            if audio and self.audio_on_track:
                raise LiveError(
                    "on WebRTC the audio goes on the media track, not the data channel",
                    code="invalid_event",
                    param="type",
                )
            if audio and isinstance(ev.get("audio"), str):
                # The session's one audio credit, paid before the decoding (`push_audio`'s
                # `paid`); a large append is decoded off the event loop.
                fmt, credit = self.config.format, self.session.audio_credit
                seconds = b64_seconds(len(ev["audio"]), fmt.sample_bytes, fmt.rate_hz)
                if not credit.take(seconds, time.monotonic()):
                    raise audio_too_fast(seconds, credit.speed, credit.burst_s)
                if len(raw) > INLINE_JSON_BYTES:
                    return await self.run(
                        await asyncio.to_thread(self.live.client, ev, self.out_ms)
                    )
            return await self.run(self.live.client(ev, self.out_ms))
        except ProtocolError as e:
            return [live_error(e, client_event_id)]

    def publish(self, event: dict[str, Any]) -> None:
        """A copy to every sideband (not audio); one that fell behind is dropped."""
        if event["type"] == "session.output_audio.delta":
            return
        for q in list(self.listeners):
            if q.full():
                self.listeners.remove(q)
                q.get_nowait()
                q.put_nowait(None)
            else:
                q.put_nowait(event)

    def end(self, reason: str) -> dict[str, Any]:
        self._expiry.cancel()
        closed = {"type": "session.closed", "reason": reason, "session": self.resource()}
        closed["usage"] = self.live.usage()
        self.publish({"event_id": event_id(), **closed})
        for q in self.listeners:
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(None)
        self.ended.set()
        return closed


class LiveConnection:
    """The WebSocket that started a Live session: its receive loop and its send loop (the
    session's events translated, and the output's clock)."""

    def __init__(self, ws: WebSocket, call: LiveCall) -> None:
        self.ws, self.call = ws, call
        self.session = call.session
        self.hung_up = False  # the client closed the socket with a close frame

    async def send(self, event: dict[str, Any]) -> None:
        event = {"event_id": event_id(), **event}
        self.call.log("live", event)
        self.call.publish(event)
        await within(self.ws.send_text(json.dumps(event)), SEND_TIMEOUT_S)

    async def receive_loop(self) -> None:
        config = self.call.gw.config
        pace = ReadPace(config.max_client_bytes_per_s, 2 * config.max_message_bytes)
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                self.hung_up = closed_by_client(msg)
                return
            text = message_text(msg)
            await pace.took(len(text))
            for reply in await self.call.handle(text):
                await self.send(reply)

    async def on_session_event(self, ev: dict[str, Any]) -> None:
        for reply in await self.call.run(self.call.live.server(ev, self.call.out_ms)):
            await self.send(reply)

    async def send_loop(self) -> None:
        """Session events as Live events; output audio on the session's clock: silence for the
        time gone by, answer audio up to `send_ahead_ms` ahead of it."""
        s, call = self.session, self.call
        rate, ahead = s.output_rate, self.call.gw.config.send_ahead_ms / 1000
        t0 = time.monotonic()
        get: asyncio.Task[dict[str, Any]] | None = None
        try:
            while True:
                if get is None:
                    get = asyncio.create_task(s.next_event())
                audio = asyncio.create_task(s.audio_written.wait())
                try:
                    await asyncio.wait({get, audio}, timeout=TICK_S, return_when="FIRST_COMPLETED")
                finally:
                    audio.cancel()
                if get.done():
                    await self.on_session_event(get.result())
                    get = None
                    for ev in s.pending_events():
                        await self.on_session_event(ev)
                s.audio_written.clear()
                due = int((time.monotonic() - t0) * rate) - call.out_samples
                r = s.read_output(max(0, due + int(ahead * rate)), pad=False)
                pcm = r.pcm
                if len(pcm) < due and (len(pcm) or due >= SILENCE_MIN_S * rate):
                    pcm = np.concatenate([pcm, np.zeros(due - len(pcm), np.float32)])
                if len(pcm):
                    call.out_samples += len(pcm)
                    delta = base64.b64encode(call.config.format.encode(pcm)).decode()
                    await self.send({"type": "session.output_audio.delta", "delta": delta})
        finally:
            if get is not None:
                get.cancel()

    async def drain(self) -> None:
        """After session.close: the answer in flight may finish, up to `CLOSE_DRAIN_S`."""
        deadline = time.monotonic() + CLOSE_DRAIN_S
        while self.call.live.responding and time.monotonic() < deadline:
            await asyncio.sleep(TICK_S)
        with contextlib.suppress(Exception):
            await self.session.cancel_response("client_cancelled")


async def _refuse(ws: WebSocket, e: ProtocolError, client_event_id: Any, code: int) -> None:
    ev = {"event_id": event_id(), **live_error(e, client_event_id)}
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(ev))
        await ws.close(code=code, reason=e.code.replace("_", " "))


async def _first_message(ws: WebSocket, max_bytes: int) -> dict[str, Any]:
    """The `session.start` that must come first, of at most `max_bytes` (as every message);
    `LiveError` for anything else."""
    try:
        msg = await within(ws.receive(), START_TIMEOUT_S)
    except TimeoutError:
        raise LiveError(
            f"no session.start within {START_TIMEOUT_S:.0f} s", code="session_start_timeout"
        ) from None
    if msg["type"] == "websocket.disconnect":
        raise WebSocketDisconnect()
    raw = message_text(msg)
    if len(raw) > max_bytes:
        raise LiveError(f"a message is at most {max_bytes} bytes", code="too_large")
    ev = await loads_off_loop(raw, "event")
    if not isinstance(ev, dict) or ev.get("type") != "session.start":
        raise LiveError(
            "the first message must be session.start", code="session_not_started", param="type"
        )
    return ev


async def live_endpoint(ws: WebSocket) -> None:
    gw: Host = ws.app.state.gateway
    calls: dict[str, LiveCall] = ws.app.state.live
    grant = grant_of(ws.scope)
    await ws.accept()
    start_id = None
    try:
        start = await _first_message(ws, gw.config.max_message_bytes)
        start_id = checked_event_id(start)
        config = parse_start(start.get("session"), gw.voices)
    except WebSocketDisconnect:
        return
    except ProtocolError as e:
        await _refuse(ws, e, start_id, 1008)
        return
    if (refused := gw.refusal(grant)) is not None:
        message, code = refused
        await _refuse(ws, LiveError(message, code=code), start_id, 1013)
        return
    session = admit(gw, config.model, config.format.rate_hz, transport="live", owner=grant.owner)
    call = LiveCall(session, config, gw)
    conn = LiveConnection(ws, call)
    tasks: list[asyncio.Task[Any]] = []
    reason = "connection_lost"
    try:
        if grant.session:  # a client secret's settings, checked when it was minted
            session.configure(grant.session)
        for refusal in session.configure(config.realtime_session()):
            log.warning("live session %s: %s", session.id, refusal)
        await session.start()
        for item in config.history_events():
            await session.handle(item)
        calls[session.id] = call
        call.live.started_s = time.monotonic()
        started = {"type": "session.started", "client_event_id": start_id}
        await conn.send({**started, "session": call.resource()})
        tasks = [
            asyncio.create_task(conn.send_loop()),
            asyncio.create_task(conn.receive_loop()),
            asyncio.create_task(call.close_requested.wait()),
        ]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks[2] in done:
            reason = call.live.closing or "close_requested"
            await conn.drain()
            tasks[1].cancel()  # no more input; the sender goes on through the drain above
            await conn.send({"type": "session.usage.updated", "usage": call.live.usage()})
        if tasks[1] in done and conn.hung_up:
            reason = "remote_hangup"  # a graceful close: the sidebands are told so
        for t in done:
            if t is not tasks[2] and not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if not isinstance(exc, WebSocketDisconnect | TimeoutError | RuntimeError):
                    log.error("live connection failed", exc_info=exc)
    except ProtocolError as e:  # the startup history refused
        await _refuse(ws, e, start_id, 1008)
        reason = "close_requested"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        closed = call.end(reason)
        calls.pop(session.id, None)
        if reason not in ("connection_lost", "remote_hangup"):
            with contextlib.suppress(Exception):
                await within(ws.send_text(json.dumps({"event_id": event_id(), **closed})), 2.0)
        await release(gw, session)
        with contextlib.suppress(Exception):
            await ws.close()


async def attach_endpoint(ws: WebSocket) -> None:
    """The sideband: an API key's holder may attach to any Live session, a client secret to its
    own only (another's is "no such session", as one that does not exist)."""
    call = ws.app.state.live.get(ws.path_params["session_id"])
    grant = grant_of(ws.scope)
    if call is None or not ws.app.state.gateway.auth.owns(grant, call.session.owner):
        await ws.close(code=1008, reason="no such session")
        return
    await ws.accept()
    events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(LISTENER_EVENTS)
    call.listeners.append(events)

    async def send(event: dict[str, Any]) -> None:
        await within(ws.send_text(json.dumps(event)), SEND_TIMEOUT_S)

    async def pump() -> None:
        await send({"event_id": event_id(), "type": "session.updated", "session": call.resource()})
        while (ev := await events.get()) is not None:
            await send(ev)

    async def receive() -> None:
        config = ws.app.state.gateway.config
        pace = ReadPace(config.max_client_bytes_per_s, 2 * config.max_message_bytes)
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text = message_text(msg)
            await pace.took(len(text))
            for reply in await call.handle(text):
                await send({"event_id": event_id(), **reply})

    tasks = [asyncio.create_task(pump()), asyncio.create_task(receive())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if events in call.listeners:
            call.listeners.remove(events)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close()


def routes() -> list[WebSocketRoute]:
    return [
        WebSocketRoute("/v1/live/sessions", live_endpoint),
        WebSocketRoute("/v1/live/sessions/{session_id}/attach", attach_endpoint),
    ]
