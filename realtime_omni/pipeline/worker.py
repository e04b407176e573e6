"""A stage process: one loop for all the stages that share the process.

The loop (DESIGN.md, "Stage loop"): drain the inbox without blocking, handle aborts and peer
changes first, deliver the rest, run one step of each stage that has work and room to send, route
what the steps emitted, and block on the inbox only when idle. No socket is touched inside a
model call. Stages of one process hand payloads to each other by reference.

Started by the coordinator (`python -m realtime_omni.pipeline.worker`, arguments in the
environment) or on another host by `realtime-omni stage` with the same config.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import msgspec
import zmq

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline import sockets
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.executor import (
    Emit,
    ReportsKv,
    Shares,
    StageContext,
    Wakes,
    load_executor,
)
from realtime_omni.pipeline.graph import Edge, Graph, group_of
from realtime_omni.pipeline.meter import ComputeMeter
from realtime_omni.pipeline.relay import Inlet, Outlet, Payload
from realtime_omni.pipeline.router import Route, Router
from realtime_omni.pipeline.shm import list_segments, segment_name, unlink_segments
from realtime_omni.pipeline.stage import Stage

log = logging.getLogger(__name__)

MAX_DRAIN = 1000  # messages read per loop turn before stepping the stages again
STEP_LOG = 512  # executor steps remembered per stage (start, duration, CPU) for Stats
CONTROL_WAIT_S = 0.05  # the control thread's longest wait on the inbox between checks
ARGS_ENV = "RTO_WORKER_ARGS"  # how the coordinator passes WorkerArgs to a process it starts


class WorkerArgs(msgspec.Struct):
    config: dict[str, Any]
    process: str  # group#replica
    epoch: int
    epochs: dict[str, int]  # every process's current incarnation
    ipc_dir: str
    owner_pid: int  # the coordinator's pid: names shm segments
    watch_parent: bool = True  # exit when the coordinator (our parent) is gone
    # A fork server's child: the coordinator is `owner_pid`, not the parent, whose death (the
    # fork server's: the OOM killer) must not take the stage with it.
    parent_is_fork_server: bool = False
    moved: dict[str, str] = {}  # processes not where the config put them -> their address


def freeze_start_up() -> int:
    """Keep what exists now (modules, models) out of the cyclic collector's full passes, and
    turn the collector on: call once a process is up. With torch and transformers loaded a full
    pass walks ~365k objects, 0.3-0.6 s on the 2-core machine, a stall of everything the process
    does (audio, aborts); frozen, a pass takes ~2 ms (benchmarks/gc_pause.py). Start-up's garbage
    is collected first, or it would be kept forever. Gives how many objects were frozen (counted
    here once: counting walks them)."""
    gc.collect()
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()


def worker_main(args: WorkerArgs) -> None:
    """Process entry point. A failure before the loop starts is reported to the coordinator as
    a `StageError` with an empty request id, so start-up errors name their cause."""
    # No cyclic collection while the executors import and load their models: with torch and
    # transformers the heap grows to ~365k live objects, and the passes on the way there took
    # about a second of CPU per process. `run` turns it on again (`freeze_start_up`).
    gc.disable()
    from realtime_omni.logs import setup as setup_logging

    setup_logging(args.process)
    nice = int(args.config.get("runtime", {}).get("stage_nice", 0))
    if nice:
        os.nice(nice)
    try:
        worker = Worker(args)
    except BaseException as e:
        cfg = parse_config(args.config)
        graph = Graph(cfg)
        ctx = zmq.Context()
        try:
            secret = sockets.curve_secret(cfg)
        except ConfigError:
            secret = None  # nothing to report with: the coordinator names the missing key
        sock = sockets.peer(ctx, graph.endpoint(m.CLIENT, 0, Path(args.ipc_dir)), secret)
        stages = ",".join(graph.groups[group_of(args.process)].stages)
        sock.send(m.encode(m.StageError("", stages, f"{type(e).__name__}: {e}")))
        sock.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from None
    worker.run()


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        self.me = args.process
        self.cfg = parse_config(args.config)
        self.graph = Graph(self.cfg)
        self.graph.moved.update(args.moved)  # this process among them, where it moved
        self.group = self.graph.groups[group_of(self.me)]
        self.ipc_dir = Path(args.ipc_dir)
        self.epochs = dict(args.epochs)
        threads = str(self.group.threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = threads

        self.zmq = zmq.Context()
        self.secret = sockets.curve_secret(self.cfg)
        self.inbox = sockets.inbox(
            self.zmq, self.graph.endpoint(self.me, args.epoch, self.ipc_dir), self.secret
        )
        self.peers: dict[str, zmq.Socket] = {}
        # Copying small frames out is faster than pyzmq's zero-copy frames; only TCP edges
        # carry large inline payloads, where zero-copy pays.
        self.copy_recv = not self.graph.use_tcp
        rt = self.cfg.runtime
        here = self.graph.address_of(self.me)  # where a Mooncake engine of ours listens
        into = [e for n in self.group.stages for e in self.graph.in_edges[n]]
        self.inlet = Inlet(
            host=here,
            mooncake_protocol=rt.mooncake_protocol,
            mooncake=any(e.transport == "mooncake" for e in into),
        )

        self.stages: dict[str, Stage] = {}
        self.outlets: dict[tuple[str, str], Outlet] = {}
        self.step_log: dict[str, deque[tuple[float, float]]] = {}  # recent steps, for Stats
        self.batch_log: dict[str, deque[int]] = {}  # requests each of those steps emitted for
        self.cpu_log: dict[str, deque[float]] = {}  # CPU seconds each of those steps took
        for name in self.group.stages:
            st = self.cfg.stages[name]
            ctx = StageContext(
                stage=name,
                device=st.device,
                params=dict(st.params),
                model=dict(self.cfg.model),
                downstream=[e.dst for e in self.graph.out_edges[name]],
                upstream=[e.src for e in self.graph.in_edges[name]],
                max_batch=st.max_batch,
                max_prefill_tokens_per_step=st.max_prefill_tokens_per_step,
                pipeline=self.cfg,
                # none for a stage `realtime-omni stage` started on another host without one
                run_dir=args.ipc_dir or None,
            )
            self.stages[name] = Stage(
                name, load_executor(st.executor, ctx), self.graph.wait_for[name]
            )
            self.step_log[name] = deque(maxlen=STEP_LOG)
            self.batch_log[name] = deque(maxlen=STEP_LOG)
            self.cpu_log[name] = deque(maxlen=STEP_LOG)
            for e in self.graph.out_edges[name]:
                dev = self.cfg.stages[e.dst].device if e.dst in self.cfg.stages else "cpu"
                self.outlets[(e.src, e.dst)] = Outlet(
                    e,
                    self.me,
                    args.epoch,
                    args.owner_pid,
                    rt.inline_max_bytes,
                    dev,
                    here,
                    rt.mooncake_protocol,
                )
        self.router = Router(self.graph, self.stages, self.outlets, self)
        self.meter = ComputeMeter()  # what each request's steps cost each stage
        self.gc_frozen = 0  # objects `run` froze
        self.running = True
        self._lock = threading.Lock()
        self._stepping = threading.Event()

    # ---- sockets -----------------------------------------------------------------------

    def _socket(self, process: str) -> zmq.Socket | None:
        if process in self.router.down:
            return None
        sock = self.peers.get(process)
        if sock is None:
            endpoint = self.graph.endpoint(process, self.epochs.get(process, 0), self.ipc_dir)
            sock = self.peers[process] = sockets.peer(self.zmq, endpoint, self.secret)
        return sock

    def _send(self, process: str, msg: m.Message, frames: Sequence[Any] = ()) -> None:
        sock = self._socket(process)
        if sock is not None:
            m.send(sock, msg, frames)

    def _to_coordinator(self, msg: m.Message) -> None:
        self._send(m.CLIENT, msg)

    # ---- loop --------------------------------------------------------------------------

    def run(self) -> None:
        """The loop. It holds `_lock` except inside a model step and while idle; during a step
        the control thread takes the lock to handle what arrives (aborts above all), so an
        abort is acknowledged without waiting for a long step (a prefill) to end."""
        orphaned = self._orphan_check()
        # Unfrozen, a full pass came once per process within a dozen tiny-model requests.
        self.gc_frozen = freeze_start_up()
        self._to_coordinator(m.Ready(self.me, self.args.epoch, os.getpid()))
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        beat_every = self.cfg.runtime.heartbeat_interval_s
        self._next_beat = time.monotonic() + beat_every
        fd = self.inbox.fileno()
        control = threading.Thread(target=self._control, args=(fd,), name="control", daemon=True)
        self._lock.acquire()
        control.start()
        try:
            while self.running:
                busy = self._drain()
                busy |= self.router.work(self._step)
                if self._beat() and orphaned():
                    break  # the coordinator is gone: nothing will ever ask us again
                if not busy and self.running:
                    wait = min(beat_every, self._wake_in())
                    self._lock.release()
                    try:
                        poller.poll(timeout=int(wait * 1000))  # as pyzmq rounds a float
                    finally:
                        self._lock.acquire()
        finally:
            self.running = False
            self._lock.release()
            control.join()
            self.close()

    def _orphan_check(self) -> Callable[[], bool]:
        """A check of whether the coordinator that started us is gone: our parent changed, or
        for a fork server's child, the coordinator's pidfd (opened now, while it waits for our
        Ready, so a reused pid cannot fool it) says it exited."""
        if not self.args.watch_parent:
            return lambda: False
        if not self.args.parent_is_fork_server:
            parent = os.getppid()
            return lambda: os.getppid() != parent
        try:
            fd = os.pidfd_open(self.args.owner_pid)
        except ProcessLookupError:
            return lambda: True
        return lambda: bool(select.select([fd], [], [], 0)[0])

    def _wake_in(self) -> float:
        """Seconds until a stage's executor has work again of itself, with no message (its
        optional `wake_in`: a paced step falls due); infinite when none says."""
        times = [
            t
            for st in self.stages.values()
            if isinstance(st.executor, Wakes) and (t := st.executor.wake_in()) is not None
        ]
        return max(0.0, min(times, default=float("inf")))

    def _beat(self) -> bool:
        """Send the heartbeat when it is due (under the lock: from the loop between steps, and
        from the control thread during a step, so a step longer than `heartbeat_timeout_s`
        does not get a live process declared dead). Whether it was due."""
        now = time.monotonic()
        if now < self._next_beat:
            return False
        self._next_beat = now + self.cfg.runtime.heartbeat_interval_s
        self._to_coordinator(m.Heartbeat(self.me, self.args.epoch))
        return True

    def _control(self, fd: int) -> None:
        """While a stage steps, drain the inbox (under the lock) as soon as a message arrives.

        It waits in `select` on the socket's file descriptor, which touches no ZMQ state, so
        the wait needs no lock; ZMQ signals that descriptor on every change of the socket's
        events after `zmq.EVENTS` was read, which is why it is read before each wait."""
        while self.running:
            if not self._stepping.wait(timeout=0.2):
                continue
            with self._lock:
                if not (self._stepping.is_set() and self.running):
                    continue
                self._beat()
                if cast(int, self.inbox.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    self._drain()
                    continue
            select.select([fd], [], [], CONTROL_WAIT_S)

    def _step(self, stage: Stage) -> list[Emit]:
        """Run one executor step with the lock released (see `run`). Aborts that arrive
        meanwhile reach every stage of the process, but their executors are only called after
        the step: executors are only ever called from this thread."""
        for st in self.stages.values():
            st.begin_step()
        self._stepping.set()
        self._lock.release()
        start, cpu = time.monotonic(), time.thread_time()
        try:
            emits, error = stage.executor.step(), None
        except Exception as e:
            emits, error = [], e
        finally:
            self._lock.acquire()
            self._stepping.clear()
            took = time.monotonic() - start
            self.step_log[stage.name].append((start, took))
            self.batch_log[stage.name].append(len({e.request_id for e in emits}))
            self.cpu_log[stage.name].append(time.thread_time() - cpu)
        if isinstance(stage.executor, Shares):
            shares = stage.executor.step_shares()
        else:
            shares = {e.request_id: 1.0 for e in emits}
        self.meter.charge(stage.name, took, shares)
        for st in self.stages.values():
            if st is not stage:
                st.end_step([], None)
        out = stage.end_step(emits, error)
        for rid in stage.aborted_in_step:  # acknowledged during the step: send the rest now
            if (spent := self.meter.take(stage.name, rid)) > 0:
                self._to_coordinator(m.Spent(rid, stage.name, spent))
        return out

    def _drain(self) -> bool:
        batch: list[tuple[m.Message, list[Any]]] = []
        while len(batch) < MAX_DRAIN:
            try:
                got = m.receive(self.inbox, self.copy_recv)
            except m.Malformed as e:
                log.warning("%s: dropped a message: %s", self.me, e)
                continue
            if got is None:
                break
            batch.append(got)
        # Aborts and peer changes first: data of an aborted request is then dropped unprocessed.
        urgent = (m.Abort, m.PeerDown, m.Shutdown)
        for msg, frames in batch:
            if isinstance(msg, urgent):
                self._guarded(msg, frames)
        for msg, frames in batch:
            if not isinstance(msg, urgent):
                self._guarded(msg, frames)
        return bool(batch)

    def _guarded(self, msg: m.Message, frames: list[Any]) -> None:
        """Handle one message; one that names no stage, edge or peer of this process (forged,
        or from a config other than ours) is logged and dropped, and the process goes on."""
        try:
            self._handle(msg, frames)
        except Exception as e:
            log.warning("%s: dropped %s: %s: %s", self.me, type(msg).__name__, type(e).__name__, e)

    # ---- inbound -----------------------------------------------------------------------

    def _handle(self, msg: m.Message, frames: list[Any]) -> None:
        match msg:
            case m.DataReady():
                self._on_data(msg, frames)
            case m.StreamEnd(request_id=rid, src=src, dst=dst, route=route):
                self.router.receive_end(rid, src, dst, route)
            case m.DataAck(src=src, dst=dst, lease=lease):
                self.router.acked(src, dst, lease)
            case m.Abort(request_id=rid):
                self.router.abort(rid)
            case m.PeerDown(process=p):
                self.router.peer_down(p)
                sockets.drop(self.peers, p)
                self.inlet.forget(p, self.args.owner_pid)
            case m.PeerUp(process=p, epoch=epoch, address=address):
                self.router.peer_up(p)
                self.epochs[p] = epoch
                if address is not None and self.graph.address_of(p) != address:
                    self.graph.moved[p] = address  # the next send connects there
                    sockets.drop(self.peers, p)
                self._to_coordinator(m.PeerUpAck(self.me, p))
            case m.StatsRequest(token=token):
                self._to_coordinator(self._stats(token))
            case m.Shutdown():
                self.running = False
            case _:
                pass  # other messages are the coordinator's

    def _on_data(self, msg: m.DataReady, frames: list[Any]) -> None:
        src_process, ack = msg.src_process, m.DataAck(msg.src, msg.dst, msg.lease)

        def release() -> None:
            self.inlet.settle(msg)  # a CUDA IPC slot: wait for our GPU work still reading it
            self._send(src_process, ack)

        self.router.receive_data(msg, frames, release)

    # ---- the router's link (see `router.Link`) -----------------------------------------

    def send_data(
        self, edge: Edge, peer: str, request_id: str, lease: int, payload: Payload, route: Route
    ) -> None:
        shared = self.graph.shares_memory(self.me, peer)
        msg, frames = self.outlets[(edge.src, edge.dst)].pack(
            request_id, lease, payload, route, shared
        )
        self._send(peer, msg, frames)

    def send_end(self, edge: Edge, peer: str, request_id: str, route: Route) -> None:
        self._send(peer, m.StreamEnd(request_id, edge.src, edge.dst, route))

    def open_payload(self, msg: m.DataReady, frames: list[Any]) -> Payload:
        return self.inlet.open(msg, frames)

    def stage_done(self, stage: str, request_id: str) -> None:
        self._to_coordinator(
            m.StageDone(request_id, stage, self.me, self.meter.take(stage, request_id))
        )

    def stage_error(self, stage: str, request_id: str, message: str) -> None:
        self._to_coordinator(m.StageError(request_id, stage, message))

    def abort_acked(self, stage: str, request_id: str) -> None:
        self._to_coordinator(
            m.AbortAck(request_id, stage, self.me, self.meter.take(stage, request_id))
        )

    # ---- stats and shutdown ------------------------------------------------------------

    def _stats(self, token: int) -> m.Stats:
        mine = segment_name(self.args.owner_pid, self.me, "")
        return m.Stats(
            token=token,
            process=self.me,
            free_slots={o.edge.key: o.pool.free for o in self.outlets.values()},
            total_slots={o.edge.key: o.pool.n for o in self.outlets.values()},
            active_requests={n: s.active for n, s in self.stages.items()},
            segments=[s for s in list_segments(self.args.owner_pid) if s.startswith(mine)],
            steps={n: list(log) for n, log in self.step_log.items()},
            gc_frozen=self.gc_frozen,
            batches={n: list(log) for n, log in self.batch_log.items()},
            step_cpu={n: list(log) for n, log in self.cpu_log.items()},
            kv={
                n: s.executor.kv_stats()
                for n, s in self.stages.items()
                if isinstance(s.executor, ReportsKv)
            },
            queued_in=self.router.queued_in(),
            queued_out=self.router.queued_out(),
            busy_s=dict(self.meter.busy_s),
        )

    def close(self) -> None:
        for outlet in self.outlets.values():
            outlet.close()
        unlink_segments(segment_name(self.args.owner_pid, self.me, ""))
        self.inlet.close()
        for sock in self.peers.values():
            sock.close(linger=100)
        self.inbox.close(linger=0)
        self.zmq.term()


if __name__ == "__main__":  # started by the coordinator: python -m realtime_omni.pipeline.worker
    worker_main(msgspec.json.decode(os.environ.pop(ARGS_ENV), type=WorkerArgs))
