"""Phone calls through a provider's WebSocket media stream: Twilio, Telnyx, Plivo.

    /v1/phone/twilio   /v1/phone/telnyx   /v1/phone/plivo      (WebSocket, the provider connects)
    POST /v1/phone/twilio/voice                                 (Twilio's voice webhook: TwiML)

The three protocols differ in names only: JSON messages with base64 G.711 at 8 kHz, a `start`
naming the stream, `media` both ways, a mark the provider echoes once the audio before it has
been played, and a message that drops what the provider has queued. A `Dialect`
(`dialects.py`) says how one provider spells them; `PhoneCall` is the one implementation around
a `Session`.

Out: the playout queue is read at 8 kHz in real time plus `lead_ms` (the provider buffers that
much), each read sent as one `media` and followed by a mark. The marks that come back say what
the caller has heard, and a barge-in keeps that much of the answer (`Session.heard_ms`), not
what was sent. When the session drops queued audio (barge-in, cancel) the provider's buffer is
cleared at once, and marks it echoes for the cleared audio are not taken as heard.

In: `media` is decoded, and the session resamples it for the VAD and the model as any other
audio. `dtmf` goes to the session as an event. A call with neither speech nor an answer for
`idle_timeout_s` gets a short goodbye, then the WebSocket closes (the provider ends the call).

Bad input (not JSON, an unknown event, bad base64, `media` before `start`, a second `start`) is
logged and dropped; the call goes on. Streams waiting for their `start` are bounded
(`pending_refusal`): those that showed a credential (a token in the URL, or the provider's
signature on the upgrade) and those that did not (a Twilio stream's token comes in `start`;
with no API keys set nothing is shown) each up to `phone.max_pending_streams`, the latter also
up to `phone.max_pending_streams_per_address` from one address, so streams nobody vouched for
never take a credentialed stream's place. Before `start` a message larger than
`phone.max_start_bytes` ends a stream. The voice webhook's body is read up to
`MAX_WEBHOOK_BYTES`. With a provider's auth token set (`phone.twilio_auth_token_env`,
`phone.plivo_auth_token_env`) only what it signed is taken: Twilio's webhook and stream
upgrades, Plivo's stream upgrades; Telnyx signs no stream upgrade (`signatures.py` says what
each provider signs, and where that is documented).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from xml.sax.saxutils import quoteattr

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from realtime_omni.aio import ReadPace, within
from realtime_omni.gateway.auth import Grant, grant_of
from realtime_omni.gateway.config import PhoneConfig
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.media import audio
from realtime_omni.gateway.protocol.events import ProtocolError, loads_off_loop
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports import phone, signatures
from realtime_omni.gateway.transports.dialects import DIALECTS, BadMessage, Dialect, Inbound, Start
from realtime_omni.gateway.transports.phone import FRAME_SAMPLES, RATE_HZ
from realtime_omni.gateway.transports.webrtc import SignallingError, read_bytes

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host

log = logging.getLogger(__name__)
TICK_S = 0.02
Waiting = tuple[bool, str]  # a stream waiting for `start`: (credentialed, its address)
MAX_MARKS = 3000  # marks awaiting their echo (a minute of 20 ms reads); older ones are dropped
MAX_LOGGED = 5  # bad messages logged per call; the rest are counted
MAX_WEBHOOK_BYTES = 64 << 10  # a voice webhook's form: Twilio's is about 1 KB


@dataclass
class Heard:
    """What the caller has heard of each item, from the provider's marks. No I/O.

    `sent(item, end)` gives the name of the mark to send after audio of `item` up to sample
    `end`; `echoed(name)` takes one back. `cleared()` makes every mark still out void: the
    provider echoes those when its buffer is dropped, but that audio was never played."""

    marks: OrderedDict[str, tuple[str, int]] = field(default_factory=OrderedDict)
    heard: dict[str, int] = field(default_factory=dict)  # item -> samples
    echoes: int = 0  # marks taken back over the call
    _seq: int = 0

    def sent(self, item_id: str, end: int) -> str:
        self._seq += 1
        name = f"m{self._seq}"
        self.marks[name] = (item_id, end)
        while len(self.marks) > MAX_MARKS:
            self.marks.popitem(last=False)
        return name

    def echoed(self, name: str) -> None:
        got = self.marks.pop(name, None)
        if got is None:
            return
        self.echoes += 1
        item_id, end = got
        self.heard[item_id] = max(self.heard.get(item_id, 0), end)
        for older in [n for n, (i, e) in self.marks.items() if i == item_id and e <= end]:
            del self.marks[older]  # a provider may skip marks; the later one says enough

    def cleared(self) -> None:
        self.marks.clear()

    @property
    def pending(self) -> bool:
        return bool(self.marks)


class PhoneCall:
    """One media-stream WebSocket: the provider's protocol around one `Session`."""

    def __init__(
        self, ws: WebSocket, gw: Host, dialect: Dialect, waiting: Waiting = (False, "")
    ) -> None:
        self.ws, self.gw, self.dialect = ws, gw, dialect
        self.waiting = waiting  # (credentialed, address): its place until `start`
        self.name = dialect.name
        self.config: PhoneConfig = gw.config.phone
        # the provider's reads held to the gateway's byte rate (`aio.ReadPace`)
        self._pace = ReadPace(gw.config.max_client_bytes_per_s, 2 * self.config.max_message_bytes)
        self.start: Start | None = None
        self.session: Session | None = None
        self.heard = Heard()
        self._marked = asyncio.Event()  # set on every mark the provider echoes
        self._sent: dict[str, int] = {}  # item -> samples sent
        self._clear = False  # a clear is due
        self._flushes = 0
        # (mark, item, pcm) sent and not yet echoed: what a pause gives back to the playout
        self._unheard: deque[tuple[str, str, np.ndarray]] = deque(maxlen=MAX_MARKS)
        self._wake = asyncio.Event()
        self._bad = 0
        self._decode = audio.ulaw_decode
        self._encode = audio.ulaw_encode

    # ---- the session's hooks -------------------------------------------------------------

    def _heard_ms(self, item_id: str) -> int:
        """Marks when the provider echoes them; what was sent for one that never does."""
        source = self.heard.heard if self.heard.echoes else self._sent
        return source.get(item_id, 0) * 1000 // RATE_HZ

    def _on_flush(self) -> None:
        self._flushes += 1  # a read being sent now stops, and its marks are not made
        self._unheard.clear()
        if self.heard.pending or self._clear:
            self._clear = True
            self.heard.cleared()
            self._wake.set()

    def _on_pause(self) -> None:
        """Clear the provider's buffer too, and put what it had not played back in the
        playout queue: the answer resumes where the caller stopped hearing it."""
        s = self.session
        assert s is not None
        unheard = list(self._unheard)
        self._on_flush()
        for _, item_id, pcm in reversed(unheard):
            s.playout.unread(item_id, pcm)
            self._sent[item_id] -= len(pcm)

    # ---- the call --------------------------------------------------------------------------

    async def _all_heard(self) -> None:
        """Until the provider has echoed the mark of everything sent."""
        while self.heard.pending:
            self._marked.clear()
            await self._marked.wait()

    async def run(self) -> None:
        await self.ws.accept()
        tasks: list[asyncio.Task[Any]] = []
        try:
            if not await self._await_start():
                return
            assert self.session is not None
            tasks = [
                asyncio.create_task(self._send_loop()),
                asyncio.create_task(phone.watch(self.session, self.config, self.name)),
                asyncio.create_task(self._receive_loop()),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if tasks[1] in done:  # idle: let the provider play what it holds, then close
                played = asyncio.create_task(self._all_heard())
                await asyncio.wait([played, tasks[2]], timeout=2 * self.config.lead_ms / 1000 + 0.5)
                played.cancel()
            for t in done:
                exc = None if t.cancelled() else t.exception()
                if exc is not None and not isinstance(exc, WebSocketDisconnect | TimeoutError):
                    log.error("%s call failed", self.dialect.name, exc_info=exc)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.session is not None:
                await release(self.gw, self.session)
                log.info("%s call %r ended", self.dialect.name, self.start and self.start.call_id)
            with contextlib.suppress(Exception):
                await self.ws.close()

    async def _receive(self) -> Inbound | None:
        """The next message; None once the provider has gone."""
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            raw = msg.get("text")
            if raw is None:
                raw = (msg.get("bytes") or b"").decode("utf-8", "replace")
            await self._pace.took(len(raw))
            if self.session is None and len(raw) > self.config.max_start_bytes:
                log.warning(
                    "%s stream: a message of %d bytes before `start` (the limit: %d); closing",
                    self.dialect.name, len(raw), self.config.max_start_bytes,
                )  # fmt: skip
                return None
            try:
                if len(raw) > self.config.max_message_bytes:
                    raise BadMessage(f"message of {len(raw)} bytes is over the limit")
                data = await loads_off_loop(raw)
                if not isinstance(data, dict):
                    raise BadMessage("a message must be a JSON object")
                return self.dialect.parse(data)
            except (BadMessage, ProtocolError) as e:
                self._bad_message(str(e))

    def _bad_message(self, why: str) -> None:
        self._bad += 1
        if self._bad <= MAX_LOGGED:
            log.warning("%s stream: dropped a bad message: %r", self.dialect.name, why)
        elif self._bad == MAX_LOGGED + 1:
            log.warning("%s stream: more bad messages; no longer logged", self.dialect.name)

    async def _await_start(self) -> bool:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            try:
                ev = await within(self._receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("%s stream: no `start` within the time limit", self.dialect.name)
                return False
            if ev is None or ev.kind == "stop":
                return False
            if ev.kind == "start" and ev.start is not None:
                return await self._begin(ev.start)
            if ev.kind not in ("connected", "ignored"):
                self._bad_message(f"`{ev.kind}` before `start`")

    async def _begin(self, start: Start) -> bool:
        gw = self.gw
        # A stream URL without a query (Twilio's) shows its token in the stream's parameters:
        # an API key, or the secret the voice webhook minted for this stream.
        grant: Grant | None = grant_of(self.ws.scope)
        if grant is not None and grant.kind == "deferred":
            grant = gw.auth.check(start.parameters.get("token"))
        if grant is None or (grant.kind == "secret" and grant.purpose != "phone"):
            log.warning(
                "%s call %r refused: no valid `token` stream parameter (the server has API keys)",
                self.dialect.name, start.call_id,
            )  # fmt: skip
            return False
        if (refused := gw.refusal(grant)) is not None:
            log.warning("%s call %r refused: %s", self.dialect.name, start.call_id, refused[0])
            return False
        self.start = start
        if start.codec == "alaw":
            self._decode, self._encode = audio.alaw_decode, audio.alaw_encode
        s = admit(gw, output_rate_hz=RATE_HZ, transport=self.dialect.name, owner=grant.owner)
        s.heard_ms = self._heard_ms
        s.on_flush = self._on_flush
        s.on_pause = self._on_pause
        self.session = s
        await s.start()
        log.info("%s call %r: stream %r", self.dialect.name, start.call_id, start.stream_id)
        await phone.apply_settings(s, self.config, self.name, start.parameters)
        return True

    async def _receive_loop(self) -> None:
        s = self.session
        assert s is not None
        while True:
            ev = await self._receive()
            if ev is None or ev.kind == "stop":
                return
            if ev.kind == "media":
                try:
                    data = base64.b64decode(ev.payload, validate=True)
                except (binascii.Error, ValueError):
                    self._bad_message("media payload is not base64")
                    continue
                s.push_audio(self._decode(data), RATE_HZ)
            elif ev.kind == "mark":
                self.heard.echoed(ev.payload)
                self._marked.set()
                if any(name == ev.payload for name, _, _ in self._unheard):
                    while self._unheard and self._unheard.popleft()[0] != ev.payload:
                        pass  # played: no longer to give back
            elif ev.kind == "dtmf":
                s.dtmf(ev.payload)
            elif ev.kind == "start":
                self._bad_message("a second `start`")

    async def _send(self, msg: dict[str, Any]) -> None:
        await within(self.ws.send_text(json.dumps(msg)), 10.0)

    async def _send_loop(self) -> None:
        """Real time plus `lead_ms`: whole 20 ms frames, a mark after each read."""
        s, start = self.session, self.start
        assert s is not None and start is not None
        lead = self.config.lead_ms / 1000
        credit, last = lead, time.monotonic()
        while True:
            audio_wait = asyncio.ensure_future(s.audio_written.wait())
            wake_wait = asyncio.ensure_future(self._wake.wait())
            try:
                waits = {audio_wait, wake_wait}
                await asyncio.wait(waits, timeout=TICK_S, return_when="FIRST_COMPLETED")
            finally:  # also when the call's end cancels this loop mid-wait
                audio_wait.cancel()
                wake_wait.cancel()
            s.audio_written.clear()
            self._wake.clear()
            if self._clear:
                self._clear = False
                await self._send(self.dialect.clear(start.stream_id))
            now = time.monotonic()
            credit = min(lead + TICK_S, credit + now - last)
            last = now
            n = int(credit * RATE_HZ) // FRAME_SAMPLES * FRAME_SAMPLES
            if n <= 0:
                continue
            r = s.read_output(n, pad=False)
            credit -= len(r.pcm) / RATE_HZ
            flushes = self._flushes
            for k, (item_id, off, cnt) in enumerate(r.items):
                pcm = r.pcm[off : off + cnt]
                b64 = base64.b64encode(self._encode(pcm)).decode()
                if self._flushes != flushes:  # dropped while this read was on its way out
                    if s.playout.paused:  # a pause: the rest of the read is played later
                        for rest_id, rest_off, rest_cnt in reversed(r.items[k:]):
                            s.playout.unread(rest_id, r.pcm[rest_off : rest_off + rest_cnt])
                    break
                await self._send(self.dialect.media(start.stream_id, b64))
                end = self._sent[item_id] = self._sent.get(item_id, 0) + cnt
                if self._flushes != flushes:  # the clear goes next; a mark now would count
                    if s.playout.paused:  # this audio as heard; a pause gives it back
                        s.playout.unread(item_id, pcm)
                        self._sent[item_id] -= cnt
                    break
                name = self.heard.sent(item_id, end)
                self._unheard.append((name, item_id, pcm))
                await self._send(self.dialect.mark(start.stream_id, name))

    def stats(self) -> dict[str, Any]:
        s = self.session
        items = phone.items_summary(s) if s is not None else []
        return {
            "provider": self.dialect.name,
            "call_id": self.start.call_id if self.start else None,
            "stream_id": self.start.stream_id if self.start else None,
            "session_id": s.id if s else None,
            "sent_ms": {k: v * 1000 // RATE_HZ for k, v in self._sent.items()},
            "heard_ms": {k: v * 1000 // RATE_HZ for k, v in self.heard.heard.items()},
            "items": items,
        }


def pending_refusal(waiting: list[Waiting], new: Waiting, config: PhoneConfig) -> str | None:
    """Why a stream may not wait for its `start` beside `waiting`, None: it may. Each is
    (credentialed, address); streams with a credential and streams without count apart, so
    the ones nobody vouched for (anyone can open a socket) never crowd out the others."""
    credentialed, address = new
    same = [a for c, a in waiting if c == credentialed]
    if len(same) >= config.max_pending_streams:
        kind = "with" if credentialed else "without"
        return f"{len(same)} streams {kind} a credential are waiting for `start` already"
    if not credentialed and same.count(address) >= config.max_pending_streams_per_address:
        return f"{address or 'its address'} holds {same.count(address)} streams waiting already"
    return None


class PhoneCalls:
    """The live media-stream calls of one gateway."""

    def __init__(self, gw: Host) -> None:
        self.gw = gw
        self.live: set[PhoneCall] = set()
        # signed requests taken (Twilio webhooks, Plivo nonces): a replay is refused
        self.replays = signatures.Replays(gw.config.phone.replay_window_s)

    async def endpoint(self, ws: WebSocket) -> None:
        dialect = DIALECTS.get(ws.path_params.get("provider", ""))
        if dialect is None or not self.gw.config.phone.enabled:
            await ws.close(code=1008, reason="no such phone route")
            return
        why = signatures.upgrade_refusal(dialect.name, ws, self.gw.config.phone, self.replays)
        if why is not None:
            log.warning("%s stream refused: %s", dialect.name, why)
            await ws.close(code=1008, reason="the provider's signature does not match")
            return
        config = self.gw.config.phone
        grant = grant_of(ws.scope)
        credentialed = grant.kind in ("key", "secret") or signatures.signs_upgrades(
            dialect.name, config
        )
        place: Waiting = (credentialed, ws.client.host if ws.client else "")
        waiting = [c.waiting for c in self.live if c.session is None]
        if (why := pending_refusal(waiting, place, config)) is not None:
            log.warning("%s stream refused: %s", dialect.name, why)
            await ws.close(code=1013, reason="too many streams waiting to start")
            return
        call = PhoneCall(ws, self.gw, dialect, place)
        self.live.add(call)
        try:
            await call.run()
        finally:
            self.live.discard(call)

    def stats(self) -> list[dict[str, Any]]:
        return [c.stats() for c in self.live]


def stream_url(request: Request, config: PhoneConfig, provider: str) -> str:
    """Where the provider should connect: the configured public URL, else this request's host."""
    if config.public_url:
        return f"{config.public_url.rstrip('/')}/v1/phone/{provider}"
    secure, host = signatures.public_base(request, config)
    return f"{'wss' if secure else 'ws'}://{host}/v1/phone/{provider}"


async def twilio_voice(request: Request) -> Response:
    """Twilio's voice webhook: TwiML that connects the call to a bidirectional stream, passing
    the caller's number and the call's id as stream parameters."""
    config: PhoneConfig = request.app.state.gateway.config.phone
    if not config.enabled:
        return Response("phone routes are disabled", status_code=404)
    try:
        body = await read_bytes(request, MAX_WEBHOOK_BYTES)
    except SignallingError as e:
        return e.response()
    form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    token = config.twilio_auth_token()
    if token is not None:
        url = signatures.public_url(request, config)
        signed = request.headers.get("x-twilio-signature")
        if not signatures.twilio_signature_ok(token, url, form, signed):
            log.warning(
                "twilio webhook refused: X-Twilio-Signature does not match %s",
                signatures.for_log(url),
            )
            return SignallingError(403, "X-Twilio-Signature does not match", "forbidden").response()
        if not request.app.state.phones.replays.fresh(f"twilio {signed}"):
            log.warning("twilio webhook refused: a replay of a request taken before")
            return SignallingError(403, "a replay of a signed request", "forbidden").response()
    fields = (("from", "From"), ("to", "To"), ("call_sid", "CallSid"))
    params = {k: form.get(f, [""])[0] for k, f in fields}
    gw = request.app.state.gateway
    if gw.auth.required:  # the stream authenticates with a secret of its own, not the key
        params["token"], _ = gw.auth.mint({}, 120, purpose="phone")
    lines = "".join(
        f"<Parameter name={quoteattr(k)} value={quoteattr(v)}/>" for k, v in params.items() if v
    )
    url = quoteattr(stream_url(request, config, "twilio"))
    twiml = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Response><Connect><Stream url={url}>{lines}</Stream></Connect></Response>"
    )
    return Response(twiml, media_type="application/xml")


def routes(calls: PhoneCalls) -> list[Any]:
    return [
        Route("/v1/phone/twilio/voice", twilio_voice, methods=["POST"]),
        WebSocketRoute("/v1/phone/{provider}", calls.endpoint),
    ]
