"""Abort: how long until every stage acknowledged, and whether 1,000 aborted requests leak.

Runs the seven-process simulated Qwen3-Omni graph, starts requests `--concurrency` at a time,
aborts each at a random point of its life (before its first output, mid-text, mid-audio), and
reports the time `Coordinator.abort()` took (every stage acknowledged, every slot back) as p50 and
p99, next to the baseline measured in the same run: one control-plane round trip to every stage
process (a stats query), which an abort cannot beat. Then it compares free slots, shared-memory
segments and the processes' memory before and after (DESIGN.md: back to where they started).

A stage's control thread handles an abort while a model step runs (the step's outputs for the
aborted request are discarded and its executor state is dropped right after the step), so the
figure is the runtime's own: control messages, bookkeeping and the slots coming back.

    python benchmarks/abort.py [--requests 1000] [--concurrency 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from realtime_omni.pipeline.shm import list_segments

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "simulated-qwen3-omni.yaml"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def snapshot(coord: Coordinator) -> dict[str, object]:
    stats = await coord.stats()
    rss = sum(psutil.Process(coord.pid_of(p)).memory_info().rss for p in stats)
    return {
        "free_slots": sum(sum(s.free_slots.values()) for s in stats.values()),
        "total_slots": sum(sum(s.total_slots.values()) for s in stats.values()),
        "active": sum(sum(s.active_requests.values()) for s in stats.values()),
        "segments": len(list_segments(os.getpid())),
        "rss_mb": rss / 2**20,
        "coordinator_requests": coord.in_flight,
    }


async def run(requests: int, concurrency: int, seed: int, time_scale: float) -> dict[str, object]:
    rng = random.Random(seed)
    data = yaml.safe_load(CONFIG.read_text())
    for stage in data["stages"].values():
        for key in list(stage["params"]):
            if key.endswith("_ms"):
                stage["params"][key] *= time_scale
    tokens = max(200, int(200 / max(time_scale, 0.05)))  # still running when aborted
    cfg = parse_config(data)
    async with Coordinator(cfg) as coord:
        for _ in range(3):  # warm up: every edge has made its segment, every socket connected
            await (await coord.submit({"max_tokens": 8})).collect()
        rtt = []
        for _ in range(50):
            t0 = time.perf_counter()
            await coord.stats()
            rtt.append((time.perf_counter() - t0) * 1e3)
        before = await snapshot(coord)
        took: list[float] = []
        outputs_seen: list[int] = []

        async def one() -> None:
            stream = await coord.submit({"max_tokens": tokens})
            wait_s = rng.uniform(0.0, 0.6)  # 0.25 s into a request its audio has started
            seen = 0
            try:
                async with asyncio.timeout(wait_s):
                    async for _ in stream:
                        seen += 1
            except TimeoutError:
                pass
            t0 = time.perf_counter()
            await coord.abort(stream.request_id)
            took.append((time.perf_counter() - t0) * 1e3)
            outputs_seen.append(seen)

        left = requests

        async def lane() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one()

        t0 = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        wall = time.monotonic() - t0
        await asyncio.sleep(0.2)
        after = await snapshot(coord)
    return {
        "time_scale": time_scale,
        "requests": requests,
        "concurrency": concurrency,
        "wall_s": wall,
        "abort_ack_ms": {"p50": pct(took, 0.5), "p99": pct(took, 0.99), "max": max(took)},
        "baseline_stats_rtt_ms": {"p50": pct(rtt, 0.5), "p99": pct(rtt, 0.99)},
        "aborted_before_first_output": sum(1 for s in outputs_seen if s == 0),
        "median_outputs_before_abort": statistics.median(outputs_seen),
        "before": before,
        "after": after,
    }


def report(r: dict) -> None:
    a, b = r["abort_ack_ms"], r["baseline_stats_rtt_ms"]
    name = f"simulated Qwen3-Omni timings x{r['time_scale']}"
    print(
        f"\n{name}: {r['requests']} requests aborted, {r['concurrency']} at a time, "
        f"{r['wall_s']:.1f} s"
    )
    print(
        f"  abort acknowledged by every stage: p50 {a['p50']:.2f} ms  p99 {a['p99']:.2f} ms  "
        f"max {a['max']:.2f} ms" + ("   (target p99 <= 10 ms)" if not r["time_scale"] else "")
    )
    print(
        f"  baseline, one stats round trip to every stage: p50 {b['p50']:.2f} ms  "
        f"p99 {b['p99']:.2f} ms"
    )
    print(
        f"  aborted before any output: {r['aborted_before_first_output']}, "
        f"median outputs before the abort: {r['median_outputs_before_abort']}"
    )
    print(f"  {'':22}{'before':>10}{'after':>10}")
    for key in ("free_slots", "total_slots", "active", "segments", "coordinator_requests"):
        print(f"  {key:22}{r['before'][key]:>10}{r['after'][key]:>10}")
    print(
        f"  {'rss_mb (all stages)':22}{r['before']['rss_mb']:>10.1f}{r['after']['rss_mb']:>10.1f}"
    )
    leaked = any(r["before"][k] != r["after"][k] for k in ("free_slots", "active", "segments"))
    print("  leak check:", "LEAK" if leaked or r["after"]["coordinator_requests"] else "clean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="step times x this")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = []
    runs.append(asyncio.run(run(args.requests, args.concurrency, args.seed, args.time_scale)))
    report(runs[-1])
    if args.json:
        args.json.write_text(json.dumps({"runs": runs}, indent=2))


if __name__ == "__main__":
    main()
