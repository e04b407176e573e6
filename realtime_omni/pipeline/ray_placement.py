"""Stage processes placed and supervised by Ray (`runtime.placement: ray`, `serve --ray ADDR`).

    placement = RayPlacement(cfg)              # ray.init; a placement group, a bundle a process
    cfg = placement.config                     # `hosts` and each stage's `host`: where Ray put it
    proc = placement.start(process, args)      # the stage process, run by its actor on its node
    placement.close()

The coordinator reserves one bundle per stage process (each replica its own): the GPUs its
stages' devices name (`cuda:N`: one each), else one CPU, or the stage's own `resources`. Ray
chooses the nodes; each process gets an actor (`StageHost`) in its bundle, which runs the stage
process there: `python -m realtime_omni.pipeline.worker`, the same entry point the coordinator
starts on its own machine, so there is one way a stage runs. The actor asks for the bundle's
resources, so Ray's `CUDA_VISIBLE_DEVICES` reaches the process.

Where the processes landed becomes the config every process sees: a group on the coordinator's
node keeps `host: null` (ipc sockets, shared memory and CUDA IPC, as without Ray); one on
another node gets that node as its `host` (`node-<id>`, at the node's address), so its edges and
control sockets go over TCP with CurveZMQ; a group whose replicas landed on several nodes gets
`replica_hosts`, one per replica, and its edges go over TCP. Without a key in the environment
the coordinator makes one for the deployment and hands it to the actors.

A stage process that dies is seen when its actor's `wait` returns (at once; no heartbeat to
miss); the coordinator's usual restart then starts it again through the same actor. An actor or
node that dies fails its `wait` too (a node killed: in 1-2 s; one that stops answering: once
Ray's health check declares it dead, so the coordinator also counts its silence, as any remote
process's); Ray restarts the actor (`max_restarts`), in its bundle, on a node that has the
bundle's resources, and the restart lands there. `locate` says where that is: the coordinator
hands a process that moved its new address, and tells its peers (see the coordinator's
`_launch` and `_peer_up`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import msgspec

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline import sockets
from realtime_omni.pipeline.config import PipelineConfig
from realtime_omni.pipeline.environ import stage_environ
from realtime_omni.pipeline.graph import Graph, group_of

log = logging.getLogger(__name__)
LOCATE_RETRY_S = 0.5  # between two questions to an actor Ray is restarting


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "runtime.placement: ray needs Ray. Fix: pip install 'realtime-omni[ray]', or use "
            "placement: local"
        ) from None
    return ray


class StageHost:
    """Ray actor: runs one stage process on its node and reports when it ends. Threaded
    (`max_concurrency`), so `signal` is served while `wait` blocks."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, args_env: str, args_json: str, keep: list[str]) -> int:
        """Start the stage process with this node's environment less its credentials, but
        those named in `keep` (the Curve key's variable: each node has its own copy, set where
        `ray start` ran, so no secret travels in an actor call); its pid."""
        cmd = [sys.executable, "-m", "realtime_omni.pipeline.worker"]
        env = stage_environ(os.environ, keep=keep)
        self.proc = subprocess.Popen(cmd, env={**env, args_env: args_json})
        return self.proc.pid

    def wait(self) -> int:
        """The stage process's exit code, once it ends."""
        assert self.proc is not None
        return self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class RayProcess:
    """A stage process run by its actor, as the coordinator holds a `subprocess.Popen`: `pid`
    (on its node), `poll`, `wait`, `kill`; `exited` is the actor's `wait`, which an asyncio task
    may await."""

    def __init__(self, ray: Any, actor: Any, pid: int, node_id: str) -> None:
        self._ray, self._actor = ray, actor
        self.pid, self.node_id = pid, node_id
        self.exited = actor.wait.remote()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, _ = self._ray.wait([self.exited], timeout=0)
            if done:
                self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """As `Popen.wait`: the exit code, or `subprocess.TimeoutExpired` after `timeout`."""
        if self.returncode is None:
            done, _ = self._ray.wait([self.exited], timeout=timeout)
            if not done:
                what = f"ray stage process {self.pid} on {self.node_id}"
                raise subprocess.TimeoutExpired(what, timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def _collect(self) -> None:
        try:
            self.returncode = int(self._ray.get(self.exited, timeout=5))
        except Exception:  # the actor (or its node) died with the process
            self.returncode = -int(signal.SIGKILL)

    def kill(self) -> None:
        try:
            self._ray.get(self._actor.signal.remote(int(signal.SIGKILL)), timeout=5)
        except Exception:
            log.debug("SIGKILL to a stage on node %s: its actor is gone", self.node_id)


def bundle(graph: Graph, group: str) -> dict[str, float]:
    """What one process of a group reserves: its stages' own `resources`, else a GPU per CUDA
    device they name, else one CPU."""
    stages = [graph.stages[s] for s in graph.groups[group].stages]
    own: dict[str, float] = {}
    for st in stages:
        for k, v in (st.resources or {}).items():
            own[k] = max(own.get(k, 0.0), v)
    if not own:
        gpus = {st.device for st in stages if st.device.startswith("cuda")}
        own = {"GPU": float(len(gpus))} if gpus else {"CPU": 1.0}
    return own


class RayPlacement:
    def __init__(self, cfg: PipelineConfig) -> None:
        ray = self.ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove = remove_placement_group
        if cfg.hosts:
            raise ConfigError(
                "runtime.placement: ray places the stages itself; remove the config's `hosts` "
                "and the stages' `host`"
            )
        rt = cfg.runtime
        self.ready_timeout_s = rt.ready_timeout_s
        self.closed = False
        self._owns_ray = not ray.is_initialized()  # then close() shuts down what init started
        if self._owns_ray:
            if rt.ray_address is None and not os.environ.get(rt.curve_secret_env):
                # A one-node Ray of this server's own: its nodes' processes inherit a key made
                # here (an existing cluster's nodes have theirs from where `ray start` ran).
                os.environ[rt.curve_secret_env] = sockets.keygen()
            # The stage processes' output comes back to this server's (log_to_driver).
            ray.init(address=rt.ray_address, include_dashboard=False,
                     configure_logging=False)  # fmt: skip
        graph = Graph(cfg)
        processes = graph.processes()
        self.bundles = [bundle(graph, group_of(p)) for p in processes]
        self.pg = placement_group(self.bundles, strategy=rt.ray_strategy)
        try:
            ray.get(self.pg.ready(), timeout=rt.ready_timeout_s)
        except Exception:
            self._remove(self.pg)
            raise ConfigError(
                f"Ray could not reserve {self.bundles} (one bundle per stage process) "
                f"within {rt.ready_timeout_s:.0f} s: the cluster lacks the resources. Fix: add "
                "nodes, or lower what the stages ask (`resources`, devices, replicas)"
            ) from None
        actor_cls = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)(StageHost)
        self.actors: dict[str, Any] = {}  # process -> its actor
        where: dict[str, tuple[str, str]] = {}
        for i, p in enumerate(processes):
            res = dict(self.bundles[i])
            opts: dict[str, Any] = {
                "num_cpus": res.pop("CPU", 0.0),
                "num_gpus": res.pop("GPU", 0.0),
                "resources": res,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=i
                ),
            }
            self.actors[p] = actor_cls.options(**opts).remote()
        for p, actor in self.actors.items():
            where[p] = tuple(ray.get(actor.node.remote()))  # type: ignore[assignment]
        self.node_id = ray.get_runtime_context().get_node_id()
        my_ip = ray.util.get_node_ip_address()
        self.where = where
        self.config = self._placed(cfg, graph, my_ip)

    def _placed(self, cfg: PipelineConfig, graph: Graph, my_ip: str) -> PipelineConfig:
        """The config as placed: processes on other nodes on `node-<id>` hosts at their nodes'
        addresses; a group whose replicas landed on several nodes gets `replica_hosts`."""
        hosts: dict[str, dict[str, str]] = {}

        def host(process: str) -> str | None:
            node, ip = self.where[process]
            if node == self.node_id:
                return None
            hosts[f"node-{node[:12]}"] = {"address": ip}
            return f"node-{node[:12]}"

        stages = {}
        for name, st in cfg.stages.items():
            on = [host(p) for p in graph.groups[graph.process_of[name]].process_names()]
            if len(set(on)) == 1:
                stages[name] = st.model_copy(update={"host": on[0], "replica_hosts": None})
            else:
                stages[name] = st.model_copy(update={"host": None, "replica_hosts": on})
        data = cfg.model_dump()
        data["stages"] = {k: v.model_dump() for k, v in stages.items()}
        data["hosts"] = hosts
        if hosts:
            data["runtime"]["bind_host"] = my_ip
        placed = PipelineConfig.model_validate(data)
        for p, (node, ip) in self.where.items():
            log.info("ray placed %s on node %s (%s)", p, node[:12], ip)
        return placed

    def locate(self, process: str) -> tuple[str, str]:
        """The node (id, address) where `process`'s actor runs now: where Ray placed it, or
        where it restarted the actor after its node went (waits for that restart).

        Asked before Ray has seen the node go, the call can reach the dead actor and fail
        (the actor's tasks are not retried, so that `wait` reports a death), though Ray then
        restarts the actor: so it is asked again, up to `ready_timeout_s`, until `close`.
        Failing at once left that process down for good (a likely cause, not reproduced, of
        one failure of `tests/integration/test_ray.py` on a loaded machine)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                node, ip = self.ray.get(self.actors[process].node.remote())
                return str(node), str(ip)
            except self.ray.exceptions.RayActorError:
                if time.monotonic() >= deadline or self.closed:
                    raise
                log.info("stage process %s: its actor is restarting; asking again", process)
                time.sleep(LOCATE_RETRY_S)

    def start(self, process: str, args: Any, args_env: str, keep: list[str]) -> RayProcess:
        """Run `process` (`WorkerArgs`) through its actor."""
        actor = self.actors[process]
        ray = self.ray
        pid = ray.get(actor.start.remote(args_env, msgspec.json.encode(args).decode(), keep))
        node, _ = ray.get(actor.node.remote())
        return RayProcess(ray, actor, int(pid), node)

    def close(self) -> None:
        self.closed = True  # a `locate` still asking gives up
        for actor in self.actors.values():
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                log.debug("a stage actor was already gone")
        try:
            self._remove(self.pg)
        except Exception:
            log.debug("the placement group was already gone")
        if self._owns_ray:
            self.ray.shutdown()
