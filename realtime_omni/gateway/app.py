"""The gateway as a Starlette app: one factory, one `Gateway` holding the pipeline and sessions.

    app = create_app(pipeline_config, GatewayConfig())   # uvicorn runs it; the lifespan starts
                                                         # the Coordinator and stops it
    await serve(pipeline_config, host, port)             # what `realtime-omni serve` runs

Routes: `GET /` the demo page (`web/index.html`, when present; its other files under `/static/`),
`GET /healthz`, `GET /v1/metrics` (latency p50/p99 in ms: token_to_audio, first_audio,
barge_in_to_silence, abort), and the OpenAI Realtime WebSocket at `/v1/realtime`.
WebRTC (`webrtc.py`): `POST /v1/webrtc/offer`, WHIP at `POST /v1/whip` and
`DELETE /v1/whip/<session_id>`; `GET /v1/stats`: the pipeline's bookkeeping and frame counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from realtime_omni.errors import OmniError
from realtime_omni.gateway.auth import Auth, AuthMiddleware, Grant
from realtime_omni.gateway.config import GatewayConfig
from realtime_omni.gateway.event_log import EventLog
from realtime_omni.gateway.memory import HeapTrimmer
from realtime_omni.gateway.origins import OriginMiddleware, host_name, is_loopback
from realtime_omni.gateway.prometheus import CONTENT_TYPE, Exporter
from realtime_omni.gateway.protocol.settings import Settings, Voices
from realtime_omni.gateway.session.driver import EndOfTurnModel, Session, VadModel
from realtime_omni.gateway.transports import live, live_webrtc, media_stream, realtime_calls
from realtime_omni.gateway.transports.realtime_ws import realtime_endpoint
from realtime_omni.gateway.transports.resume import Resumes
from realtime_omni.gateway.transports.webrtc import WebRtcCalls
from realtime_omni.gateway.transports.webrtc import routes as webrtc_routes
from realtime_omni.pipeline.config import EdgeConfig, PipelineConfig
from realtime_omni.pipeline.messages import CLIENT

log = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parents[2] / "web"


class Gateway:
    """The pipeline and the live sessions of one server."""

    def __init__(
        self,
        pipeline: PipelineConfig,
        config: GatewayConfig | None = None,
        coordinator: Any = None,
    ) -> None:
        self.config = config or GatewayConfig()
        if not any(e.src == CLIENT and e.dst == pipeline.entry for e in pipeline.edges):
            edge = EdgeConfig(
                src=CLIENT, dst=pipeline.entry, slot_bytes=self.config.entry_slot_bytes
            )
            pipeline = pipeline.model_copy(update={"edges": [*pipeline.edges, edge]})
        self.pipeline = pipeline
        self.coord = coordinator
        self.sessions: set[Session] = set()
        self.metrics: dict[str, deque[float]] = {}  # of closed sessions, as Session.metrics
        self.vad_factory: Callable[[], VadModel] | None = None  # set by start()
        self.end_of_turn: EndOfTurnModel | None = None  # set by start(): Smart Turn, if found
        self.exporter = Exporter()  # /metrics
        self.event_log = EventLog.open(self.config.event_log)  # serve --event-log
        self.voices = Voices(self.config.realtime.voices)
        rt = self.config.realtime
        keys = rt.api_keys() | set(self.config.api_keys)
        self.auth = Auth(  # no keys: nothing checked
            keys,
            rt.client_secret_ttl_s,
            max_sessions_per_secret=rt.client_secret_max_sessions,
            admin_keys=rt.admin_api_keys(),
        )
        self.trimmer = HeapTrimmer()
        self.draining = False  # SIGTERM: no new session; live ones go on (`serve`'s drain)
        self.resumes = Resumes(rt.resume_window_s)  # sessions a dropped WebSocket left waiting

    async def start(self) -> None:
        if self.coord is None:
            from realtime_omni.pipeline.coordinator import Coordinator

            self.coord = Coordinator(self.pipeline)
            await self.coord.start()
        if self.config.vad:  # import torch and load the model now, not on a first call
            from realtime_omni.models.silero_vad import SileroVad

            self.vad_factory = (await asyncio.to_thread(SileroVad)).stream
        from realtime_omni.models import smart_turn  # onnxruntime is imported on a load only

        self.end_of_turn = await asyncio.to_thread(
            smart_turn.load, self.config.realtime.smart_turn_dir
        )

    async def close(self) -> None:
        await self.resumes.close()
        for s in list(self.sessions):
            await s.close()
        if self.coord is not None:
            await self.coord.close()
        if self.event_log is not None:
            self.event_log.close()

    def refusal(self, grant: Grant | None = None) -> tuple[str, str] | None:
        """Why a new session for `grant` cannot start now, as (message, code); None: it can.
        A session left waiting for its client's resume gives way (ends now) rather than a
        limit refusing the new one."""
        if self.draining:
            return (
                "the server is shutting down and takes no new sessions; connect again (a load "
                "balancer sends you to another server)",
                "server_draining",
            )
        if grant is not None and grant.kind == "secret":
            cap = self.auth.max_sessions_per_secret
            held = sum(1 for s in self.sessions if s.owner == grant.owner)
            if held >= cap and self.resumes.give_way(self, grant.owner):
                self.auth.uncount(grant.owner)  # the parked one ended: its place is the new one's
            elif held >= cap:
                return (
                    f"this client secret already holds its limit of {cap} live session(s) "
                    "(realtime.client_secret_max_sessions); end that call first, or have your "
                    "backend mint another secret",
                    "client_secret_session_limit",
                )
            if self.auth.started(grant.owner) >= cap:
                return (
                    f"this client secret has started its {cap} session(s) "
                    "(realtime.client_secret_max_sessions): a secret is good for that many "
                    "calls; have your backend mint another",
                    "client_secret_used",
                )
        if len(self.sessions) >= self.config.max_sessions and not self.resumes.give_way(self):
            return (
                f"the server is at its limit of {self.config.max_sessions} sessions; try again "
                "later",
                "too_many_sessions",
            )
        return None

    def forget(self, session: Session) -> None:
        """A session ended: keep its measurements, and give what it freed back to the system."""
        self.sessions.discard(session)
        for k, v in session.metrics.items():
            self.metrics.setdefault(k, deque(maxlen=v.maxlen)).extend(v)
        self.trimmer.soon()

    def summary(self) -> dict[str, Any]:
        """p50/p99/n/sum of each measurement over closed and live sessions."""
        out: dict[str, Any] = {}
        keys = set(self.metrics).union(*(s.metrics for s in self.sessions))
        for k in sorted(keys):
            vals = [
                *self.metrics.get(k, ()),
                *(x for s in self.sessions for x in s.metrics.get(k, ())),
            ]
            if vals:
                p50, p99 = np.percentile(vals, [50, 99])
                out[k] = {
                    "p50": round(float(p50), 2),
                    "p99": round(float(p99), 2),
                    "n": len(vals),
                    "sum": round(float(np.sum(vals)), 2),
                }
        return out

    def new_session(
        self,
        model: str = "qwen3-omni",
        output_rate_hz: int | None = None,
        transport: str = "websocket",
        owner: str = "open",
    ) -> Session:
        """A new session, not yet started nor counted; `owner`: the grant that asks for it."""
        from realtime_omni.pipeline.graph import Graph

        entry = Graph(self.pipeline).edge(CLIENT, self.pipeline.entry)
        session = Session(
            self.coord,
            vad_factory=self.vad_factory,
            end_of_turn=self.end_of_turn,
            settings=Settings(model=model),
            output_rate_hz=output_rate_hz,
            max_lead_ms=self.config.max_lead_ms,
            max_payload_bytes=entry.slot_bytes - 64 * 1024,  # room for alignment padding
            max_session_bytes=self.config.max_session_bytes,
            on_metric=self.exporter.observe,
            transport=transport,
            voices=self.voices,
        )
        session.owner = owner
        return session


async def _index(request: Request) -> Response:
    page = WEB_DIR / "index.html"
    if page.is_file():
        return FileResponse(page)
    return PlainTextResponse("realtime-omni gateway: WebSocket API at /v1/realtime\n")


async def _health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"status": "ok", "sessions": len(gw.sessions)})


async def _metrics(request: Request) -> Response:
    return JSONResponse(request.app.state.gateway.summary())


async def _prometheus(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    body = await gw.exporter.scrape(gw, request.app.state.webrtc)
    return Response(body, media_type=CONTENT_TYPE)


async def _ready(request: Request) -> Response:
    """200 while new calls are served: every stage has a process up (a lost replica whose
    group has another is `degraded`, named in `down`, and still ready); 503 while a stage has
    none (its only process restarting), and from the moment a SIGTERM starts the drain (a load
    balancer then sends no new calls)."""
    gw: Gateway = request.app.state.gateway
    ready = gw.coord is not None and gw.coord.ready and not gw.draining
    down = gw.coord.degraded if gw.coord is not None else {}
    body = {"ready": ready, "draining": gw.draining, "degraded": bool(down), "down": down}
    return JSONResponse(body, status_code=200 if ready else 503)


async def _stats(request: Request) -> Response:
    """Requests in flight, free and total slots per edge and requests held per stage (summed over
    the stage processes), the WebRTC calls' output frame counters, and per process how many
    objects start-up left out of the cyclic collector's passes: for tests and monitoring.
    `?since=T` (a time.monotonic() value, one clock for every process of a machine) adds
    `steps_since`: executor steps per stage that started at T or later (of the last 512)."""
    gw: Gateway = request.app.state.gateway
    free: dict[str, int] = {}
    total: dict[str, int] = {}
    held: dict[str, int] = {}
    steps: dict[str, int] = {}
    frozen: dict[str, int] = {}  # per process: objects kept out of the cyclic collector's passes
    try:
        since = float(request.query_params.get("since", "inf"))
    except ValueError:
        return JSONResponse({"error": {"message": "since must be a number"}}, status_code=400)
    for process, st in (await gw.coord.stats()).items():
        frozen[process] = st.gc_frozen
        for stage, log in st.steps.items():
            steps[stage] = steps.get(stage, 0) + sum(1 for t, _ in log if t >= since)
        for out, got in ((free, st.free_slots), (total, st.total_slots)):
            for k, v in got.items():
                out[k] = out.get(k, 0) + v
        for k, v in st.active_requests.items():
            held[k] = held.get(k, 0) + v
    return JSONResponse(
        {
            "sessions": len(gw.sessions),
            "sessions_waiting_resume": len(gw.resumes.parked),
            "sessions_ending": gw.resumes.ending,
            "in_flight": gw.coord.in_flight,
            "free_slots": free,
            "total_slots": total,
            "active_requests": held,
            "steps_since": steps,
            "webrtc": request.app.state.webrtc.stats(),
            "phone": request.app.state.phones.stats()
            + (request.app.state.sip.stats() if request.app.state.sip else []),
            "gc_frozen": {"gateway": request.app.state.gc_frozen, **frozen},
            "gateway_process": _process_stats(),
            "pids": {p: gw.coord.pid_of(p) for p in gw.coord.graph.local_processes()},
            # stage processes down now (restarting, a lost node's) and why, served or not by
            # a replica of their group meanwhile
            "down": gw.coord.degraded,
            "spares_loaded": gw.coord.spares_loaded(),
            "sip": request.app.state.sip.status() if request.app.state.sip else None,
        }
    )


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:  # it ended meanwhile, or no procfs
        return ""


def _process_stats() -> dict[str, Any]:
    """The gateway process's threads, open file descriptors and UDP sockets (RTP, SIP, ICE):
    what a call must give back when it ends. `pool_threads`: of the threads, the event loop's
    worker pool (`asyncio.to_thread`: base64, images, the VAD), which grows to its bound of
    min(32, CPUs + 4) as work needs and keeps them, and under uvloop libuv's own (its DNS
    lookups: `UV_THREADPOOL_SIZE`, 4 by default, made at the first)."""
    import threading

    import psutil

    proc = psutil.Process()
    udp = sum(1 for c in proc.net_connections(kind="udp"))
    pool = sum(1 for t in threading.enumerate() if t.name.startswith("asyncio_"))
    pool += sum(1 for t in proc.threads() if _thread_name(t.id) == "libuv-worker")
    return {
        "threads": proc.num_threads(),
        "pool_threads": pool,
        "fds": proc.num_fds(),
        "udp_sockets": udp,
    }


def allowed_hosts(config: GatewayConfig) -> list[str]:
    """The names the server answers to besides loopback's: the configured ones, the address it
    listens on (unless every interface) and the phone bridges' public URL's host."""
    hosts = list(config.realtime.allowed_hosts)
    if config.bind_host and config.bind_host not in ("0.0.0.0", "::", ""):
        hosts.append(config.bind_host)
    if config.phone.public_url:
        hosts.append(host_name(urlsplit(config.phone.public_url).netloc))
    return hosts


def _middleware(gw: Gateway) -> list[Middleware]:
    """The Host and Origin checks first (`origins.py`), then CORS for the configured origins (a
    preflight is answered before auth), then the API keys (`auth.py`)."""
    origins = gw.config.realtime.cors_origins
    out = [Middleware(OriginMiddleware, hosts=allowed_hosts(gw.config), origins=origins)]
    if origins:
        out.append(
            Middleware(
                CORSMiddleware,
                allow_origins=origins,
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type", "OpenAI-Beta"],
                expose_headers=["Location"],
            )
        )
    return [*out, Middleware(AuthMiddleware, auth=gw.auth)]


def create_app(
    pipeline: PipelineConfig, config: GatewayConfig | None = None, coordinator: Any = None
) -> Starlette:
    gw = Gateway(pipeline, config, coordinator)
    calls = WebRtcCalls(gw)
    phones = media_stream.PhoneCalls(gw)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        sip = None
        try:
            if gw.config.sip is not None:
                from realtime_omni.gateway.transports.sip import SipServer

                sip = app.state.sip = SipServer(gw, gw.config.sip)
                await sip.start()
            yield
        finally:
            if sip is not None:
                await sip.close()
            await calls.close()
            await gw.close()

    app = Starlette(
        routes=[
            Route("/", _index),
            Route("/healthz", _health),
            Route("/readyz", _ready),
            Route("/metrics", _prometheus),
            Route("/v1/metrics", _metrics),
            Route("/v1/stats", _stats),
            WebSocketRoute("/v1/realtime", realtime_endpoint),
            *webrtc_routes(),
            *realtime_calls.routes(),
            *live.routes(),
            *live_webrtc.routes(),
            *media_stream.routes(phones),
            # The demo page's scripts and styles (web/); check_dir: the app runs without them.
            Mount("/static", StaticFiles(directory=WEB_DIR, check_dir=False), name="static"),
        ],
        lifespan=lifespan,
        middleware=_middleware(gw),
    )
    app.state.gateway = gw
    app.state.webrtc = calls
    app.state.phones = phones
    app.state.live = {}  # Live API sessions by id (transports/live.py), for their sidebands
    app.state.sip = None  # the SipServer, with `serve --sip-port`
    app.state.gc_frozen = 0  # objects `serve` froze once up
    return app


async def serve(
    pipeline: PipelineConfig, host: str, port: int, config: GatewayConfig | None = None
) -> None:
    """Run the app on uvicorn until SIGINT/SIGTERM; prints one line with the URL when ready."""
    from realtime_omni.pipeline.worker import freeze_start_up

    try:  # fail now, not after the stage processes took their time to start
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise OmniError(
            f"cannot listen on {host}:{port}: {e.strerror}. Fix: stop what uses the port, or "
            "pass another --port"
        ) from None
    cfg = secure(config or GatewayConfig(), host)
    if cfg.bind_host in ("0.0.0.0", "::") and not cfg.realtime.allowed_hosts:
        log.warning(
            "listening on every interface, but answering only to loopback's Host names: list "
            "the names clients reach this server by in realtime.allowed_hosts"
        )
    app = create_app(pipeline, cfg)
    server = _DrainingServer(
        app.state.gateway,
        app.state.webrtc,
        cfg.drain_s,
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            ws="websockets-sansio",
            ws_max_size=2 * cfg.max_message_bytes,  # beyond our own limit, so ours answers first
            ws_per_message_deflate=cfg.realtime.websocket_compression,
            lifespan="on",
        ),
    )
    task = asyncio.create_task(server.serve())
    up = asyncio.create_task(server.up.wait())
    await asyncio.wait([task, up], return_when=asyncio.FIRST_COMPLETED)  # a failed start ends it
    up.cancel()
    if server.started:
        server.loop = asyncio.get_running_loop()
        # The VAD model, aiortc and the coordinator: ~200k objects, whose full pass took ~170 ms
        # here, a stall of every call's audio.
        app.state.gc_frozen = freeze_start_up()
        sock = server.servers[0].sockets[0].getsockname()
        if app.state.sip is not None:
            sip_host, sip_port = app.state.sip.address
            print(f"realtime-omni: SIP on udp:{sip_host}:{sip_port}", flush=True)
        # Tests and scripts wait for "serving ... on <url>"; the note follows it.
        note = "" if app.state.gateway.auth.required else " (no authentication: no API keys set)"
        if cfg.api_keys:
            note = f" (no API keys were set; this run's key: {cfg.api_keys[0]})"
        print(
            f"realtime-omni: serving {pipeline.name} on http://{host}:{sock[1]}{note}", flush=True
        )
    await task


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM draining first: `/readyz` answers 503 and new sessions
    are refused at once (`Gateway.refusal`); live sessions go on until they end or `drain_s`
    passes (a WebRTC call whose caller's audio stopped `drain_media_timeout_s` ago ends at once:
    its peer is gone); then the usual shutdown ends what is left (WebSockets closed, WebRTC and
    phone calls hung up, the stages stopped) and the process exits. SIGINT, or a second SIGTERM,
    shuts down at once, as uvicorn does."""

    def __init__(
        self, gw: Gateway, calls: WebRtcCalls, drain_s: float, config: uvicorn.Config
    ) -> None:
        super().__init__(config)
        self.gw, self.calls, self.drain_s = gw, calls, drain_s
        self.loop: asyncio.AbstractEventLoop | None = None  # set once serving
        self.up = asyncio.Event()  # set once listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.up.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.gw.draining or self.loop is None or self.drain_s <= 0:
            super().handle_exit(sig, frame)
            return
        self.gw.draining = True  # /readyz and new sessions see it from now on
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())  # held: the loop keeps weak refs

    async def _drain(self) -> None:
        self.gw.resumes.end_all(self.gw)  # nobody comes back to a server that is leaving
        n = len(self.gw.sessions)
        print(
            f"realtime-omni: draining: {n} live session(s), up to {self.drain_s:g} s; new "
            "sessions refused (SIGINT or SIGTERM again: stop now)",
            flush=True,
        )
        deadline = time.monotonic() + self.drain_s
        quiet_s = self.gw.config.drain_media_timeout_s
        while self.gw.sessions and time.monotonic() < deadline and not self.should_exit:
            if quiet_s > 0:
                self.calls.end_silent(quiet_s)
            await asyncio.sleep(0.1)  # a tick: calls end by themselves, or silent on this clock
        if self.gw.sessions:
            log.warning(
                "drain: %d session(s) live at the deadline; ending them", len(self.gw.sessions)
            )
        self.should_exit = True


def secure(cfg: GatewayConfig, host: str) -> GatewayConfig:
    """The config `serve` runs on `host` with: the address to answer to in Host, and a key of
    its own when none is set and `generate_api_key` asks for one. `OmniError` for a server the
    network could reach with no authentication, unless `allow_no_auth` says something in front
    authenticates."""
    import secrets

    cfg = dataclasses.replace(cfg, bind_host=host)
    if cfg.realtime.api_keys() or cfg.api_keys:
        return cfg
    if cfg.generate_api_key:
        return dataclasses.replace(cfg, api_keys=(f"sk-{secrets.token_urlsafe(24)}",))
    if not is_loopback(host_name(host)) and not cfg.allow_no_auth:
        raise OmniError(
            f"--host {host} would open the server to the network with no authentication. Fix: "
            f"set API keys in {cfg.realtime.api_keys_env} (comma-separated), pass "
            "--generate-api-key for a key of this run's own, or --allow-no-auth if something in "
            "front of it authenticates"
        )
    return cfg
