"""SIP calls: the server as a SIP user agent on UDP, through PJSIP's own Python bindings
(`pjsua2-python`), answering INVITEs with G.711 over RTP into a `Session` like any other call.

    server = SipServer(gateway, sip_config)
    await server.start()          # binds, registers with a trunk when configured
    server.address                # ("127.0.0.1", 5060): where SIP listens
    await server.close()          # hangs up every call, then stops PJSIP

PJSIP runs in a thread of its own: every pjsua2 call is made from it (commands reach it through
`_post`), and its callbacks hand work to the event loop with `call_soon_threadsafe`. The media
clock (a thread of PJSIP's) pulls and pushes one 20 ms frame per call through an
`AudioMediaPort`; out of the session, an asyncio task keeps `lead_ms` of frames ready for it in
a deque, and a barge-in empties the deque at once, so what went out on RTP is what was heard.

An INVITE from a peer outside `allowed_peers` gets 403, one past `max_calls` (or the session
limit) 486, one with no G.711 in its offer 488. A re-INVITE (hold, resume, a new address) keeps
the call and its session; BYE from either side ends both; RFC 4733 key presses reach the session
as `input_audio_buffer.dtmf_event_received`; OPTIONS is answered by PJSIP. RTP from an address
other than the one the SDP named is dropped by PJSIP's media transport until it has seen enough
of it to take it as the peer's new (NATed) address, and is logged by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime_omni.aio import wait_set
from realtime_omni.errors import OmniError
from realtime_omni.gateway.config import PhoneConfig, SipConfig
from realtime_omni.gateway.host import admit, release
from realtime_omni.gateway.media.audio import float_to_pcm16, pcm16_to_float
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports import phone
from realtime_omni.gateway.transports.phone import FRAME_SAMPLES, RATE_HZ

if TYPE_CHECKING:
    from realtime_omni.gateway.host import Host

try:
    import pjsua2 as pj
except ImportError:  # an optional part: `serve --sip-port` says how to get it
    pj = None

log = logging.getLogger(__name__)
_pjsip_log = logging.getLogger("realtime_omni.pjsip")
FRAME_BYTES = FRAME_SAMPLES * 2  # pcm16
SILENCE = bytes(FRAME_BYTES)
POLL_MS = 10
_G711 = re.compile(r"a=rtpmap:\d+\s+(PCMU|PCMA)/8000", re.IGNORECASE)


def offers_g711(message: str) -> bool:
    """Whether an INVITE's SDP offers PCMU or PCMA (static payload types 0 and 8, or by name).
    An INVITE without SDP (a late offer) is taken: our answer will carry the offer."""
    body = message.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in message else ""
    if "m=audio" not in body:
        return "m=" not in body
    for line in body.splitlines():
        if line.startswith("m=audio") and {"0", "8"} & set(line.split()[3:]):
            return True
    return bool(_G711.search(body))


def _keep(obj: Any) -> None:
    """Nothing: a command that holds `obj` until the PJSIP thread has run it."""


def peer_ip(src_address: str) -> str:
    """'203.0.113.7:5060' or '[2001:db8::1]:5060' -> the address."""
    host = src_address.rsplit(":", 1)[0] if src_address.count(":") == 1 else src_address
    if src_address.startswith("["):
        host = src_address[1:].split("]", 1)[0]
    return host


class SipServer:
    def __init__(self, gw: Host, config: SipConfig) -> None:
        if pj is None:
            raise OmniError(
                "SIP needs PJSIP's Python bindings. Fix: pip install pjsua2-python (or "
                "pip install 'realtime-omni[sip]')"
            )
        self.gw, self.config = gw, config
        self._account: Any = None  # pjsua2's Account, from start() to close()
        self.phone: PhoneConfig = gw.config.phone
        self.address: tuple[str, int] = (config.bind, config.port)
        self.calls: set[_Call] = set()  # touched on the PJSIP thread only
        self.live: dict[int, _Call] = {}  # answered calls, on the event loop
        self.none_live = asyncio.Event()  # set whenever the last answered call has ended
        self.none_live.set()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self.registration: int | None = None  # the registrar's last status code

    # ---- lifecycle (event loop) --------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._main, name="sip", daemon=True)
        self._thread.start()
        await self._ready
        # pjsua2 objects must die on a thread pjlib knows: the PJSIP thread drops the calls,
        # but a stray last reference (the collector, a closure) may go on this one.
        if not pj.Endpoint.instance().libIsThreadRegistered():
            pj.Endpoint.instance().libRegisterThread("gateway")
        log.info("SIP user agent on udp:%s:%d", *self.address)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._post(self._hang_up_all)
        with contextlib.suppress(TimeoutError):  # BYEs out, sessions closed
            await asyncio.wait_for(self.none_live.wait(), 2.0)
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5.0)
        self._thread = None

    def stats(self) -> list[dict[str, Any]]:
        return [c.stats() for c in list(self.live.values())]

    def status(self) -> dict[str, Any]:
        """Where SIP listens and, with `registration`, the registrar's last answer."""
        return {"address": list(self.address), "registration": self.registration}

    # ---- the PJSIP thread ----------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is going
            self._loop.call_soon_threadsafe(fn, *args)

    def _main(self) -> None:
        try:
            ep = self._init()
        except Exception as e:  # tell start(), which raises it
            err = OmniError(f"SIP: cannot start on udp:{self.config.bind}:{self.config.port}: {e}")
            assert self._loop is not None and self._ready is not None
            self._loop.call_soon_threadsafe(self._ready.set_exception, err)
            return
        assert self._loop is not None and self._ready is not None
        self._loop.call_soon_threadsafe(self._ready.set_result, None)
        try:
            while not self._stop.is_set():
                ep.libHandleEvents(POLL_MS)
                while True:
                    try:
                        fn = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        fn()
                    except Exception:
                        log.exception("SIP command failed")
        finally:
            self.calls.clear()
            self._account = None
            ep.libDestroy()

    def _init(self) -> Any:
        c = self.config
        ep = pj.Endpoint()
        ep.libCreate()
        cfg = pj.EpConfig()
        cfg.uaConfig.threadCnt = 0  # this thread polls
        cfg.uaConfig.mainThreadOnly = True
        cfg.uaConfig.maxCalls = max(c.max_calls + 4, 4)  # room to answer 486 past the limit
        cfg.uaConfig.userAgent = "realtime-omni"
        self._log_writer = _LogWriter()  # PJSIP's own lines into our logging (kept alive here)
        cfg.logConfig.writer = self._log_writer
        cfg.logConfig.level = 4  # pjmedia says at 4 when it takes RTP from a new address
        cfg.logConfig.consoleLevel = 4
        cfg.logConfig.decor = 0
        cfg.medConfig.clockRate = RATE_HZ
        cfg.medConfig.sndClockRate = RATE_HZ
        cfg.medConfig.ptime = 20
        cfg.medConfig.noVad = True  # the session's VAD judges speech, on every frame
        cfg.medConfig.ecTailLen = 0
        ep.libInit(cfg)
        tc = pj.TransportConfig()
        tc.port = c.port
        tc.boundAddress = c.bind
        if c.public_address:
            tc.publicAddress = c.public_address
        tid = ep.transportCreate(pj.PJSIP_TRANSPORT_UDP, tc)
        host, _, port = ep.transportGetInfo(tid).localName.rpartition(":")
        self.address = (c.bind, int(port))
        ep.libStart()
        ep.audDevManager().setNullDev()  # no sound card: the conference bridge's own clock
        wanted = {f"{name}/8000/1": 255 - i for i, name in enumerate(c.codecs)}
        for codec in ep.codecEnum2():
            ep.codecSetPriority(codec.codecId, wanted.get(codec.codecId, 0))
        acc = pj.AccountConfig()
        contact = c.public_address or (host if c.bind in ("0.0.0.0", "::") else c.bind)
        acc.idUri = f"sip:realtime-omni@{contact}:{self.address[1]}"
        mt = acc.mediaConfig.transportConfig
        mt.port, mt.portRange, mt.boundAddress = c.rtp_port, c.rtp_port_range, c.bind
        if c.public_address:
            mt.publicAddress = c.public_address
        if c.registration is not None:
            r = c.registration
            user, password = r.credentials()
            acc.idUri = f"sip:{r.user}@{r.registrar.removeprefix('sip:')}"
            acc.regConfig.registrarUri = r.registrar
            acc.sipConfig.authCreds.append(pj.AuthCredInfo("digest", r.realm, user, 0, password))
        else:
            acc.regConfig.registrarUri = ""
        self._account = account = _Account(self)
        account.create(acc)
        return ep

    def _hang_up_all(self) -> None:
        for call in list(self.calls):
            with contextlib.suppress(Exception):
                call.hangup(pj.CallOpParam())

    def _incoming(self, account: Any, prm: Any) -> None:
        call = _Call(self, account, prm.callId, peer_ip(prm.rdata.srcAddress))
        self.calls.add(call)
        status = 0
        if not self.config.allows(call.peer):
            log.warning("SIP: INVITE from %s refused: not in sip.allowed_peers", call.peer)
            status = 403
        elif len(self.calls) > self.config.max_calls:
            log.warning("SIP: INVITE from %s refused: at sip.max_calls", call.peer)
            status = 486
        elif not offers_g711(prm.rdata.wholeMsg):
            log.warning("SIP: INVITE from %s refused: no PCMU or PCMA offered", call.peer)
            status = 488
        if status:
            call.respond(status)
            return
        call.respond(180)
        self._to_loop(self._start_session, call)

    def _start_session(self, call: _Call) -> None:
        call.task = asyncio.ensure_future(call.run())

    def _ended(self, call: _Call) -> None:
        """DISCONNECTED: the session goes on the loop; the objects go here, after the callback."""
        self._to_loop(call.ended.set)
        self._post(lambda: self.calls.discard(call))


if pj is not None:

    class _LogWriter(pj.LogWriter):
        """PJSIP's errors and warnings, and its switching a call's RTP to a new source address,
        as log lines of `realtime_omni.pjsip`; the rest dropped."""

        def write(self, entry: Any) -> None:
            msg = entry.msg.strip()
            if entry.level <= 2:
                level = logging.ERROR if entry.level <= 1 else logging.WARNING
                _pjsip_log.log(level, "%s", msg)
            elif "switched" in msg and "address" in msg:
                _pjsip_log.warning("RTP from an address the SDP did not name: %s", msg)

    class _Account(pj.Account):
        def __init__(self, server: SipServer) -> None:
            super().__init__()
            self.server = server

        def onIncomingCall(self, prm: Any) -> None:
            self.server._incoming(self, prm)

        def onRegState(self, prm: Any) -> None:
            info = self.getInfo()
            self.server.registration = int(prm.code)
            log.info("SIP registration: %s %s", prm.code, info.regStatusText)

    class _Port(pj.AudioMediaPort):
        """The call's end of the conference bridge: called on PJSIP's media clock thread."""

        def __init__(self, call: _Call) -> None:
            super().__init__()
            self.call = call

        def onFrameRequested(self, frame: Any) -> None:
            frame.type = pj.PJMEDIA_FRAME_TYPE_AUDIO
            frame.buf = pj.ByteVector(self.call.next_frame())
            frame.size = FRAME_BYTES

        def onFrameReceived(self, frame: Any) -> None:
            if frame.size:
                self.call.server._to_loop(self.call.heard_audio, bytes(frame.buf))

    class _Call(pj.Call):
        def __init__(self, server: SipServer, account: Any, call_id: int, peer: str) -> None:
            super().__init__(account, call_id)
            self.server, self.peer, self.call_id = server, peer, call_id
            self.port: _Port | None = None
            self.session: Session | None = None
            self.task: asyncio.Task[None] | None = None
            self.ended = asyncio.Event()  # set on the loop once the call is over
            self.out: deque[tuple[str, bytes]] = deque()  # 20 ms frames for the clock
            self.sent: dict[str, int] = {}  # item -> samples the clock took out (went on RTP)
            self.on_hold = False
            self.dtmf_digits = 0

        def respond(self, status: int) -> None:
            op = pj.CallOpParam()
            op.statusCode = status
            self.answer(op)

        # ---- PJSIP thread ----------------------------------------------------------------

        def onCallState(self, prm: Any) -> None:
            info = self.getInfo()
            if info.state == pj.PJSIP_INV_STATE_DISCONNECTED:
                log.info("SIP call from %s ended (%s)", self.peer, info.lastReason)
                self.server._ended(self)

        def onCallMediaState(self, prm: Any) -> None:
            info = self.getInfo()
            for i, media in enumerate(info.media):
                if media.type != pj.PJMEDIA_TYPE_AUDIO:
                    continue
                self.on_hold = media.status in (
                    pj.PJSUA_CALL_MEDIA_LOCAL_HOLD,
                    pj.PJSUA_CALL_MEDIA_REMOTE_HOLD,
                )
                if media.status != pj.PJSUA_CALL_MEDIA_ACTIVE:
                    continue
                audio = self.getAudioMedia(i)
                if self.port is None:
                    self.port = _Port(self)
                    fmt = pj.MediaFormatAudio()
                    fmt.init(pj.PJMEDIA_FORMAT_PCM, RATE_HZ, 1, 20000, 16)
                    self.port.createPort(f"call{self.call_id}", fmt)
                audio.startTransmit(self.port)  # again after a re-INVITE: its port may change
                self.port.startTransmit(audio)

        def onDtmfDigit(self, prm: Any) -> None:
            self.dtmf_digits += 1
            if self.session is not None:
                self.server._to_loop(self.session.dtmf, prm.digit)

        # ---- media clock thread ----------------------------------------------------------

        def next_frame(self) -> bytes:
            try:
                item_id, frame = self.out.popleft()
            except IndexError:
                return SILENCE
            self.sent[item_id] = self.sent.get(item_id, 0) + FRAME_SAMPLES
            return frame

        # ---- event loop --------------------------------------------------------------------

        def heard_audio(self, data: bytes) -> None:
            if self.session is not None and not self.on_hold:
                self.session.push_audio(np.frombuffer(data, np.int16), RATE_HZ)

        def heard_ms(self, item_id: str) -> int:
            return self.sent.get(item_id, 0) * 1000 // RATE_HZ

        def flush(self) -> None:
            self.out.clear()

        def pause(self) -> None:
            """Frames waiting for the clock go back to the playout queue, unplayed."""
            s = self.session
            taken: list[tuple[str, bytes]] = []
            while self.out:
                with contextlib.suppress(IndexError):  # the clock may take the last one
                    taken.append(self.out.popleft())
            if s is None:
                return
            for item_id, frame in reversed(taken):
                s.playout.unread(item_id, pcm16_to_float(frame))

        async def run(self) -> None:
            server, gw = self.server, self.server.gw
            if (refused := gw.refusal()) is not None:
                busy = refused[1] == "too_many_sessions"
                server._post(lambda: self.respond(486 if busy else 503))  # 503: draining
                return
            s = admit(gw, output_rate_hz=RATE_HZ, transport="sip")
            s.heard_ms, s.on_flush, s.on_pause = self.heard_ms, self.flush, self.pause
            self.session = s
            server.live[self.call_id] = self
            server.none_live.clear()
            tasks: list[asyncio.Task[Any]] = []
            try:
                await s.start()
                await phone.apply_settings(s, server.phone, "sip", {"from": self.peer})
                server._post(lambda: self.respond(200))
                log.info("SIP call from %s answered", self.peer)
                tasks = [
                    asyncio.create_task(self._feed()),
                    asyncio.create_task(phone.watch(s, server.phone, "sip")),
                    asyncio.create_task(self.ended.wait()),
                ]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if tasks[1] in done:  # idle: the goodbye's last frames out, then BYE
                    await asyncio.sleep(server.phone.lead_ms / 1000 + 0.1)
                    server._post(lambda: self.hangup(pj.CallOpParam()))
                for t in done:
                    exc = None if t.cancelled() else t.exception()
                    if exc is not None:
                        log.error("SIP call failed", exc_info=exc)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.out.clear()
                await release(gw, s)
                s.heard_ms = s.on_flush = s.on_pause = None  # the session lets go of the call
                self.session = None
                # The last reference goes with a command to the PJSIP thread, where the call
                # object may be destroyed (pjlib refuses unregistered threads).
                call = server.live.pop(self.call_id, None)
                if not server.live:
                    server.none_live.set()
                server._post(lambda: _keep(call))

        async def _feed(self) -> None:
            """Keep `lead_ms` of 20 ms frames ready for the media clock."""
            s = self.session
            assert s is not None
            lead = max(1, round(self.server.phone.lead_ms / 20))
            while True:
                await wait_set(s.audio_written, 0.02)
                s.audio_written.clear()
                need = lead - len(self.out)
                if need <= 0:
                    continue
                r = s.read_output(need * FRAME_SAMPLES, pad=False)
                for item_id, off, cnt in r.items:
                    pcm = r.pcm[off : off + cnt]
                    for i in range(0, cnt, FRAME_SAMPLES):
                        f = pcm[i : i + FRAME_SAMPLES]
                        if len(f) < FRAME_SAMPLES:
                            f = np.pad(f, (0, FRAME_SAMPLES - len(f)))
                        self.out.append((item_id, float_to_pcm16(f)))

        def stats(self) -> dict[str, Any]:
            s = self.session
            return {
                "provider": "sip",
                "peer": self.peer,
                "session_id": s.id if s else None,
                "on_hold": self.on_hold,
                "dtmf_digits": self.dtmf_digits,
                "sent_ms": {k: v * 1000 // RATE_HZ for k, v in self.sent.items()},
                "items": phone.items_summary(s) if s is not None else [],
            }
