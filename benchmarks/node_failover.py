"""A Ray node lost: the node holding the talker killed, to the next call served.

A local Ray cluster (`ray.cluster_utils.Cluster` on loopback addresses, as
tests/integration/test_ray.py builds one): a head node, where this process (the server) and the
front stages run, and three nodes at addresses of their own that can each hold one `talker_ar`
and one `code2wav` process (custom resources `talker` and `code2wav`); the simulated Qwen3-Omni
graph at its published costs, through the real stage processes (no gateway). After a warm-up
call, a call is in flight on `talker_ar#0` when its node is killed (its raylet and every process
on it SIGKILLed; `--fault freeze` SIGSTOPs them instead: a machine that stops answering). From
then on a call is made again and again (one that meets the dead stage fails with StageDied and
is retried) until one gives audio. In the same run, one Ray cluster per health check:

    before   one replica of each talker-side group; Ray's default health check
    replica  a standby replica of each on another node; Ray's default health check
    health   one replica; Ray's health check for real time (RAY_HEALTH) and
             runtime.heartbeat_timeout_s 2
    now      a standby replica, and that health check and heartbeat timeout

It reports kill -> the call in flight failed, kill -> the next call's first audio and kill ->
every replica up again (Ray restarted what was on the node on the third node), medians over the
rounds; after each round a new node takes the dead one's place.

    python benchmarks/node_failover.py [--rounds 3] [--fault kill|freeze]
        [--setups before,replica,health,now] [--json PATH]

Target (issue 31): the next call within 5 s of the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Every node, the driver and the workers on loopback addresses (see tests/integration/test_ray.py)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from realtime_omni.errors import RequestError, StageDied  # noqa: E402
from realtime_omni.pipeline.config import PipelineConfig, parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402
from tests.conftest import free_port_block  # noqa: E402

# What docs/deployment.md gives the head node (`ray start --head`) for a real-time service: a
# node whose raylet is gone is declared dead after 3 failed checks a second apart (about 3 s),
# one that stops answering after 3 checks that time out (about 6 s); Ray's default is 5 checks
# 3 s apart, each waiting up to 10 s.
RAY_HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
SETUPS = {  # name -> (talker-side replicas, real-time health check)
    "before": (1, False),
    "replica": (2, False),
    "health": (1, True),
    "now": (2, True),
}
TALKER_SIDE = {"talker_ar": "talker", "code2wav": "code2wav"}  # stage -> its node resource
TALKER_NODE = {"num_cpus": 1, "resources": {"talker": 1, "code2wav": 1}}


def config(replicas: int, fast: bool) -> PipelineConfig:
    data = yaml.safe_load((ROOT / "configs/simulated-qwen3-omni.yaml").read_text())
    for name, st in data["stages"].items():
        if name in TALKER_SIDE:
            st |= {"replicas": replicas, "resources": {TALKER_SIDE[name]: 1}}
        else:
            st["resources"] = {"head": 1}
    data["runtime"] = {"placement": "ray", "ready_timeout_s": 120,
                       "heartbeat_timeout_s": 2.0 if fast else 5.0,
                       "base_port": free_port_block(len(data["stages"]) + 4)}  # fmt: skip
    return parse_config(data)


def start_cluster(fast: bool) -> tuple[Cluster, dict[str, Any]]:
    """The head (Ray's GCS, whose health check decides when a node is dead, reads the
    environment it starts with) and three talker nodes, by node id."""
    saved = dict(os.environ)
    if fast:
        os.environ.update(RAY_HEALTH)
    try:
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
            "resources": {"head": 16}})  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved)
    nodes = [c.add_node(**TALKER_NODE, node_ip_address=f"127.0.0.{i}") for i in (2, 3, 4)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, _node_ip_address="127.0.0.1")
    return c, {n.node_id: n for n in nodes}


def fail_node(c: Cluster, node: Any, fault: str) -> list[psutil.Process]:
    """Kill the node (its raylet and what runs under it: SIGKILL, no goodbye to the GCS), or
    freeze it (SIGSTOP): then its processes, to be killed after the round."""
    if fault == "kill":
        c.remove_node(node, allow_graceful=False)
        return []
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    procs = [raylet, *raylet.children(recursive=True)]
    procs += [psutil.Process(p.process.pid) for kind, ps in node.all_processes.items()
              for p in ps if kind != "raylet"]  # fmt: skip
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    return procs


async def call(coord: Coordinator, max_tokens: int = 6) -> float | None:
    """One call to its end; when its audio started (its first code2wav output), None if it
    failed."""
    first = None
    try:
        async for out in await coord.submit({"max_tokens": max_tokens}):
            if out.stage == "code2wav" and first is None:
                first = time.monotonic()
    except (RequestError, StageDied):
        return None
    return first


async def until_ready(coord: Coordinator, limit_s: float = 180.0) -> None:
    """Until every stage process is up again; an error if one cannot be (its actor could not
    start it) or after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while coord.degraded:  # not `ready`: that holds while a replica serves for the lost one
        if coord.supervisor.broken or time.monotonic() > deadline:
            why = coord.supervisor.broken or "too slow"
            raise RuntimeError(f"the pipeline did not come back: {why}")
        await asyncio.sleep(0.05)


async def ended(coord: Coordinator, max_tokens: int) -> float:
    """A call to its end, failed or not; when it ended."""
    await call(coord, max_tokens)
    return time.monotonic()


async def one_round(coord: Coordinator, c: Cluster, nodes: dict[str, Any], fault: str) -> dict:
    await until_ready(coord)
    assert await call(coord), "the warm-up call gave no audio"
    while coord.in_flight:  # its last StageDone
        await asyncio.sleep(0.01)
    assert coord.supervisor.ray is not None
    victim = nodes.pop(coord.supervisor.ray.where["talker_ar#0"][0])
    # A long call in flight on each replica (the least busy replica takes a call, #0 of equals).
    # So the dead one is no busier than the others, and the first call after the kill goes to
    # it: the worst case, served only once the coordinator has seen the death.
    flights = []
    for _ in range(coord.graph.groups["talker_ar"].replicas):
        flights.append(asyncio.ensure_future(ended(coord, 80)))
        await asyncio.sleep(0.05)  # submitted, so the next one counts it
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    frozen = await asyncio.to_thread(fail_node, c, victim, fault)
    while (served := await call(coord)) is None:
        if coord.supervisor.broken:
            raise RuntimeError(f"the pipeline did not come back: {coord.supervisor.broken}")
        await asyncio.sleep(0.01)
    failed = await flights[0]
    await asyncio.gather(*flights)
    await until_ready(coord)
    back = time.monotonic()
    if frozen:
        await asyncio.to_thread(c.remove_node, victim, False)
        for p in frozen:
            if p.is_running():
                p.kill()
    # on the loop's thread: Ray's Node sets signal handlers (nothing is measured now)
    new = c.add_node(**TALKER_NODE, node_ip_address=victim.node_ip_address)
    nodes[new.node_id] = new
    return {"in_flight_failed_ms": (failed - t0) * 1e3, "next_call_ms": (served - t0) * 1e3,
            "back_ms": (back - t0) * 1e3}  # fmt: skip


async def measure(setup: str, c: Cluster, nodes: dict[str, Any], args: Any) -> dict:
    replicas, fast = SETUPS[setup]
    rounds = []
    async with Coordinator(config(replicas, fast)) as coord:
        for _ in range(args.rounds):
            rounds.append(await one_round(coord, c, nodes, args.fault))
            r = rounds[-1]
            print(f"  {setup}: in flight failed {r['in_flight_failed_ms']:.0f} ms, next call "
                  f"{r['next_call_ms']:.0f} ms, all back {r['back_ms']:.0f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip
    row: dict[str, Any] = {"setup": setup, "replicas": replicas, "ray_health": fast,
                           "rounds": rounds}  # fmt: skip
    for key in rounds[0]:
        row[f"p50_{key}"] = statistics.median(r[key] for r in rounds)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fault", choices=("kill", "freeze"), default="kill")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    setups = args.setups.split(",")
    rows = []
    for fast in (False, True):
        mine = [s for s in setups if SETUPS[s][1] == fast]
        if not mine:
            continue
        c, nodes = start_cluster(fast)
        try:
            for setup in mine:
                rows.append(asyncio.run(measure(setup, c, nodes, args)))
        finally:
            ray.shutdown()
            c.shutdown()
    print(f"node {'killed' if args.fault == 'kill' else 'frozen'}; p50 of {args.rounds} rounds:")
    print(f"{'setup':8} {'replicas':>8} {'Ray health check':>17} {'in flight failed':>17} "
          f"{'next call audio':>16} {'all back':>9}")  # fmt: skip
    for r in rows:
        health = "real time" if r["ray_health"] else "default"
        print(f"{r['setup']:8} {r['replicas']:8} {health:>17}"
              f" {r['p50_in_flight_failed_ms']:14.0f} ms {r['p50_next_call_ms']:13.0f} ms"
              f" {r['p50_back_ms']:6.0f} ms")  # fmt: skip
    for r in rows:
        verdict = "ok" if r["p50_next_call_ms"] < 5000 else "OVER"
        print(f"{r['setup']}: next call within 5 s of the node's loss: {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"fault": args.fault, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
