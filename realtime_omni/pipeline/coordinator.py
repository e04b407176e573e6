"""The coordinator: starts the stage processes, submits requests, streams terminal outputs back,
aborts requests everywhere, and restarts a stage process that died.

    coord = Coordinator(config)
    await coord.start()                      # returns when every stage process is ready
    stream = await coord.submit({"x": arr})  # waits for a free request slot and entry credit
    async for out in stream: ...             # Output(stage, data) from the terminal stages
    await stream.settled.wait()              # then stream.compute_s: seconds per stage
    stream.close()                           # stopped reading early: unread outputs' credits back
    await coord.abort(stream.request_id)     # returns once every stage acknowledged
    await coord.close()                      # no process and no shared memory left behind

It is the composition of a request table (`requests.py`: requests, routes, aborts), a supervisor
(`supervisor.py`: the processes, spares, the death watch) and the sockets, with the receive loop
that feeds both. Runs in the server's asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import zmq

from realtime_omni.aio import within
from realtime_omni.errors import ConfigError, OmniError, RequestAborted, RequestError, StageDied
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline import sockets
from realtime_omni.pipeline.config import PipelineConfig
from realtime_omni.pipeline.graph import Graph, group_of
from realtime_omni.pipeline.relay import Inlet, Outlet, Payload, copy_payload
from realtime_omni.pipeline.requests import Output, Request, RequestStream, RequestTable
from realtime_omni.pipeline.shm import (
    OwnerLock,
    clean_stale_segments,
    segment_name,
    unlink_segments,
)
from realtime_omni.pipeline.supervisor import Supervisor
from realtime_omni.pipeline.worker import MAX_DRAIN

__all__ = ["Coordinator", "Output", "RequestStream"]

log = logging.getLogger(__name__)
StatsWaiter = tuple[set[str], dict[str, m.Stats], asyncio.Future[dict[str, m.Stats]]]


class Coordinator:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.graph = Graph(cfg)
        self.owner_pid = os.getpid()
        self.ipc_dir: Path | None = None
        self.down: set[str] = set()  # stage processes known dead, not yet back
        self._credit = asyncio.Event()
        self.requests = RequestTable(self.graph, self._credit.set)
        self.supervisor = Supervisor(cfg, self.graph, self.owner_pid, self)
        self.epochs = self.supervisor.epochs  # every process's incarnation (the same dict)
        self._peer_up_waiting: dict[str, set[str]] = {}
        self._peer_up_done: dict[str, asyncio.Future[None]] = {}
        self._stats_waiters: dict[int, StatsWaiter] = {}
        self._tokens = itertools.count(1)
        self._healthy = asyncio.Event()  # set while no stage process is down
        self._started = False
        self._closing = False
        self._owner_lock: OwnerLock | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        rt = self.cfg.runtime
        if rt.placement == "ray":  # where Ray puts the stages decides hosts, sockets and edges
            await self.supervisor.place()
            self.cfg, self.graph = self.supervisor.cfg, self.supervisor.graph
            self.requests.graph = self.graph
            if self.graph.use_tcp and not os.environ.get(rt.curve_secret_env):
                raise ConfigError(
                    f"the stages span Ray nodes, whose edges need the deployment's CurveZMQ key "
                    f"in {rt.curve_secret_env}. Fix: `realtime-omni keygen`, and set it in the "
                    "environment of `ray start` on every node and of this server"
                )
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
        try:
            await self.supervisor.start(self.ipc_dir)
        except BaseException:
            await self.close()
            raise
        self.supervisor.watch()
        self._healthy.set()
        self._started = True

    async def close(self) -> None:
        """Stop every stage process and remove every segment; safe to call twice."""
        if self._closing:
            return
        self._closing = True
        self.supervisor.stop_watching()
        for req in list(self.requests.requests.values()):
            req.stream._finish(OmniError("the pipeline was shut down"))
        await self.supervisor.close()
        if hasattr(self, "_recv_task"):
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recv_task
        self.supervisor.cancel_tasks()
        if hasattr(self, "outlet"):
            self.outlet.close()
            self.inlet.close()
        unlink_segments(segment_name(self.owner_pid, ""))
        if self._owner_lock is not None:
            self._owner_lock.release()
        if hasattr(self, "zmq"):
            for s in self.peers.values():
                s.close(linger=0)
            self.inbox.close(linger=0)
            self.zmq.term()
        if self.ipc_dir is not None and self._own_ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        await self.supervisor.close_ray()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- requests ----------------------------------------------------------------------

    async def submit(self, payload: Payload, request_id: str | None = None) -> RequestStream:
        """Start a request with `payload` as the entry stage's input; waits while the pipeline
        is at `runtime.max_requests` or a stage has no replica up (all restarting), and for a
        free entry credit. A replica that is down is passed over while another serves.
        Bounded: `runtime.first_output_timeout_s` after the call, a request still waiting here
        raises, and one without an output (or its end) by then fails its stream, either way
        with the cause (`StageDied` where its stage is down, else `RequestError`)."""
        if self._closing:
            raise OmniError("the pipeline is shut down")
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in flight")
        rt = self.cfg.runtime
        limit_s = rt.first_output_timeout_s
        deadline = self.loop.time() + limit_s
        broken = self.supervisor.broken
        while len(self.requests) >= rt.max_requests or not self._routable():
            if not self._routable() and (broken or (self.down and not rt.restart_stages)):
                why = "; ".join(broken.values()) or "restart_stages is off"
                raise StageDied(f"stage processes {sorted(self.down)} are down: {why}")
            if self.loop.time() >= deadline:
                if not self._routable():
                    raise StageDied(
                        f"stage processes {sorted(self.down)} are down and were not back "
                        f"within {limit_s:g} s (runtime.first_output_timeout_s)"
                    )
                raise RequestError(
                    f"the pipeline held its limit of {rt.max_requests} requests for "
                    f"{limit_s:g} s (runtime.max_requests, runtime.first_output_timeout_s)"
                )
            await self._wait_credit()
        route = self.requests.pick_route(payload.get("session_id"), self.down, self.epochs)
        req = self.requests.add(rid, route)
        entry_proc = self.requests.process_of(self.graph.entry, route)
        try:
            while (lease := self.outlet.acquire(rid, entry_proc)) is None:
                if self.loop.time() >= deadline:
                    raise RequestError(
                        f"no credit of the edge to {self.graph.entry} came back within "
                        f"{limit_s:g} s (runtime.first_output_timeout_s): {entry_proc} takes "
                        "no new requests"
                    )
                await self._wait_credit()
        except BaseException:  # cancelled while waiting: no stage has seen the request
            req.stream._finish()
            self.requests.forget(rid)
            raise
        try:
            msg, frames = self.outlet.pack(rid, lease, payload, route)
            self.send(entry_proc, msg, frames)
        except (OmniError, TypeError, ValueError, msgspec.MsgspecError) as e:
            self.outlet.pool.release(lease)  # nothing was sent: the credit is still ours
            self.requests.forget(rid)
            raise e if isinstance(e, OmniError) else RequestError(str(e)) from None
        req.timer = self.loop.call_at(deadline, self._first_output_due, req)
        return req.stream

    def _first_output_due(self, req: Request) -> None:
        """`runtime.first_output_timeout_s` since `submit` began and `req` has neither an
        output nor its end: it fails with the likeliest cause and is aborted."""
        if self.requests.get(req.rid) is not req or req.answered or req.stream.closed:
            return
        limit_s = self.cfg.runtime.first_output_timeout_s
        down = [p for p in self.requests.processes(req.route) if p in self.down]
        error: RequestError | StageDied
        if down:
            error = StageDied(
                f"stage processes {down} are down and were not back within {limit_s:g} s "
                "(runtime.first_output_timeout_s)"
            )
        else:
            stages = [s for s in self.cfg.stages if s not in req.done]
            error = RequestError(
                f"no output within {limit_s:g} s (runtime.first_output_timeout_s) from stages "
                f"{stages}: a stage does not answer, or is too slow for the limit"
            )
        log.warning("request %s failed: %s", req.rid, error, extra={"request_id": req.rid})
        self._fail(req, error)

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
            any(p not in self.down for p in grp.process_names())
            for grp in self.graph.groups.values()
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request in every stage; returns when all acknowledged (every slot it held
        is free again); its stream raises `RequestAborted`. A request that already ended in
        every stage has nothing to stop, but outputs its caller left unread still hold credits
        of the edges to the caller: its stream is closed, which gives them back."""
        req = self.requests.get(request_id)
        if req is None:
            stream = self.requests.streams.get(request_id)
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

    def _start_abort(self, req: Request) -> None:
        for p in self.requests.begin_abort(req, self.down):
            self.send(p, m.Abort(req.rid))
        self.loop.call_later(self.cfg.runtime.abort_timeout_s, self.requests.abort_expired, req)
        self.requests.check_abort(req)

    def _fail(self, req: Request, error: RequestError | StageDied) -> None:
        """The request failed somewhere: tell the caller, abort it everywhere in the background."""
        req.stream._finish(error)
        if req.abort_done is None:
            self._start_abort(req)
            assert req.abort_done is not None
            req.abort_done.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)

    # ---- inbound -----------------------------------------------------------------------

    def send(self, process: str, msg: m.Message, frames: Sequence[Any] = ()) -> None:
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
        fd = sock.fileno()
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
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    await readable.wait()
        finally:
            self.loop.remove_reader(fd)

    def _handle(self, msg: m.Message, frames: list[Any]) -> None:
        match msg:
            case m.DataReady():
                self._on_output(msg, frames)
            case m.StreamEnd(request_id=rid, src=src):
                self.requests.stream_ended(rid, src)
            case m.DataAck(lease=lease):
                self.outlet.pool.release(lease)
                self._credit.set()
            case m.StageDone(request_id=rid, stage=stage, compute_s=spent):
                self.requests.stage_done(rid, stage, spent)
            case m.Spent(request_id=rid, stage=stage, compute_s=spent):
                self.requests.spent(rid, stage, spent)
            case m.StageError(request_id="", stage=stages, message=message):
                self.supervisor.on_startup_error(stages, message)
            case m.StageError(request_id=rid, stage=stage, message=message):
                req = self.requests.get(rid)
                if req is not None:
                    self._fail(req, RequestError(f"stage {stage}: {message}"))
            case m.AbortAck(request_id=rid, stage=stage, compute_s=spent):
                self.requests.abort_acked(rid, stage, spent)
            case m.Ready(process=p, epoch=epoch):
                if self.supervisor.on_ready(p, epoch):  # a remote stage came back
                    self.supervisor.track(self.peer_up(p))
            case m.Heartbeat(process=p):
                self.supervisor.on_heartbeat(p)
                if p in self.down and p not in self.supervisor.procs:
                    # Declared dead while alive (no heartbeat for heartbeat_timeout_s): its
                    # peers dropped it and its requests failed, so its state is not to be
                    # trusted. It exits; started again (by its host), its Ready brings it back.
                    log.warning("%s beats again after it was declared dead: shutting it down", p)
                    self.send(p, m.Shutdown())
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
            if sender not in self.down:
                self.send(sender, ack)

        req = self.requests.get(msg.request_id)
        if req is None or req.stream.closed:
            release()
            return
        req.answered = True
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

    # ---- faults (the supervisor's host) ------------------------------------------------

    def on_death(self, process: str) -> None:
        if self._closing or process in self.down:
            return
        self.down.add(process)
        self._healthy.clear()
        stages = self.graph.groups[group_of(process)].stages
        sockets.drop(self.peers, process)
        for p in self.graph.processes():
            if p not in self.down:
                self.send(p, m.PeerDown(process))
        self.outlet.pool.reclaim(process)
        self.inlet.forget(process, self.owner_pid)
        unlink_segments(segment_name(self.owner_pid, process, ""))
        error = StageDied(
            f"stage process {process} ({', '.join(stages)}) died while the request needed it"
        )
        for req in self.requests.died(process):
            self._fail(req, error)
        self._credit.set()
        if process in self.supervisor.procs and self.cfg.runtime.restart_stages:
            self.supervisor.track(self.supervisor.restart(process))

    def moved(self, process: str) -> None:
        sockets.drop(self.peers, process)

    def wake(self) -> None:
        self._credit.set()

    async def peer_up(self, process: str) -> None:
        """Tell every other live process that `process` is back, and `process` where each of
        them is now (one that came back while it was down is not in its start-up arguments),
        then take requests again. Processes restarting together (a node's) each skip the
        others while they are down, so a round ends only once no live process is left
        untold: of two rounds, the one that ends second tells both sides."""
        told: set[str] = set()
        epochs = self.epochs
        address = self.graph.moved.get(process)  # where it runs now, if Ray moved it
        while others := [
            p
            for p in self.graph.processes()
            if p != process and p not in self.down and p not in told
        ]:
            self._peer_up_waiting[process] = set(others)
            self._peer_up_done[process] = self.loop.create_future()
            for p in others:
                self.send(process, m.PeerUp(p, epochs[p], self.graph.moved.get(p)))
                self.send(p, m.PeerUp(process, epochs[process], address))
            await within(self._peer_up_done[process], self.cfg.runtime.ready_timeout_s)
            told.update(others)
        self.down.discard(process)
        if not self.down:
            self._healthy.set()
        self._credit.set()

    # ---- introspection -----------------------------------------------------------------

    async def stats(self, timeout: float = 5.0) -> dict[str, m.Stats]:
        """Every live process's slots, active requests and segments."""
        token = next(self._tokens)
        live = [p for p in self.graph.processes() if p not in self.down]
        fut: asyncio.Future[dict[str, m.Stats]] = self.loop.create_future()
        self._stats_waiters[token] = (set(live), {}, fut)
        for p in live:
            self.send(p, m.StatsRequest(token))
        try:
            return await within(fut, timeout)
        finally:
            del self._stats_waiters[token]

    @property
    def ready(self) -> bool:
        """New requests are served now: started, not closing, and every process group has a
        replica up. A replica down while another of its group serves leaves it ready but
        `degraded`; a group with none up (its only process restarting) makes it not ready."""
        return self._started and not self._closing and self._routable()

    @property
    def degraded(self) -> dict[str, str]:
        """The stage processes down now, each with why (restarting, not restarted, or its
        restart's error), whether or not another replica of its group serves meanwhile."""
        broken = self.supervisor.broken
        idle = "down, restarting" if self.cfg.runtime.restart_stages else "down, not restarted"
        return {p: broken.get(p, idle) for p in sorted(self.down)}

    @property
    def in_flight(self) -> int:
        """Requests some stage still holds: a request leaves when every stage said it is done
        with it, which can be a moment after its stream ended (the last `StageDone`s trail the
        outputs)."""
        return len(self.requests)

    def pid_of(self, process: str) -> int | None:
        return self.supervisor.pid_of(process)

    def spares_loaded(self) -> dict[str, bool]:
        """Per local process with a warm spare (`runtime.warm_spares`): whether it has loaded."""
        return self.supervisor.spares_loaded()
