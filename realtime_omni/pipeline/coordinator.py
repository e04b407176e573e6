"""The coordinator: starts the stage processes, submits requests, streams terminal outputs back,
aborts requests everywhere, and restarts a stage process that died.

    coord = Coordinator(config)
    await coord.start()                      # returns when every stage process is ready
    stream = await coord.submit({"x": arr})  # waits for a free request slot and entry credit
    async for out in stream: ...             # Output(stage, data) from the terminal stages
    stream.close()                           # stopped reading early: unread outputs' credits back
    await coord.abort(stream.request_id)     # returns once every stage acknowledged
    await coord.close()                      # no process and no shared memory left behind

Runs in the server's asyncio loop; a monitor thread watches the local processes' sentinels so a
death (even SIGKILL) is seen within `_MONITOR_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import zmq

from realtime_omni.aio import within
from realtime_omni.errors import (
    OmniError,
    RequestAborted,
    RequestError,
    StageDied,
    StartupError,
)
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline import sockets
from realtime_omni.pipeline.config import PipelineConfig
from realtime_omni.pipeline.forkserver import Forked, ForkServer
from realtime_omni.pipeline.graph import Graph, group_of
from realtime_omni.pipeline.ray_placement import RayPlacement, RayProcess
from realtime_omni.pipeline.relay import Inlet, Outlet, Payload, copy_payload
from realtime_omni.pipeline.shm import (
    OwnerLock,
    clean_stale_segments,
    segment_name,
    unlink_segments,
)
from realtime_omni.pipeline.worker import ARGS_ENV, MAX_DRAIN, WorkerArgs

log = logging.getLogger(__name__)
LocalProcess = subprocess.Popen[bytes] | Forked  # a stage process started here
_MONITOR_S = 0.05  # sentinel poll period of the monitor thread
_SESSION_ROUTES = 4096  # sessions whose replicas are remembered (least recently used go)
_END = object()


class Output(NamedTuple):
    stage: str
    data: Payload


class RequestStream:
    """The terminal outputs of one request, as an async iterator of `Output`.

    Outputs of one terminal stage come in order. The iterator ends when every terminal stage
    closed its stream, and raises the request's error if it failed or was aborted. An output's
    credit goes back to its stage when the consumer takes it, so a consumer that stops reading
    stalls the pipeline for this edge instead of growing memory. A consumer that stops for good
    calls `close` (an output left unread would hold its credit even after the request ended).
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # Bounded by the credits of the terminal edges: each queued output holds one.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False

    def _put(self, item: Any) -> None:
        if not self.closed:
            self._queue.put_nowait(item)

    def _finish(self, error: BaseException | None = None) -> None:
        if not self.closed:
            self._queue.put_nowait(error if error is not None else _END)
            self.closed = True

    def close(self) -> None:
        """The consumer is done: unread outputs give their credits back now, later ones on
        arrival, and iterating ends. Safe to call more than once."""
        self._finish()
        self._drain()

    def _drain(self) -> None:
        """Give back the credits of outputs nobody will read."""
        keep = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, tuple):
                item[2]()
            else:
                keep.append(item)  # the end or the error stays for the reader
        for item in keep:
            self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        stage, data, ack = item
        ack()
        return Output(stage, data)

    async def collect(self) -> dict[str, list[Payload]]:
        out: dict[str, list[Payload]] = {}
        async for o in self:
            out.setdefault(o.stage, []).append(o.data)
        return out


@dataclass
class _Request:
    rid: str
    route: dict[str, int]
    stream: RequestStream
    done: set[str] = field(default_factory=set)  # stages finished with it
    ended: set[str] = field(default_factory=set)  # terminal stages whose stream closed
    abort_waiting: set[str] | None = None  # stages yet to ack an abort in progress
    abort_done: asyncio.Future[None] | None = None


class Coordinator:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.graph = Graph(cfg)
        self.owner_pid = os.getpid()
        self.epochs = {p: 0 for p in self.graph.processes()}
        self.ipc_dir: Path | None = None
        # Stage processes this coordinator started: forked by the fork server (or Popen, with
        # runtime.fork_server off) here, RayProcess with placement ray.
        self._procs: dict[str, LocalProcess | RayProcess] = {}
        self._forks: ForkServer | None = None
        self._ray: RayPlacement | None = None
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._peer_up_waiting: dict[str, set[str]] = {}
        self._peer_up_done: dict[str, asyncio.Future[None]] = {}
        self._requests: dict[str, _Request] = {}
        # The streams their callers still hold, ended requests' too: an abort of one that ended
        # everywhere still gives back what its caller left unread (see `abort`).
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = (
            weakref.WeakValueDictionary()
        )
        self._down: set[str] = set()
        self._last_beat: dict[str, float] = {}
        self._stats_waiters: dict[int, tuple[set[str], dict[str, m.Stats], asyncio.Future]] = {}
        self._tokens = itertools.count(1)
        self._startup_errors: dict[str, str] = {}
        self._credit = asyncio.Event()
        self._healthy = asyncio.Event()
        self._closing = False
        self._broken: dict[str, str] = {}  # process -> why its restart failed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._active: dict[str, int] = {}  # process -> requests routed to it
        # session id -> {group: (replica, its epoch)} of the session's last turn, newest last
        self._session_routes: OrderedDict[str, dict[str, tuple[int, int]]] = OrderedDict()
        # Warm spares (runtime.warm_spares): a loaded process per local stage process, bound to
        # an epoch of its own that no peer knows until it takes over.
        self._spares: dict[str, tuple[int, LocalProcess]] = {}  # process -> (epoch, it)
        self._spare_ready: dict[str, asyncio.Future[None]] = {}
        self._next_epoch = dict(self.epochs)  # the last epoch handed out, per process

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        rt = self.cfg.runtime
        if rt.placement == "ray":  # where Ray puts the stages decides hosts, sockets and edges
            self._ray = await asyncio.to_thread(RayPlacement, self.cfg)
            self.cfg, self.graph = self._ray.config, Graph(self._ray.config)
            if self.graph.use_tcp and not os.environ.get(rt.curve_secret_env):
                os.environ[rt.curve_secret_env] = sockets.keygen()  # this deployment's own key
        self.secret = sockets.curve_secret(self.cfg)  # before anything is made that needs undoing
        if rt.ipc_dir:  # refused (open to others) before the owner lock is taken
            self.ipc_dir = Path(rt.ipc_dir)
            sockets.private_dir(self.ipc_dir)
            self._own_ipc_dir = False
        else:
            self.ipc_dir = Path(tempfile.mkdtemp(prefix="rto-"))
            self._own_ipc_dir = True
        clean_stale_segments()
        self._owner_lock = OwnerLock(self.owner_pid)  # our segments are not stale while we run
        # Plain sockets, driven by the loop in `_receive`: pyzmq's asyncio sockets cost about
        # 40 us per message received and 9 us per message sent, against 4 and 2 us.
        self.zmq = zmq.Context()
        self.inbox = sockets.inbox(
            self.zmq, self.graph.endpoint(m.CLIENT, 0, self.ipc_dir), self.secret
        )
        self.peers: dict[str, zmq.Socket] = {}  # sends never wait: see sockets.SNDHWM
        entry_edge = self.graph.edge(m.CLIENT, self.graph.entry)
        self.outlet = Outlet(
            entry_edge,
            m.CLIENT,
            0,
            self.owner_pid,
            rt.inline_max_bytes,
            self.cfg.stages[self.graph.entry].device,
            rt.bind_host,
            rt.mooncake_protocol,
        )
        self.inlet = Inlet(
            host=rt.bind_host,
            mooncake_protocol=rt.mooncake_protocol,
            mooncake=any(e.transport == "mooncake" for e in self.graph.in_edges[m.CLIENT]),
        )
        self._recv_task = asyncio.create_task(self._receive())
        self._stop_monitor = threading.Event()
        try:
            if rt.fork_server and self._ray is None:
                modules = {"realtime_omni.pipeline.worker"} | {
                    self.cfg.stages[s].executor.partition(":")[0]
                    for p in self.graph.local_processes()
                    for s in self.graph.groups[group_of(p)].stages
                }
                self._forks = ForkServer(sorted(modules))
                await asyncio.to_thread(self._forks.wait_ready)
            started = self.graph.processes() if self._ray else self.graph.local_processes()
            for p in self.graph.processes():
                self._ready[p] = self.loop.create_future()
                if p in started:
                    await self._launch(p)
            await self._wait_ready(list(self._ready), rt.ready_timeout_s)
        except BaseException:
            await self.close()
            raise
        self._monitor = threading.Thread(target=self._watch, name="rto-monitor", daemon=True)
        self._monitor.start()
        self._healthy.set()
        if rt.warm_spares and rt.restart_stages and self._ray is None:
            for p in self.graph.local_processes():
                self._spawn_spare(p)

    def _worker_args(self, process: str, epoch: int | None = None) -> WorkerArgs:
        assert self.ipc_dir is not None
        return WorkerArgs(
            config=self.cfg.model_dump(),
            process=process,
            epoch=self.epochs[process] if epoch is None else epoch,
            # A peer that is down gets its new epoch through PeerUp.
            epochs=dict(self.epochs),
            ipc_dir=str(self.ipc_dir),
            owner_pid=self.owner_pid,
            moved=dict(self.graph.moved),
        )

    def _spawn(self, process: str, epoch: int | None = None) -> LocalProcess:
        args = self._worker_args(process, epoch)
        env = dict(os.environ, **{ARGS_ENV: msgspec.json.encode(args).decode()})
        proc: LocalProcess
        if self._forks is not None:
            proc = self._forks.spawn(env)
        else:
            argv = [sys.executable, "-m", "realtime_omni.pipeline.worker"]
            proc = subprocess.Popen(argv, env=env)
        if epoch is None:
            self._procs[process] = proc
        return proc

    async def _launch(self, process: str) -> None:
        """Start `process`: here, or with placement ray through its group's actor, on the node
        Ray chose (off the loop: a restarted actor may take seconds to come back)."""
        if self._ray is None:
            self._spawn(process)
            return
        key = self.cfg.runtime.curve_secret_env
        env = {key: os.environ[key]} if key in os.environ else {}
        try:
            node, ip = await asyncio.to_thread(self._ray.locate, process)
            if node != self._ray.where[process][0]:  # Ray restarted its actor elsewhere
                if not self.graph.use_tcp:
                    raise StartupError(
                        f"stage process {process} came back on node {node[:12]}, off this "
                        "server's node, where its ipc sockets and shared memory cannot follow"
                    )
                log.warning("stage process %s moved to node %s (%s)", process, node[:12], ip)
                self._ray.where[process] = (node, ip)
            if self.graph.use_tcp and self.graph.address_of(process) != ip:
                self.graph.moved[process] = ip  # peers learn it from PeerUp
                sockets.drop(self.peers, process)  # connected to where it was
            args = self._worker_args(process)
            proc = await asyncio.to_thread(self._ray.start, process, args, ARGS_ENV, env)
        except StartupError:
            raise
        except Exception as e:  # its actor is gone for good, or Ray is
            why = f"stage process {process}: its Ray actor did not start it: {e}"
            raise StartupError(why) from None
        self._procs[process] = proc
        self._track(self._watch_ray(process, proc))

    async def _watch_ray(self, process: str, proc: RayProcess) -> None:
        """A Ray-run process is dead when its actor's `wait` returns (or its actor, or its
        node, died)."""
        with contextlib.suppress(Exception):
            await proc.exited
        if self._procs.get(process) is proc:
            self._on_death(process)

    def _spawn_spare(self, process: str) -> None:
        """Start a spare of `process` on an epoch of its own; its Ready marks it loaded."""
        if self._closing:
            return
        epoch = self._next_epoch[process] = self._next_epoch[process] + 1
        self._spare_ready[process] = self.loop.create_future()
        self._spares[process] = (epoch, self._spawn(process, epoch))

    async def _wait_ready(self, processes: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            missing = [p for p in processes if not self._ready[p].done()]
            if not missing:
                return
            for p in missing:
                proc = self._procs.get(p)
                if proc is not None and proc.poll() is not None:
                    stages = ", ".join(self.graph.groups[group_of(p)].stages)
                    why = self._startup_errors.get(stages, f"exit code {proc.returncode}")
                    raise StartupError(f"stage process {p} ({stages}) failed to start: {why}")
            if time.monotonic() > deadline:
                names = ", ".join(
                    f"{p} ({', '.join(self.graph.groups[group_of(p)].stages)})" for p in missing
                )
                raise StartupError(
                    f"stage processes not ready after {timeout:.0f} s: {names}. Fix: check their "
                    "logs, or raise runtime.ready_timeout_s for slow model loads"
                )
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop every stage process and remove every segment; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        if hasattr(self, "_stop_monitor"):
            self._stop_monitor.set()
        for req in list(self._requests.values()):
            req.stream._finish(OmniError("the pipeline was shut down"))
        for p in self._procs:
            if p not in self._down:
                self._send(p, m.Shutdown())
        for _, spare in self._spares.values():
            spare.terminate()  # loaded and idle: nothing to finish
        deadline = time.monotonic() + 5
        for proc in [*self._procs.values(), *(s for _, s in self._spares.values())]:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        if self._forks is not None:
            self._forks.close()
        if hasattr(self, "_recv_task"):
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recv_task
        for t in list(self._tasks):
            t.cancel()
        if hasattr(self, "outlet"):
            self.outlet.close()
            self.inlet.close()
        unlink_segments(segment_name(self.owner_pid, ""))
        if getattr(self, "_owner_lock", None) is not None:
            self._owner_lock.release()
        if hasattr(self, "zmq"):
            for s in self.peers.values():
                s.close(linger=0)
            self.inbox.close(linger=0)
            self.zmq.term()
        if self.ipc_dir is not None and self._own_ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self._ray is not None:
            await asyncio.to_thread(self._ray.close)

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- requests ----------------------------------------------------------------------

    async def submit(self, payload: Payload, request_id: str | None = None) -> RequestStream:
        """Start a request with `payload` as the entry stage's input; waits while the pipeline
        is at `runtime.max_requests` or a stage has no replica up (all restarting), and for a
        free entry credit. A replica that is down is passed over while another serves."""
        if self._closing:
            raise OmniError("the pipeline is shut down")
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        while len(self._requests) >= self.cfg.runtime.max_requests or not self._routable():
            if not self._routable() and (
                self._broken or (self._down and not self.cfg.runtime.restart_stages)
            ):
                why = "; ".join(self._broken.values()) or "restart_stages is off"
                raise StageDied(f"stage processes {sorted(self._down)} are down: {why}")
            await self._wait_credit()
        route = self._pick_route(payload.get("session_id"))
        req = _Request(rid, route, RequestStream(rid))
        self._requests[rid] = req
        self._streams[rid] = req.stream
        for p in self._route_processes(route):
            self._active[p] = self._active.get(p, 0) + 1
        entry_proc = self._process_of(self.graph.entry, route)
        try:
            while (lease := self.outlet.acquire(rid, entry_proc)) is None:
                await self._wait_credit()
        except BaseException:  # cancelled while waiting: no stage has seen the request
            req.stream._finish()
            self._forget(rid)
            raise
        try:
            msg, frames = self.outlet.pack(rid, lease, payload, route)
            self._send(entry_proc, msg, frames)
        except (OmniError, TypeError, ValueError, msgspec.MsgspecError) as e:
            self.outlet.pool.release(lease)  # nothing was sent: the credit is still ours
            self._forget(rid)
            raise e if isinstance(e, OmniError) else RequestError(str(e)) from None
        return req.stream

    async def _wait_credit(self) -> None:
        self._credit.clear()
        with contextlib.suppress(TimeoutError):
            await within(self._credit.wait(), 0.5)

    def _routable(self) -> bool:
        """Every process group has a replica up, so a new request has a route. A standby replica
        on another node thus serves new calls while Ray takes seconds to declare a dead node
        dead and restart what was on it (benchmarks/node_failover.py)."""
        if self._healthy.is_set():
            return True
        return all(
            any(p not in self._down for p in grp.process_names())
            for grp in self.graph.groups.values()
        )

    def _pick_route(self, session: Any = None) -> dict[str, int]:
        """Per replicated group, the replica a request runs on: the one that served the
        session's last turn while it is alive and the same incarnation (it keeps the session's
        KV cache), else the least busy one that is up."""
        kept = self._session_routes.get(session, {}) if isinstance(session, str) else {}
        route = {}
        for g, grp in self.graph.groups.items():
            if grp.replicas > 1:
                if g in kept:
                    i, epoch = kept[g]
                    name = f"{g}#{i}"
                    if name not in self._down and self.epochs.get(name) == epoch:
                        route[g] = i
                        continue
                names = [n for n in grp.process_names() if n not in self._down]
                best = min(names or grp.process_names(), key=lambda n: self._active.get(n, 0))
                route[g] = int(best.rsplit("#", 1)[1])
        if isinstance(session, str) and route:
            self._session_routes[session] = {
                g: (i, self.epochs[f"{g}#{i}"]) for g, i in route.items()
            }
            self._session_routes.move_to_end(session)
            while len(self._session_routes) > _SESSION_ROUTES:
                self._session_routes.popitem(last=False)
        return route

    def _route_processes(self, route: dict[str, int]) -> list[str]:
        return [f"{g}#{route.get(g, 0)}" for g in self.graph.groups]

    def _process_of(self, stage: str, route: dict[str, int]) -> str:
        g = self.graph.process_of[stage]
        return f"{g}#{route.get(g, 0)}"

    async def abort(self, request_id: str) -> None:
        """Abort a request in every stage; returns when all acknowledged (every slot it held
        is free again); its stream raises `RequestAborted`. A request that already ended in
        every stage has nothing to stop, but outputs its caller left unread still hold credits
        of the edges to the caller: its stream is closed, which gives them back."""
        req = self._requests.get(request_id)
        if req is None:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.close()
            return
        if req.abort_done is None:
            req.stream._finish(RequestAborted(f"request {request_id} was aborted"))
            self._start_abort(req)
        assert req.abort_done is not None
        timeout = self.cfg.runtime.abort_timeout_s
        try:
            await within(asyncio.shield(req.abort_done), timeout)
        except TimeoutError:
            missing = sorted(req.abort_waiting or ())
            raise OmniError(
                f"abort of {request_id} not acknowledged within {timeout} s by: {missing}"
            ) from None

    def _start_abort(self, req: _Request) -> None:
        req.stream._drain()  # unread outputs hold credits the stages wait for before acking
        req.abort_done = self.loop.create_future()
        req.abort_waiting = set()
        for p in self._route_processes(req.route):
            if p in self._down:
                continue
            req.abort_waiting.update(self.graph.groups[group_of(p)].stages)
            self._send(p, m.Abort(req.rid))
        self.loop.call_later(self.cfg.runtime.abort_timeout_s, self._abort_expired, req)
        self._check_abort(req)

    def _abort_expired(self, req: _Request) -> None:
        if self._requests.get(req.rid) is req and req.abort_waiting:
            log.error(
                "abort of %s not acknowledged by %s; forgetting it",
                req.rid,
                sorted(req.abort_waiting),
                extra={"request_id": req.rid},
            )
            self._forget(req.rid)

    def _check_abort(self, req: _Request) -> None:
        if req.abort_waiting is not None and not req.abort_waiting:
            if req.abort_done is not None and not req.abort_done.done():
                req.abort_done.set_result(None)
            req.stream._drain()
            self._forget(req.rid)

    def _fail(self, req: _Request, error: RequestError) -> None:
        """The request failed somewhere: tell the caller, abort it everywhere in the background."""
        req.stream._finish(error)
        if req.abort_done is None:
            self._start_abort(req)
            assert req.abort_done is not None
            req.abort_done.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)

    def _forget(self, rid: str) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            return
        for p in self._route_processes(req.route):
            self._active[p] = self._active.get(p, 1) - 1
        self._credit.set()

    def _maybe_complete(self, req: _Request) -> None:
        if req.abort_done is None and req.ended >= set(self.graph.terminals):
            req.stream._finish()
            if req.done >= set(self.cfg.stages):
                self._forget(req.rid)

    # ---- inbound -----------------------------------------------------------------------

    def _send(self, process: str, msg: m.Message, frames: Sequence[Any] = ()) -> None:
        assert self.ipc_dir is not None
        sock = self.peers.get(process)
        if sock is None:
            endpoint = self.graph.endpoint(process, self.epochs[process], self.ipc_dir)
            sock = self.peers[process] = sockets.peer(self.zmq, endpoint, self.secret)
        m.send(sock, msg, frames)

    async def _receive(self) -> None:
        """Handle what arrives, draining the inbox at each wake-up. ZMQ's descriptor is edge
        triggered: it signals a change of the socket's events, so after the inbox ran dry,
        `zmq.EVENTS` is read (which re-arms it) before waiting on it."""
        sock, copy = self.inbox, not self.graph.use_tcp
        readable = asyncio.Event()
        fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(fd, readable.set)
        try:
            while True:
                for _ in range(MAX_DRAIN):
                    try:
                        if (got := m.receive(sock, copy)) is None:
                            break
                        self._handle(*got)
                    except m.Malformed as e:
                        log.warning("coordinator: dropped a message: %s", e)
                    except Exception as e:  # a bug must not kill the receive loop silently
                        log.exception("coordinator: cannot handle a message: %s", e)
                else:
                    await asyncio.sleep(0)  # a long burst: let the loop's other work run
                    continue
                readable.clear()
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await readable.wait()
        finally:
            self.loop.remove_reader(fd)

    def _handle(self, msg: m.Message, frames: list[Any]) -> None:
        match msg:
            case m.DataReady():
                self._on_output(msg, frames)
            case m.StreamEnd(request_id=rid, src=src):
                req = self._requests.get(rid)
                if req is not None:
                    req.ended.add(src)
                    self._maybe_complete(req)
            case m.DataAck(lease=lease):
                self.outlet.pool.release(lease)
                self._credit.set()
            case m.StageDone(request_id=rid, stage=stage):
                req = self._requests.get(rid)
                if req is not None:
                    req.done.add(stage)
                    self._maybe_complete(req)
            case m.StageError(request_id="", stage=stages, message=message):
                self._startup_errors[stages] = message
            case m.StageError(request_id=rid, stage=stage, message=message):
                req = self._requests.get(rid)
                if req is not None:
                    self._fail(req, RequestError(f"stage {stage}: {message}"))
            case m.AbortAck(request_id=rid, stage=stage):
                req = self._requests.get(rid)
                if req is not None and req.abort_waiting is not None:
                    req.abort_waiting.discard(stage)
                    self._check_abort(req)
            case m.Ready(process=p, epoch=epoch):
                spare = self._spares.get(p)
                if spare is not None and spare[0] == epoch:
                    if not self._spare_ready[p].done():
                        self._spare_ready[p].set_result(None)
                    return
                fut = self._ready.get(p)
                if epoch == self.epochs.get(p) and fut is not None and not fut.done():
                    fut.set_result(None)
                self._last_beat[p] = time.monotonic()
                if p in self._down and p not in self._procs:  # a remote stage came back
                    self._track(self._peer_up(p))
            case m.Heartbeat(process=p):
                self._last_beat[p] = time.monotonic()
                if p in self._down and p not in self._procs:
                    # Declared dead while alive (no heartbeat for heartbeat_timeout_s): its
                    # peers dropped it and its requests failed, so its state is not to be
                    # trusted. It exits; started again (by its host), its Ready brings it back.
                    log.warning("%s beats again after it was declared dead: shutting it down", p)
                    self._send(p, m.Shutdown())
            case m.PeerUpAck(process=who, peer=peer):
                waiting = self._peer_up_waiting.get(peer)
                if waiting is not None:
                    waiting.discard(who)
                    if not waiting and not self._peer_up_done[peer].done():
                        self._peer_up_done[peer].set_result(None)
            case m.Stats(token=token, process=p):
                entry = self._stats_waiters.get(token)
                if entry is not None:
                    waiting, got, fut = entry
                    got[p] = msg
                    waiting.discard(p)
                    if not waiting and not fut.done():
                        fut.set_result(got)
            case _:
                pass

    def _on_output(self, msg: m.DataReady, frames: list[Any]) -> None:
        sender, ack = msg.src_process, m.DataAck(msg.src, msg.dst, msg.lease)

        def release() -> None:
            if sender not in self._down:
                self._send(sender, ack)

        req = self._requests.get(msg.request_id)
        if req is None or req.stream.closed:
            release()
            return
        try:
            payload = self.inlet.open(msg, frames)
        except (OSError, ValueError, RequestError) as e:  # its writer died; a failed read
            release()
            self._fail(req, RequestError(f"cannot read output of {msg.src}: {e}"))
            return
        if msg.transport != "mooncake":  # a Mooncake read gives arrays it owns already
            payload = copy_payload(payload)
        # The caller owns its arrays; the credit goes back only when the caller takes it.
        req.stream._put((msg.src, payload, release))

    # ---- faults ------------------------------------------------------------------------

    def _watch(self) -> None:
        """Monitor thread: report a dead local process, or a silent remote one, to the loop."""
        fds: dict[int, tuple[int, str]] = {}  # pid -> (pidfd, process), for live local processes
        try:
            while not self._stop_monitor.is_set():
                for p, pr in list(self._procs.items()):
                    if isinstance(pr, RayProcess):
                        continue  # run by Ray, perhaps on another node: `_watch_ray`
                    if pr.pid not in fds:
                        with contextlib.suppress(ProcessLookupError):
                            fds[pr.pid] = (os.pidfd_open(pr.pid), p)
                watched = [fd for fd, _ in fds.values() if fd >= 0]
                ready, _, _ = select.select(watched, [], [], _MONITOR_S)
                dead = []
                for pid, (fd, p) in list(fds.items()):
                    if fd >= 0 and fd in ready:
                        dead.append(p)
                        fds[pid] = (-1, p)  # reported; kept so it is not reopened
                        os.close(fd)
                self._check_remote(dead)
                for p in dead:
                    if self._stop_monitor.is_set():
                        return
                    self.loop.call_soon_threadsafe(self._on_death, p)
        finally:
            for fd, _ in fds.values():
                if fd >= 0:
                    os.close(fd)

    def _check_remote(self, dead: list[str]) -> None:
        now = time.monotonic()
        limit = self.cfg.runtime.heartbeat_timeout_s
        for p in self.graph.processes():
            # A local process's death shows on its pidfd; one on another host or Ray node
            # (a Ray actor's `wait` fails only once Ray gives the node up) by its silence.
            proc = self._procs.get(p)
            local = proc is not None and not isinstance(proc, RayProcess)
            if not local and now - self._last_beat.get(p, now) > limit:
                dead.append(p)  # _on_death ignores a process already down

    def _on_death(self, process: str) -> None:
        if self._closing or process in self._down:
            return
        self._down.add(process)
        self._healthy.clear()
        stages = self.graph.groups[group_of(process)].stages
        sockets.drop(self.peers, process)
        for p in self.graph.processes():
            if p not in self._down:
                self._send(p, m.PeerDown(process))
        self.outlet.pool.reclaim(process)
        self.inlet.forget(process, self.owner_pid)
        unlink_segments(segment_name(self.owner_pid, process, ""))
        error = StageDied(
            f"stage process {process} ({', '.join(stages)}) died while the request needed it"
        )
        for req in list(self._requests.values()):
            if process not in self._route_processes(req.route):
                continue  # on another replica: its stages there still owe their acks
            if req.abort_waiting is not None:
                req.abort_waiting.difference_update(stages)
                self._check_abort(req)
            elif not set(stages) <= req.done:
                self._fail(req, error)
        self._credit.set()
        if process in self._procs and self.cfg.runtime.restart_stages:
            self._track(self._restart(process))

    async def _restart(self, process: str) -> None:
        proc = self._procs[process]  # reap it: it is dead, so this returns at once
        if isinstance(proc, RayProcess):  # Ray calls: off the loop
            if await asyncio.to_thread(proc.poll) is None:  # silent, not (yet) seen dead
                await asyncio.to_thread(proc.kill)  # a frozen node's may wake: no second one
            await asyncio.to_thread(proc.wait)  # until Ray reports it ended, or its node dead
        else:
            proc.wait()
        epoch, spare = self._spares.pop(process, (0, None))
        if spare is not None and spare.poll() is None and self._spare_ready[process].done():
            # The spare takes over: the peer-up round tells it where every peer is now.
            self.epochs[process], self._procs[process] = epoch, spare
            self._ready[process] = self._spare_ready.pop(process)
            await self._peer_up(process)
            self._spawn_spare(process)
            return
        if spare is not None:  # not loaded yet (or dead): a plain restart, and a new spare
            spare.kill()
            spare.wait()
        self.epochs[process] = self._next_epoch[process] = self._next_epoch[process] + 1
        self._ready[process] = self.loop.create_future()
        try:
            await self._launch(process)
            await self._wait_ready([process], self.cfg.runtime.ready_timeout_s)
        except StartupError as e:
            self._broken[process] = str(e)
            self._credit.set()
            return
        await self._peer_up(process)
        if self.cfg.runtime.warm_spares:
            self._spawn_spare(process)

    async def _peer_up(self, process: str) -> None:
        """Tell every other live process that `process` is back, and `process` where each of
        them is now (one that came back while it was down is not in its start-up arguments),
        then take requests again. Processes restarting together (a node's) each skip the
        others while they are down, so a round ends only once no live process is left
        untold: of two rounds, the one that ends second tells both sides."""
        told: set[str] = set()
        address = self.graph.moved.get(process)  # where it runs now, if Ray moved it
        while others := [
            p
            for p in self.graph.processes()
            if p != process and p not in self._down and p not in told
        ]:
            self._peer_up_waiting[process] = set(others)
            self._peer_up_done[process] = self.loop.create_future()
            for p in others:
                self._send(process, m.PeerUp(p, self.epochs[p], self.graph.moved.get(p)))
                self._send(p, m.PeerUp(process, self.epochs[process], address))
            await within(self._peer_up_done[process], self.cfg.runtime.ready_timeout_s)
            told.update(others)
        self._down.discard(process)
        if not self._down:
            self._healthy.set()
        self._credit.set()

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- introspection -----------------------------------------------------------------

    async def stats(self, timeout: float = 5.0) -> dict[str, m.Stats]:
        """Every live process's slots, active requests and segments."""
        token = next(self._tokens)
        live = [p for p in self.graph.processes() if p not in self._down]
        fut: asyncio.Future[dict[str, m.Stats]] = self.loop.create_future()
        self._stats_waiters[token] = (set(live), {}, fut)
        for p in live:
            self._send(p, m.StatsRequest(token))
        try:
            return await within(fut, timeout)
        finally:
            del self._stats_waiters[token]

    @property
    def ready(self) -> bool:
        """Every stage process is up and takes requests (none down or restarting)."""
        return self._healthy.is_set() and not self._closing

    @property
    def in_flight(self) -> int:
        """Requests some stage still holds: a request leaves when every stage said it is done
        with it, which can be a moment after its stream ended (the last `StageDone`s trail the
        outputs)."""
        return len(self._requests)

    def pid_of(self, process: str) -> int | None:
        proc = self._procs.get(process)
        return proc.pid if proc is not None else None

    def spares_loaded(self) -> dict[str, bool]:
        """Per local process with a warm spare (`runtime.warm_spares`): whether it has loaded."""
        return {p: fut.done() for p, fut in self._spare_ready.items()}
