"""`/v1/realtime`: the OpenAI Realtime protocol over a WebSocket, around one `Session`.

The receive loop turns each message into `Session.handle`; a refused or malformed event gets an
`error` event and the connection goes on. The send loop forwards the session's events and, on a
20 ms tick, reads the playout queue as far as real time allows (plus `send_ahead_ms` of slack
for the client's jitter buffer) and sends it as audio deltas in the session's output format.
Beta clients (`OpenAI-Beta: realtime=v1`) get the beta event names and session shape.
A connection that drops (no close frame) leaves its session waiting for the client to resume it
(`resume.py`, an extension of the protocol; `realtime.resume_window_s`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime_omni.aio import ReadPace, within
from realtime_omni.gateway.auth import grant_of, offered_subprotocols
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.protocol.events import error_event, event_id
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.channel import EventChannel, closed_by_client, message_text
from realtime_omni.gateway.transports.resume import TAKEN_OVER, Link, ResumeRefused

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host

log = logging.getLogger(__name__)
TICK_S = 0.02
SEND_TIMEOUT_S = 10.0  # a client that reads nothing for this long is dropped


class RealtimeConnection:
    def __init__(
        self,
        ws: WebSocket,
        session: Session,
        gw: Host,
        beta: bool,
        label: str = "websocket",
        link: Link | None = None,
    ) -> None:
        self.ws, self.session, self.gw, self.beta = ws, session, gw, beta
        # label: the event log's name for the connection, websocket | sideband
        self.channel = EventChannel(session, gw.event_log, label, beta)
        self.link = link  # a resumable session's: what was sent is kept for the next connection
        self._sent_s = 0.0  # audio seconds the last send_audio sent

    async def send(self, event: dict[str, Any]) -> None:
        wire = self.channel.outgoing(event)
        if wire is not None:
            text = json.dumps(wire)
            if self.link is not None and event["type"] != "response.output_audio.delta":
                # Before the send: a send that fails may have gone.
                self.link.replay.sent(wire["event_id"], text)
            await self.send_text(text)

    async def send_text(self, text: str) -> None:
        await within(self.ws.send_text(text), SEND_TIMEOUT_S)

    async def send_all(self, events: list[dict[str, Any]]) -> None:
        """Send in order; what a failed send leaves unsent is kept for a resume."""
        for i, event in enumerate(events):
            try:
                await self.send(event)
            except BaseException:
                if self.link is not None:
                    self.link.replay.unsent.extend(events[i + 1 :])
                raise

    async def receive_loop(self) -> bool:
        """Hand the client's messages to the session until it disconnects; True when it
        closed the connection itself (a close frame, whatever its code), False when the
        connection was lost."""
        limit = self.gw.config.max_message_bytes
        pace = ReadPace(self.gw.config.max_client_bytes_per_s, 2 * limit)
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return closed_by_client(msg)
            text = message_text(msg)
            await pace.took(len(text))
            err = await self.session.handle_text(text, limit)
            if err is not None:
                await self.send(err)

    async def send_loop(self) -> None:
        s = self.session
        ahead = self.gw.config.send_ahead_ms / 1000
        credit, last = ahead, time.monotonic()  # seconds of audio the clock allows to send
        next_tick = last
        get: asyncio.Task[dict[str, Any]] | None = None
        try:
            while True:
                if get is None:
                    get = asyncio.create_task(s.next_event())
                # Wake on an event, on fresh audio (so a first chunk leaves at once) or the tick.
                audio = asyncio.create_task(s.audio_written.wait())
                wait_s = max(0.0, next_tick - time.monotonic())
                try:
                    await asyncio.wait({get, audio}, timeout=wait_s, return_when="FIRST_COMPLETED")
                finally:  # also when the connection's end cancels this loop mid-wait
                    audio.cancel()
                if get.done():
                    batch = [get.result(), *s.pending_events()]
                    get = None
                    await self.send_all(batch)
                now = time.monotonic()
                if now < next_tick and not s.audio_written.is_set():
                    continue
                s.audio_written.clear()
                next_tick = max(next_tick + TICK_S, now) if now >= next_tick else next_tick
                credit = min(ahead + TICK_S, credit + now - last)
                last = now
                await self.send_audio(credit)
                credit -= self._sent_s
        finally:
            if get is not None:
                if get.done() and not get.cancelled() and self.link is not None:
                    self.link.replay.unsent.append(get.result())  # taken, never sent
                get.cancel()

    async def send_audio(self, credit_s: float) -> None:
        s = self.session
        r = s.read_output(int(credit_s * s.output_rate), pad=False)
        self._sent_s = len(r.pcm) / s.output_rate
        fmt = s.settings.output_format
        for item_id, off, n in r.items:
            if self.link is not None:
                self.link.replay.audio(item_id, r.pcm[off : off + n])
            delta = base64.b64encode(fmt.encode(r.pcm[off : off + n])).decode()
            await self.send(
                {
                    "type": "response.output_audio.delta",
                    "response_id": s.response_of(item_id),
                    "item_id": item_id,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": delta,
                }
            )


async def sideband(ws: WebSocket, call_id: str, subprotocol: str | None, beta: bool) -> None:
    """`/v1/realtime?call_id=`: a copy of a WebRTC call's events from now on, and client events
    for its session (OpenAI's sideband connection); it ends with the call, the call goes on
    without it. An API key's holder may attach to its own calls and those of the secrets it
    minted (an admin key to any), a client secret to its own calls only (another's is "no such
    call", as one that does not exist)."""
    gw: Host = ws.app.state.gateway
    call = ws.app.state.webrtc.calls.get(call_id)
    grant = grant_of(ws.scope)
    if call is None or not gw.auth.owns(grant, call.session.owner):
        await ws.close(code=1008, reason="no such call")
        return
    await ws.accept(subprotocol=subprotocol)
    session = call.session
    conn = RealtimeConnection(ws, session, gw, beta, label="sideband")
    events = session.subscribe()

    async def pump() -> None:
        await conn.send(
            {"type": "session.updated", "session": session.settings.to_openai(session.id)}
        )
        while (ev := await events.get()) is not None:
            await conn.send(ev)

    tasks = [asyncio.create_task(pump()), asyncio.create_task(conn.receive_loop())]
    tasks.append(asyncio.create_task(call.ended.wait()))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        session.unsubscribe(events)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close()


async def realtime_endpoint(ws: WebSocket) -> None:
    gw: Host = ws.app.state.gateway
    # A browser's `realtime` subprotocol (its key rides in another, auth.py) is echoed back;
    # a browser fails the handshake otherwise.
    offered = offered_subprotocols(ws.scope)
    subprotocol = "realtime" if "realtime" in offered else None
    beta = (
        "realtime=v1" in ws.headers.get("openai-beta", "") or "openai-beta.realtime-v1" in offered
    )
    call_id = ws.query_params.get("call_id")
    if call_id:
        await sideband(ws, call_id, subprotocol, beta)
        return
    await ws.accept(subprotocol=subprotocol)
    grant = grant_of(ws.scope)
    token = resume_token(ws)
    if token is not None:
        await resume(ws, gw, token, grant.owner, beta)
        return
    if (refused := gw.refusal(grant)) is not None:
        message, code = refused
        err = error_event(message, code, kind="server_error")
        await ws.send_text(json.dumps({"event_id": event_id(), **err}))
        await ws.close(code=1013, reason=code.replace("_", " "))  # 1013: try again later
        return
    session = admit(gw, model=ws.query_params.get("model") or "qwen3-omni", owner=grant.owner)
    secret = grant.session or {}  # a client secret's settings, checked when it was minted
    if ws.query_params.get("intent") == "transcription" and not secret.get("type"):
        session.configure({"type": "transcription"})  # else the secret's type decides
    if secret:
        session.configure(secret)
    try:
        await session.start()
    except BaseException:
        await release(gw, session)
        raise
    await attend(ws, gw, session, beta, gw.resumes.hold(session, grant.owner))


RESUME_SUBPROTOCOL = "realtime-omni-resume."


def resume_token(ws: WebSocket) -> str | None:
    """The resume token a reconnect carries: `?resume=`, the `X-Resume-Token` header, or a
    browser's subprotocol `realtime-omni-resume.<token>` (resume.py); None: a new session."""
    token = ws.query_params.get("resume") or ws.headers.get("x-resume-token")
    for p in offered_subprotocols(ws.scope) if token is None else ():
        if p.startswith(RESUME_SUBPROTOCOL):
            return p[len(RESUME_SUBPROTOCOL) :]
    return token


async def resume(ws: WebSocket, gw: Host, token: str, owner: str, beta: bool) -> None:
    """`/v1/realtime?resume=<token>`: the session a dropped connection left, back on this one
    (`resume.py` says what the client may add and what it gets)."""
    q = ws.query_params
    try:
        ack = None
        if q.get("item_id") is not None or q.get("audio_end_ms") is not None:
            try:
                ack = (q["item_id"], int(q["audio_end_ms"]))
            except (KeyError, ValueError):
                raise ResumeRefused(
                    "invalid_resume_ack",
                    "the playback ack takes both item_id and audio_end_ms (whole milliseconds)",
                ) from None
        cut = q.get("answer", "continue")
        if cut not in ("continue", "cut"):
            raise ResumeRefused("invalid_resume_ack", "answer is continue or cut")
        link = await gw.resumes.take(token, owner)
    except ResumeRefused as e:
        err = error_event(str(e), e.code, "resume")
        await ws.send_text(json.dumps({"event_id": event_id(), **err}))
        await ws.close(code=1008, reason=e.code.replace("_", " "))
        return
    replayed: list[str] = []
    last = q.get("last_event_id")
    if last is not None:
        after = link.replay.after(last)
        if after is None:
            lost = error_event(
                f"the events sent before last_event_id {last} are no longer kept; what followed "
                "it is not replayed",
                "resume_events_lost",
                "last_event_id",
            )
            after = [json.dumps({"event_id": event_id(), **lost})]
        replayed = after
    await attend(ws, gw, link.session, beta, link, replayed, ack, cut == "cut")


def _played(link: Link, item_id: str, audio_end_ms: int, cut: bool) -> list[dict[str, Any]]:
    """The playback ack: the client events that make the session match what it heard (none
    when the answer goes on, after the unheard audio is put back)."""
    s = link.session
    truncate = {
        "type": "conversation.item.truncate",
        "item_id": item_id,
        "content_index": 0,
        "audio_end_ms": audio_end_ms,
    }
    active = s.responding is not None and s.response_of(item_id) == s.active_response
    if active and not cut:
        unheard = s.playout.played.get(item_id, 0) - audio_end_ms * s.output_rate // 1000
        if unheard > 0:
            s.playout.unread(item_id, link.replay.unheard(item_id, unheard))
            s.audio_written.set()
        return []
    return [{"type": "response.cancel"}, truncate] if active else [truncate]


async def attend(
    ws: WebSocket,
    gw: Host,
    session: Session,
    beta: bool,
    link: Link | None,
    replayed: list[str] | None = None,
    ack: tuple[str, int] | None = None,
    cut: bool = False,
) -> None:
    """Serve `session` on this connection until it ends; then release the session, or, when
    the connection was lost and the session is resumable, leave it waiting for its client."""
    conn = RealtimeConnection(ws, session, gw, beta, link=link)
    sender: asyncio.Task[None] | None = None
    dropped = True  # ends so unless the client closed
    taken = False
    try:
        resumed = None
        if link is not None:
            resumed = {"token": link.token, "window_s": gw.resumes.window_s}
            resumed["resumed"] = replayed is not None
        for event in conn.channel.opening(resumed):
            await conn.send(event)
        if link is not None:
            for text in replayed or ():
                await conn.send_text(text)
            unsent, link.replay.unsent = link.replay.unsent, []
            await conn.send_all(unsent)
            for client_event in _played(link, *ack, cut) if ack else ():
                err = await session.handle_text(json.dumps(client_event), 1 << 20)
                if err is not None:
                    await conn.send(err)
        sender = asyncio.create_task(conn.send_loop())
        receiver = asyncio.create_task(conn.receive_loop())
        waits: set[asyncio.Task[Any]] = {sender, receiver}
        leave = None if link is None else asyncio.create_task(link.leave.wait())
        if leave is not None:
            waits.add(leave)
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        receiver.cancel()
        if leave is not None:
            leave.cancel()
        taken = leave in done
        if receiver in done and not receiver.cancelled() and receiver.exception() is None:
            dropped = not receiver.result()
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                exc = t.exception()
                if not isinstance(exc, WebSocketDisconnect | TimeoutError | RuntimeError):
                    log.error("connection failed", exc_info=exc)
    except asyncio.CancelledError:
        dropped = False  # the server stops
        raise
    finally:
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        if link is not None and taken:
            link.free.set()  # the connection that resumed it serves it from now
        elif link is not None and dropped and not gw.draining:
            gw.resumes.park(gw, link)
        else:
            if link is not None:
                gw.resumes.forget(link)
                link.free.set()  # a resume waiting for this connection to leave: it ended
            await release(gw, session)
        with contextlib.suppress(Exception):
            if taken:
                await ws.close(code=TAKEN_OVER, reason="resumed on another connection")
            else:
                await ws.close()
