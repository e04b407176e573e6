"""Failover: a stage process SIGKILLed, to the next call served, with and without warm spares.

The tiny model through the real stage processes (no gateway). After a warm-up request (and,
with warm spares, once the spare has loaded) the `speech` process (talker and code2wav) is
killed; from then on a request is submitted again and again (one that meets the dead process
fails with StageDied and is retried) until one gives audio. It reports the time from the kill
to that first audio, for `runtime.warm_spares: false` (the process is started and loads its
model again) and `true` (its loaded spare takes over), in the same run.

    python benchmarks/failover.py [--rounds 3] [--json PATH]

Target (issue: a stage's death costs new calls seconds, not a start-up): under 5 s with spares.
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

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.errors import StageDied  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

VICTIM = "speech#0"


def request() -> dict[str, Any]:
    t = np.arange(16000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)
    content = [{"type": "audio", "audio": "audio0"}, {"type": "text", "text": "Answer."}]
    return {"messages": [{"role": "user", "content": content}], "audio0": audio,
            "max_tokens": 4, "temperature": 0.0, "talker_max_tokens": 8}  # fmt: skip


async def first_audio(coord: Coordinator) -> bool:
    try:
        async for out in await coord.submit(request()):
            if "pcm" in out.data:
                return True
    except StageDied:
        return False
    return False


async def measure(warm: bool, rounds: int) -> list[float]:
    data = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    data.setdefault("runtime", {})["warm_spares"] = warm
    times = []
    async with Coordinator(parse_config(data)) as coord:
        await first_audio(coord)
        for _ in range(rounds):
            if warm:
                await asyncio.wait_for(coord._spare_ready[VICTIM], 120)
            pid = coord.pid_of(VICTIM)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not await first_audio(coord):
                await asyncio.sleep(0.01)
            times.append((time.monotonic() - t0) * 1e3)
            print(f"  warm_spares={warm}: {times[-1]:.0f} ms", file=sys.stderr, flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for warm in (False, True):
        times = asyncio.run(measure(warm, args.rounds))
        rows.append({"warm_spares": warm, "kill_to_audio_ms": times,
                     "p50_ms": statistics.median(times)})  # fmt: skip
    for r in rows:
        each = ", ".join(f"{t:.0f}" for t in r["kill_to_audio_ms"])
        print(f"warm_spares={r['warm_spares']!s:5}  SIGKILL -> next call's first audio: "
              f"p50 {r['p50_ms']:8.0f} ms  ({each})")  # fmt: skip
    ratio = rows[0]["p50_ms"] / rows[1]["p50_ms"]
    verdict = "ok" if rows[1]["p50_ms"] < 5000 else "OVER"
    print(f"spares make it {ratio:.0f}x sooner; target with spares < 5 s: {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
