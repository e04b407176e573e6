"""Soak: many requests with random aborts while stage processes are SIGKILLed now and then;
afterwards nothing is left behind.

The simulated Qwen3-Omni graph at `--time-scale` of its step times, through the real stage
processes (no gateway): `--requests` requests, `--concurrency` at a time, each read to its end
or aborted after a random number of outputs (`--abort-share` of them), and a random stage
process SIGKILLed every `--kill-every` requests (the coordinator restarts it). Every request
must end as completed, aborted (by us) or failed with StageDied (it was on a killed process);
any other outcome is counted as an error. Before and after, with the pipeline idle: credits
free on every edge, the coordinator's shared-memory segments, its file descriptors, threads and
RSS, and the stage processes' segments. The process set is bounded in time by `--limit-s`.

    python benchmarks/soak.py [--requests 2000] [--concurrency 16] [--kill-every 400]
        [--abort-share 0.3] [--time-scale 0.1] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.errors import RequestAborted, StageDied  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402
from realtime_omni.pipeline.shm import list_segments  # noqa: E402


async def resources(coord: Coordinator) -> dict[str, Any]:
    """What must come back: with the pipeline idle, every credit free and no request held.
    The last StageDone messages trail the outputs by a moment, and so can an acknowledgement
    between two stages (another process than the one the stats request comes from sends it),
    so this waits up to 2 s for all three: what is still out then is lost."""
    for _ in range(40):
        stats = await coord.stats()
        lent = sum(
            st.total_slots[e] - st.free_slots[e] for st in stats.values() for e in st.total_slots
        )
        lent += coord.outlet.pool.n - coord.outlet.pool.free
        held = sum(sum(st.active_requests.values()) for st in stats.values())
        if coord.in_flight == lent == held == 0:
            break
        await asyncio.sleep(0.05)
    me = psutil.Process()
    return {
        "in_flight": coord.in_flight,
        "slots_lent": lent,
        "requests_held": held,
        "segments": len(list_segments(os.getpid())),
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "rss_mb": round(me.memory_info().rss / 2**20, 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    data = yaml.safe_load((ROOT / "configs/simulated-qwen3-omni.yaml").read_text())
    for stage in data["stages"].values():
        for key in list(stage["params"]):
            if key.endswith("_ms"):
                stage["params"][key] *= args.time_scale
    outcomes = {"completed": 0, "aborted": 0, "stage_died": 0, "error": 0}
    errors: list[str] = []
    kills = 0
    async with Coordinator(parse_config(data)) as coord:
        await (await coord.submit({"max_tokens": 4})).collect()  # warm up
        before = await resources(coord)
        queue = list(range(args.requests))
        done_count = 0
        lock = asyncio.Lock()

        async def one(i: int) -> None:
            abort_after = rng.randrange(1, 30) if rng.random() < args.abort_share else None
            try:
                stream = await coord.submit({"max_tokens": rng.randrange(2, 24)})
                got = 0
                async for _ in stream:
                    got += 1
                    if abort_after is not None and got >= abort_after:
                        await coord.abort(stream.request_id)
                        outcomes["aborted"] += 1
                        return
                outcomes["completed"] += 1
            except StageDied:
                outcomes["stage_died"] += 1
            except RequestAborted:
                outcomes["aborted"] += 1
            except Exception as e:
                outcomes["error"] += 1
                errors.append(f"{type(e).__name__}: {e}")

        async def worker() -> None:
            nonlocal done_count, kills
            while queue:
                i = queue.pop()
                await one(i)
                async with lock:
                    done_count += 1
                    last = done_count >= args.requests
                    if args.kill_every and done_count % args.kill_every == 0 and not last:
                        victim = rng.choice(coord.graph.local_processes())
                        pid = coord.pid_of(victim)
                        if pid is not None:
                            os.kill(pid, signal.SIGKILL)
                            kills += 1

        t0 = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(args.concurrency))), args.limit_s
        )
        took = time.monotonic() - t0
        await asyncio.sleep(0.2)  # a last death is seen within 50 ms
        while coord.degraded:  # and its restart
            await asyncio.sleep(0.05)
        await (await coord.submit({"max_tokens": 4})).collect()  # it serves after all that
        after = await resources(coord)
    return {
        "requests": args.requests,
        "seconds": round(took, 1),
        "kills": kills,
        "outcomes": outcomes,
        "errors": errors[:10],
        "before": before,
        "after": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kill-every", type=int, default=400)
    parser.add_argument("--abort-share", type=float, default=0.3)
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    r = asyncio.run(run(args))
    print(f"{r['requests']} requests in {r['seconds']} s, {r['kills']} stage processes killed")
    print(f"outcomes: {r['outcomes']}")
    for e in r["errors"]:
        print(f"  error: {e}")
    for key in r["before"]:
        print(f"  {key:14} before {r['before'][key]!s:>8}  after {r['after'][key]!s:>8}")
    back = all(r["after"][k] == r["before"][k] for k in ("slots_lent", "requests_held",
               "segments", "in_flight"))  # fmt: skip
    fds_ok = r["after"]["fds"] <= r["before"]["fds"] + 2
    verdict = "clean" if back and fds_ok and not r["outcomes"]["error"] else "LEAK OR ERROR"
    print(f"soak: {verdict}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
