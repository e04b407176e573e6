"""KV pressure: callers beyond what the KV pools hold, and no running answer killed for them.

Runs the tiny model's stage processes (configs/tiny.yaml, no gateway) twice in one run: with the
thinker's and the talker's KV pools sized for about `--answers` (8) whole answers, and with the
pools as configured (room for all: the baseline). `--callers` (24) requests arrive at random
over `--arrive-s` (10 s), each asking for a long spoken answer (`--max-tokens` tokens; the random
weights never stop on their own), and each stream is read to its end. A stream that fails after
its first output is a running answer killed; one that fails before it was refused (it waited
`admit_timeout_s` for blocks, or could never fit); the rest complete.

It prints both runs, and with `--json PATH` writes the tight pool's:

    {"answers_started", "answers_completed", "running_answers_killed", "refused",
     "waited_ms_p99", "evictions"}

`waited_ms_p99`: the 99th percentile over answers of the submit -> first output time beyond the
baseline run's median (the time spent waiting for blocks, not computing). `evictions` and
`preemptions`: kept sessions given up and requests recomputed, summed over the thinker and the
talker. Target: `running_answers_killed` = 0 and every admitted answer completes.

    python benchmarks/kv_pressure.py [--callers 24] [--answers 8] [--arrive-s 10]
        [--max-tokens 96] [--seed 0] [--no-baseline] [--json PATH]

`--no-baseline` runs the tight pools alone (the smoke test): `waited_ms_p99` is then measured
from that run's own median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.concurrency import request  # noqa: E402
from realtime_omni.errors import OmniError  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

BLOCK_TOKENS = 16
KV_STAGES = ("thinker", "talker_ar")
# The tiny model's prompt for `concurrency.request` (a 1 s clip and a line of text) is under
# this many tokens in the thinker and in the talker: the pools are sized on it.
PROMPT_TOKENS = 64


def config(pool_tokens: int | None) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    for stage in KV_STAGES:
        params = data["stages"][stage].setdefault("params", {})
        if pool_tokens is not None:
            params["kv_cache_tokens"] = pool_tokens
        data["stages"][stage]["max_batch"] = 32  # rows are not the bound here: blocks are
    data.setdefault("runtime", {})["max_requests"] = 64
    return data


async def caller(coord: Coordinator, payload: dict[str, Any], delay_s: float) -> dict[str, Any]:
    await asyncio.sleep(delay_s)
    t0 = time.monotonic()
    first: float | None = None
    outcome = "completed"
    why: str | None = None
    try:
        async for _ in await coord.submit(payload):
            first = first if first is not None else time.monotonic()
    except OmniError as e:
        outcome, why = ("killed" if first is not None else "refused"), str(e)[:200]
    first_ms = None if first is None else (first - t0) * 1e3
    return {"outcome": outcome, "why": why, "first_ms": first_ms}


async def run(pool_tokens: int | None, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    delays = sorted(rng.uniform(0, args.arrive_s) for _ in range(args.callers))
    async with Coordinator(parse_config(config(pool_tokens))) as coord:
        await (await coord.submit(request("tiny", 4, 0))).collect()  # warm up every edge
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(caller(coord, request("tiny", args.max_tokens, i), d) for i, d in enumerate(delays))
        )
        wall_s = time.monotonic() - t0
        kv = [st.kv[s] for st in (await coord.stats()).values() for s in st.kv]
    firsts = [r["first_ms"] for r in results if r["outcome"] == "completed"]
    return {
        "pool_tokens": pool_tokens,
        "answers_started": sum(r["first_ms"] is not None for r in results),
        "answers_completed": sum(r["outcome"] == "completed" for r in results),
        "running_answers_killed": sum(r["outcome"] == "killed" for r in results),
        "refused": sum(r["outcome"] == "refused" for r in results),
        "first_token_ms": sorted(firsts),
        "evictions": sum(k[2] for k in kv),
        "preemptions": sum(k[3] for k in kv),
        "wall_s": wall_s,
        "errors": sorted({r["why"] for r in results if r["why"]}),
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=24)
    parser.add_argument("--answers", type=int, default=8, help="whole answers the pools hold")
    parser.add_argument("--arrive-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="the tight pools alone")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # A whole answer: its prompt and its tokens (the talker's frames: as many, plus its end).
    per_answer = BLOCK_TOKENS * math.ceil((PROMPT_TOKENS + 2 * args.max_tokens) / BLOCK_TOKENS)
    tight_tokens = args.answers * per_answer
    tight = asyncio.run(run(tight_tokens, args))
    baseline = tight if args.no_baseline else asyncio.run(run(None, args))
    base_p50 = statistics.median(baseline["first_token_ms"] or [0.0])
    for r in {id(baseline): baseline, id(tight): tight}.values():
        r["first_token_ms_p50"] = statistics.median(r["first_token_ms"] or [0.0])
        r["waited_ms_p99"] = max(0.0, pct(r.pop("first_token_ms"), 0.99) - base_p50)
    print(
        f"{args.callers} callers over {args.arrive_s:.0f} s, {args.max_tokens}-token spoken "
        f"answers; tiny model, stage processes on this machine"
    )
    head = ("pool", "started", "completed", "killed", "refused", "first p50 ms",
            "waited p99 ms", "evictions", "preemptions", "wall s")  # fmt: skip
    print("  ".join(f"{h:>13}" for h in head))
    runs = [] if args.no_baseline else [("as configured", baseline)]
    for name, r in [*runs, (f"{tight_tokens} tok", tight)]:
        cells = [name, r["answers_started"], r["answers_completed"], r["running_answers_killed"],
                 r["refused"], f"{r['first_token_ms_p50']:.0f}", f"{r['waited_ms_p99']:.0f}",
                 r["evictions"], r["preemptions"], f"{r['wall_s']:.1f}"]  # fmt: skip
        print("  ".join(f"{c:>13}" for c in cells))
        for why in r["errors"]:
            print(f"    error: {why}")
    admitted = tight["answers_started"]
    ok = tight["running_answers_killed"] == 0 and tight["answers_completed"] == admitted
    print(f"target: no running answer killed, every admitted answer completes: {ok}")
    if args.json:
        keys = ("answers_started", "answers_completed", "running_answers_killed", "refused",
                "waited_ms_p99", "evictions")  # fmt: skip
        args.json.write_text(json.dumps({k: tight[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
