"""The stage processes of one coordinator: starting them (forks of the fork server, plain
`Popen`, or Ray actors), their readiness, their warm spares, the death watch and restarts.

The coordinator is its `Host`: it hears of a death (`on_death`, in the loop) and carries out
what a restart needs of the other processes (`peer_up`). Runs in the coordinator's loop but for
the monitor thread, which watches the local processes' pidfds so a death (even SIGKILL) is seen
within `_MONITOR_S`, and a remote process's silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Coroutine
from pathlib import Path
from typing import Any, Protocol

import msgspec

from realtime_omni.aio import within
from realtime_omni.errors import StartupError
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline.config import PipelineConfig
from realtime_omni.pipeline.environ import stage_environ
from realtime_omni.pipeline.forkserver import Forked, ForkServer
from realtime_omni.pipeline.graph import Graph, group_of
from realtime_omni.pipeline.ray_placement import RayPlacement, RayProcess
from realtime_omni.pipeline.worker import ARGS_ENV, WorkerArgs

log = logging.getLogger(__name__)
LocalProcess = subprocess.Popen[bytes] | Forked  # a stage process started here
_MONITOR_S = 0.05  # the monitor thread's longest wait between checks of remote silence
_STARTUP_ERROR_S = 3.0  # how long a process that exited at start may take to say why (its
# StageError leaves with a 2 s linger; 0.5 s was too short for a loaded machine: CI saw it)


class Host(Protocol):
    """What the supervisor needs of the coordinator."""

    down: set[str]  # processes known dead, not yet back

    def send(self, process: str, msg: m.Message) -> None: ...

    def moved(self, process: str) -> None:
        """`process` runs at another address now: drop the socket to where it was."""
        ...

    def on_death(self, process: str) -> None: ...

    def peer_up(self, process: str) -> Awaitable[None]:
        """Tell every live process that `process` is back (and it where they are)."""
        ...

    def wake(self) -> None:
        """Something a waiting `submit` may care about changed."""
        ...


class Supervisor:
    def __init__(self, cfg: PipelineConfig, graph: Graph, owner_pid: int, host: Host) -> None:
        self.cfg = cfg
        self.graph = graph
        self.owner_pid = owner_pid
        self.host = host
        self.ipc_dir: Path | None = None
        self.epochs = {p: 0 for p in graph.processes()}
        self._next_epoch = dict(self.epochs)  # the last epoch handed out, per process
        # Stage processes this coordinator started: forked by the fork server (or Popen, with
        # runtime.fork_server off) here, RayProcess with placement ray.
        self.procs: dict[str, LocalProcess | RayProcess] = {}
        self.forks: ForkServer | None = None  # None: plain Popen (off, or lost and not back)
        self._fork_modules: list[str] = []
        self._forks_fd: int | None = None  # the fork server's pidfd, watched on the loop
        self._replacing: asyncio.Future[None] | None = None  # a new fork server on its way
        self.ray: RayPlacement | None = None
        self.ready: dict[str, asyncio.Future[None]] = {}
        self.startup_errors: dict[str, str] = {}  # stages of a process -> why it did not start
        self.broken: dict[str, str] = {}  # process -> why its restart failed
        self.last_beat: dict[str, float] = {}
        # Warm spares (runtime.warm_spares): a loaded process per local stage process, bound to
        # an epoch of its own that no peer knows until it takes over.
        self.spares: dict[str, tuple[int, LocalProcess]] = {}  # process -> (epoch, it)
        self.spare_ready: dict[str, asyncio.Future[None]] = {}
        self.closing = False
        self._waiters: set[asyncio.Event] = set()  # each wait_ready's: see `_notify`
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_monitor = threading.Event()
        self._monitor: threading.Thread | None = None

    # ---- start -------------------------------------------------------------------------

    async def place(self) -> None:
        """With placement ray: place the groups (hosts, sockets and edges follow from where)."""
        self.ray = await asyncio.to_thread(RayPlacement, self.cfg)
        self.cfg, self.graph = self.ray.config, Graph(self.ray.config)

    async def start(self, ipc_dir: Path) -> None:
        """Start every stage process (the fork server first, where it is used); returns when
        all are ready, raises `StartupError` if one is not."""
        self.loop = asyncio.get_running_loop()
        self.ipc_dir = ipc_dir
        rt = self.cfg.runtime
        for p in self.graph.processes():  # first: a remote process may say Ready at any time
            self.ready[p] = self.loop.create_future()
        if rt.fork_server and self.ray is None:
            modules = {"realtime_omni.pipeline.worker"} | {
                self.cfg.stages[s].executor.partition(":")[0]
                for p in self.graph.local_processes()
                for s in self.graph.groups[group_of(p)].stages
            }
            self._fork_modules = sorted(modules)
            self.forks = await asyncio.to_thread(self._new_fork_server)
            self._watch_forks(self.forks)
        started = self.graph.processes() if self.ray else self.graph.local_processes()
        for p in self.graph.processes():
            if p in started:
                await self.launch(p)
        await self.wait_ready(list(self.ready), rt.ready_timeout_s)

    def watch(self) -> None:
        """Start the death watch, and the warm spares."""
        self._monitor = threading.Thread(target=self._watch, name="rto-monitor", daemon=True)
        self._monitor.start()
        rt = self.cfg.runtime
        if rt.warm_spares and rt.restart_stages and self.ray is None:
            for p in self.graph.local_processes():
                self._spawn_spare(p)

    # ---- the fork server --------------------------------------------------------------

    def _new_fork_server(self) -> ForkServer:
        """A fork server with the config's modules imported; blocks for the imports (seconds
        with torch): call it off the loop."""
        forks = ForkServer(self._fork_modules, self._stage_environ())
        try:
            forks.wait_ready()
        except BaseException:
            forks.close()
            raise
        return forks

    def _watch_forks(self, forks: ForkServer) -> None:
        """Hear of the fork server's death on the loop, through its pidfd."""
        fd = self._forks_fd = os.pidfd_open(forks.proc.pid)

        def exited() -> None:
            self._fork_server_lost(forks, f"exit code {forks.proc.wait()}")

        self.loop.add_reader(fd, exited)

    def _unwatch_forks(self) -> None:
        if self._forks_fd is not None:
            self.loop.remove_reader(self._forks_fd)
            os.close(self._forks_fd)
            self._forks_fd = None

    def _fork_server_lost(self, forks: ForkServer, why: str) -> None:
        """The fork server died (the OOM killer, a kill -9) or stopped answering. Its stage
        processes live on (they watch the coordinator, not it) and nothing of theirs changes;
        another server is started now; a restart meanwhile waits for it, and a start it cannot
        serve (it failed too) is a plain `Popen`, a fresh interpreter."""
        if self.forks is not forks:
            return  # heard of already
        self.forks = None
        self._unwatch_forks()
        with contextlib.suppress(OSError):
            forks.proc.kill()  # if it only stopped answering
        forks.proc.wait()
        # Its socket stays open: exits it reported before dying are still to be read there by
        # its children's `Forked.poll`.
        if self.closing:
            return
        log.warning(
            "the fork server (pid %d) is gone (%s); its stage processes go on, and another "
            "is started for the next starts",
            forks.proc.pid,
            why,
        )
        self._replacing = asyncio.ensure_future(self._replace_forks())
        self._tasks.add(self._replacing)
        self._replacing.add_done_callback(self._tasks.discard)

    async def _replace_forks(self) -> None:
        try:
            forks = await asyncio.to_thread(self._new_fork_server)
        except Exception as e:
            log.error("no new fork server (%s): stage processes start as plain processes", e)
            return
        finally:
            self._replacing = None
        if self.closing or self.forks is not None:
            forks.close()
            return
        self.forks = forks
        self._watch_forks(forks)
        log.info("a new fork server (pid %d) is up", forks.proc.pid)

    # ---- processes ---------------------------------------------------------------------

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

    def _stage_environ(self) -> dict[str, str]:
        """The server's environment less its credentials, the Curve key kept (environ.py)."""
        return stage_environ(os.environ, keep=[self.cfg.runtime.curve_secret_env])

    def _spawn(self, process: str, epoch: int | None = None) -> LocalProcess:
        args = self._worker_args(process, epoch)
        env = {**self._stage_environ(), ARGS_ENV: msgspec.json.encode(args).decode()}
        proc: LocalProcess | None = None
        if self.forks is not None:
            try:
                proc = self.forks.spawn(env)
            except OSError as e:  # it died under us, before its pidfd said so, or hangs
                self._fork_server_lost(self.forks, f"{type(e).__name__}: {e}")
        if proc is None:
            argv = [sys.executable, "-m", "realtime_omni.pipeline.worker"]
            proc = subprocess.Popen(argv, env=env)
        if epoch is None:
            self.procs[process] = proc
        return proc

    async def launch(self, process: str) -> None:
        """Start `process`: here, or with placement ray through its group's actor, on the node
        Ray chose (off the loop: a restarted actor may take seconds to come back)."""
        if self.ray is None:
            forks = self.forks
            if forks is not None and forks.proc.poll() is not None:  # before its pidfd told
                self._fork_server_lost(forks, f"exit code {forks.proc.returncode}")
            if self._replacing is not None:
                # A new fork server is importing: waiting for it is quicker than a fresh
                # interpreter doing the same imports beside it, on the same cores.
                await asyncio.shield(self._replacing)
            self._spawn(process)
            return
        keep = [self.cfg.runtime.curve_secret_env]  # its name: each node has the key itself
        try:
            node, ip = await asyncio.to_thread(self.ray.locate, process)
            if node != self.ray.where[process][0]:  # Ray restarted its actor elsewhere
                if not self.graph.use_tcp:
                    raise StartupError(
                        f"stage process {process} came back on node {node[:12]}, off this "
                        "server's node, where its ipc sockets and shared memory cannot follow"
                    )
                log.warning("stage process %s moved to node %s (%s)", process, node[:12], ip)
                self.ray.where[process] = (node, ip)
            if self.graph.use_tcp and self.graph.address_of(process) != ip:
                self.graph.moved[process] = ip  # peers learn it from PeerUp
                self.host.moved(process)  # connected to where it was
            args = self._worker_args(process)
            proc = await asyncio.to_thread(self.ray.start, process, args, ARGS_ENV, keep)
        except StartupError:
            raise
        except Exception as e:  # its actor is gone for good, or Ray is
            why = f"stage process {process}: its Ray actor did not start it: {e}"
            raise StartupError(why) from None
        self.procs[process] = proc
        self.track(self._watch_ray(process, proc))

    async def _watch_ray(self, process: str, proc: RayProcess) -> None:
        """A Ray-run process is dead when its actor's `wait` returns (or its actor, or its
        node, died)."""
        with contextlib.suppress(Exception):
            await proc.exited
        if self.procs.get(process) is proc:
            self.host.on_death(process)

    def _spawn_spare(self, process: str) -> None:
        """Start a spare of `process` on an epoch of its own; its Ready marks it loaded."""
        if self.closing:
            return
        epoch = self._next_epoch[process] = self._next_epoch[process] + 1
        self.spare_ready[process] = self.loop.create_future()
        self.spares[process] = (epoch, self._spawn(process, epoch))

    async def wait_ready(self, processes: list[str], timeout: float) -> None:
        """Until every one of `processes` said Ready; `StartupError` naming the cause when one
        exits first, or at `timeout`. Woken by each Ready, start-up error and exit."""
        deadline = self.loop.time() + timeout
        changed = asyncio.Event()
        self._waiters.add(changed)
        watched = self._watch_exits(processes)
        try:
            while True:
                changed.clear()
                missing = [p for p in processes if not self.ready[p].done()]
                if not missing:
                    return
                for p in missing:
                    proc = self.procs.get(p)
                    if proc is not None and proc.poll() is not None:
                        why = await self._startup_failure(p, proc.returncode, changed)
                        raise StartupError(why)
                if self.loop.time() > deadline:
                    names = ", ".join(
                        f"{p} ({', '.join(self.graph.groups[group_of(p)].stages)})" for p in missing
                    )
                    raise StartupError(
                        f"stage processes not ready after {timeout:.0f} s: {names}. Fix: check "
                        "their logs, or raise runtime.ready_timeout_s for slow model loads"
                    )
                with contextlib.suppress(TimeoutError):
                    await within(changed.wait(), max(0.0, deadline - self.loop.time()))
        finally:
            self._waiters.discard(changed)
            for fd in watched:
                self.loop.remove_reader(fd)
                os.close(fd)

    def _watch_exits(self, processes: list[str]) -> list[int]:
        """Wake `wait_ready` when one of `processes` exits: a pidfd per local process; a Ray
        process's exit is its actor's `wait` returning."""
        fds = []
        for p in processes:
            proc = self.procs.get(p)
            if isinstance(proc, RayProcess):
                self.track(self._wake_on(proc.exited))
            elif proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    fd = os.pidfd_open(proc.pid)
                    self.loop.add_reader(fd, self._notify)
                    fds.append(fd)
        return fds

    async def _wake_on(self, exited: Any) -> None:
        with contextlib.suppress(Exception):
            await exited
        self._notify()

    def _notify(self) -> None:
        """Wake every `wait_ready`: a Ready, a start-up error or an exit came."""
        for changed in self._waiters:
            changed.set()

    async def _startup_failure(self, process: str, code: int | None, changed: asyncio.Event) -> str:
        """Why `process` failed to start: the error it sent before exiting (which may still be
        on its way through the inbox), else its exit code."""
        stages = ", ".join(self.graph.groups[group_of(process)].stages)
        if stages not in self.startup_errors:
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await within(changed.wait(), _STARTUP_ERROR_S)
        why = self.startup_errors.get(stages, f"exit code {code}")
        return f"stage process {process} ({stages}) failed to start: {why}"

    # ---- what the processes say --------------------------------------------------------

    def on_ready(self, process: str, epoch: int) -> bool:
        """`process` (incarnation `epoch`) loaded. Whether it is a remote process that was down
        and came back (the coordinator then tells its peers)."""
        spare = self.spares.get(process)
        if spare is not None and spare[0] == epoch:
            if not self.spare_ready[process].done():
                self.spare_ready[process].set_result(None)
            return False
        fut = self.ready.get(process)
        if epoch == self.epochs.get(process) and fut is not None and not fut.done():
            fut.set_result(None)
            self._notify()
        self.last_beat[process] = time.monotonic()
        return process in self.host.down and process not in self.procs

    def on_heartbeat(self, process: str) -> None:
        self.last_beat[process] = time.monotonic()

    def on_startup_error(self, stages: str, message: str) -> None:
        self.startup_errors[stages] = message
        self._notify()

    # ---- faults ------------------------------------------------------------------------

    def _watch(self) -> None:
        """Monitor thread: report a dead local process, or a silent remote one, to the loop."""
        fds: dict[int, tuple[int, str]] = {}  # pid -> (pidfd, process), for live local processes
        try:
            while not self._stop_monitor.is_set():
                for p, pr in list(self.procs.items()):
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
                    self.loop.call_soon_threadsafe(self.host.on_death, p)
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
            proc = self.procs.get(p)
            local = proc is not None and not isinstance(proc, RayProcess)
            if not local and now - self.last_beat.get(p, now) > limit:
                dead.append(p)  # on_death ignores a process already down

    async def restart(self, process: str) -> None:
        proc = self.procs[process]  # reap it: it is dead, so this returns at once
        if isinstance(proc, RayProcess):  # Ray calls: off the loop
            if await asyncio.to_thread(proc.poll) is None:  # silent, not (yet) seen dead
                await asyncio.to_thread(proc.kill)  # a frozen node's may wake: no second one
            await asyncio.to_thread(proc.wait)  # until Ray reports it ended, or its node dead
        else:
            proc.wait()
        epoch, spare = self.spares.pop(process, (0, None))
        if spare is not None and spare.poll() is None and self.spare_ready[process].done():
            # The spare takes over: the peer-up round tells it where every peer is now.
            self.epochs[process], self.procs[process] = epoch, spare
            self.ready[process] = self.spare_ready.pop(process)
            await self.host.peer_up(process)
            self._spawn_spare(process)
            return
        if spare is not None:  # not loaded yet (or dead): a plain restart, and a new spare
            spare.kill()
            spare.wait()
        self.epochs[process] = self._next_epoch[process] = self._next_epoch[process] + 1
        self.ready[process] = self.loop.create_future()
        try:
            await self.launch(process)
            await self.wait_ready([process], self.cfg.runtime.ready_timeout_s)
        except Exception as e:  # a StartupError names its cause; anything else is a bug
            if not isinstance(e, StartupError):
                log.exception("stage process %s: the restart failed", process)
            self.broken[process] = str(e) or type(e).__name__
            self.host.wake()
            return
        await self.host.peer_up(process)
        if self.cfg.runtime.warm_spares:
            self._spawn_spare(process)

    def track(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task that `close` cancels."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- stop --------------------------------------------------------------------------

    async def _exit(self, proc: LocalProcess | RayProcess) -> None:
        """Until `proc` has exited: its pidfd read on the loop, or its Ray actor's `wait`."""
        if proc.poll() is not None:
            return
        if isinstance(proc, RayProcess):
            with contextlib.suppress(Exception):
                await proc.exited
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:
            return
        exited = asyncio.Event()
        self.loop.add_reader(fd, exited.set)
        try:
            await exited.wait()
        finally:
            self.loop.remove_reader(fd)
            os.close(fd)

    def stop_watching(self) -> None:
        self.closing = True
        self._stop_monitor.set()

    async def close(self) -> None:
        """Stop every process (Shutdown, then a kill after 5 s) and the fork server."""
        self.stop_watching()
        for p in self.procs:
            if p not in self.host.down:
                self.host.send(p, m.Shutdown())
        for _, spare in self.spares.values():
            spare.terminate()  # loaded and idle: nothing to finish
        procs = [*self.procs.values(), *(s for _, s in self.spares.values())]
        with contextlib.suppress(TimeoutError):
            await within(asyncio.gather(*(self._exit(p) for p in procs)), 5.0)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        if self.forks is not None:
            self._unwatch_forks()
            self.forks.close()

    def cancel_tasks(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def close_ray(self) -> None:
        if self.ray is not None:
            await asyncio.to_thread(self.ray.close)

    # ---- introspection -----------------------------------------------------------------

    def pid_of(self, process: str) -> int | None:
        proc = self.procs.get(process)
        return proc.pid if proc is not None else None

    def spares_loaded(self) -> dict[str, bool]:
        """Per local process with a warm spare (`runtime.warm_spares`): whether it has loaded."""
        return {p: fut.done() for p, fut in self.spare_ready.items()}
