"""Concurrency: many streaming requests through the pipeline at once, batched against unbatched.

For each config (the simulated Qwen3-Omni timings given its fixed image+audio request, or with
simulated-audio a 3 s spoken turn alone; the tiny real model on this CPU) and each
number of streams N, starts N streaming requests `--stagger-ms` apart through the real stage
processes (no gateway), reads every output as it comes, and reports, for the config as it is
(every stage batching up to its `max_batch`) and with `max_batch: 1` on every stage (one request
per forward, the baseline) in the same run:

- frames_per_s: the audio frames (80 ms each) of all streams over the wall time from the first
  submit to the last output;
- worst_rtf: the slowest stream's real-time factor, the time from its submit to its last audio
  over the duration of that audio (< 1: faster than real time);
- first_audio_ms p50 and p99 over the streams;
- worst_stall_ms: the most silence any stream's listener heard after its first audio, waiting
  for the next chunk (a listener who starts playing at the first audio and keeps no reserve);
- stages: per stage, its steps in the run and the shares of the run's wall time it spent
  stepping and on a CPU (from the processes' step logs): where the cores went, and whether a
  stage waited for one.

N = 1 runs `ONE_STREAM_RUNS` requests one after another, so that the one-stream p50 the
first-audio target divides by is a median, not one request's figure.
A count may repeat (`--streams 1,16,16`): the same server meets that burst again, with the
kernels for the first one's shapes built; every row goes to the JSON, the verdict reads the last.

    python benchmarks/concurrency.py [--configs tiny,simulated,simulated-audio]
        [--streams 1,4,16,64] [--max-tokens 16] [--stagger-ms 50] [--device cuda:0] [--json PATH]

Targets (tiny config, 16 streams, this 2-core machine): batched frames/s >= 4 x unbatched,
worst_rtf < 1, first audio p99 <= 2 x the one-stream p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

CONFIGS = {
    "tiny": ROOT / "configs/tiny.yaml",
    "simulated": ROOT / "configs/simulated-qwen3-omni.yaml",
    # The same simulated stages given a spoken turn with no image (a call without a camera):
    # the path the report's audio figures measure, charged by what the turn holds.
    "simulated-audio": ROOT / "configs/simulated-qwen3-omni.yaml",
}
TURN_S = 3.0  # the spoken turn of a conversation request
FRAME_S = 0.08
ONE_STREAM_RUNS = 5  # the one-stream row: this many requests, one after another
SAMPLES_PER_FRAME = 1920


def load(name: str, batched: bool, device: str = "cpu") -> dict[str, Any]:
    data = yaml.safe_load(CONFIGS[name].read_text())
    if device != "cpu":  # the model stages on the device, in its default dtype
        for stage in ("image_encoder", "audio_encoder", "thinker", "talker_ar", "code2wav"):
            data["stages"][stage]["device"] = device
        data.get("model", {}).pop("dtype", None)
    if not batched:
        for stage in data["stages"].values():
            stage["max_batch"] = 1
    return data


def request(name: str, max_tokens: int, seed: int) -> dict[str, Any]:
    """The simulated config's fixed request (a spoken turn with an image), or a conversation:
    a second of a chirp for the tiny model, `TURN_S` of it for simulated-audio, there each
    stream's own (a little noise by its seed: no stream finds another's windows encoded)."""
    if name == "simulated":
        return {"max_tokens": max_tokens}
    seconds = TURN_S if name == "simulated-audio" else 1.0
    t = np.arange(int(16000 * seconds)) / 16000
    audio = (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)
    if name == "simulated-audio":
        audio += np.random.default_rng(seed).normal(0, 1e-3, audio.size).astype(np.float32)
    content = [{"type": "audio", "audio": "audio0"}, {"type": "text", "text": "Answer briefly."}]
    return {
        "messages": [{"role": "user", "content": content}],
        "audio0": audio,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "talker_seed": seed,
        "talker_max_tokens": 2 * max_tokens,  # random weights never stop on their own
    }


async def one_stream(coord: Coordinator, payload: dict[str, Any]) -> dict[str, float]:
    t0 = time.monotonic()
    first = last = None
    samples = 0
    play_end = stall = 0.0  # a listener who starts at the first audio and never waits ahead
    async for out in await coord.submit(payload):
        if "pcm" in out.data:
            now = time.monotonic()
            first = first if first is not None else now
            last = now
            n = int(np.asarray(out.data["pcm"]).size)
            samples += n
            if now > play_end > 0:
                stall += now - play_end  # the listener heard silence until this chunk came
            play_end = max(play_end, now) + n / (SAMPLES_PER_FRAME / FRAME_S)
    if first is None or last is None:
        raise RuntimeError("a stream ended without audio")
    audio_s = samples / (SAMPLES_PER_FRAME / FRAME_S)
    return {
        "start": t0,
        "end": last,
        "first_ms": (first - t0) * 1e3,
        "frames": samples / SAMPLES_PER_FRAME,
        "rtf": (last - t0) / max(audio_s, 1e-9),
        "stall_ms": stall * 1e3,
    }


async def measure(
    coord: Coordinator, name: str, streams: int, max_tokens: int, stagger_s: float
) -> dict[str, Any]:
    async def started(i: int) -> dict[str, float]:
        await asyncio.sleep(i * stagger_s)
        return await one_stream(coord, request(name, max_tokens, i))

    if streams == 1:  # one stream at a time, ONE_STREAM_RUNS times: a p50 of more than one
        got = [
            await one_stream(coord, request(name, max_tokens, i)) for i in range(ONE_STREAM_RUNS)
        ]
        wall = sum(g["end"] - g["start"] for g in got)
    else:
        got = await asyncio.gather(*(started(i) for i in range(streams)))
        wall = max(g["end"] for g in got) - min(g["start"] for g in got)
    firsts = sorted(g["first_ms"] for g in got)
    return {
        "streams": streams,
        "frames_per_s": sum(g["frames"] for g in got) / wall,
        "worst_rtf": max(g["rtf"] for g in got),
        "worst_stall_ms": max(g["stall_ms"] for g in got),
        "first_audio_ms_p50": statistics.median(firsts),
        "first_audio_ms_p99": float(np.percentile(firsts, 99)),
    }


async def run(
    name: str, batched: bool, counts: list[int], max_tokens: int, stagger_s: float, device: str
) -> list[dict[str, Any]]:
    rows = []
    async with Coordinator(parse_config(load(name, batched, device))) as coord:
        await one_stream(coord, request(name, max_tokens, 0))  # warm up
        for n in counts:
            print(f"  {name} {'batched' if batched else 'max_batch 1'}: {n} streams", end="",
                  file=sys.stderr, flush=True)  # fmt: skip
            t = time.monotonic()
            row = await measure(coord, name, n, max_tokens, stagger_s)
            end = time.monotonic()
            print(f" ({end - t:.0f} s)", file=sys.stderr, flush=True)
            row["stages"] = stage_time(await coord.stats(), t, end)
            rows.append({"config": name, "batched": batched, **row})
    return rows


def stage_time(stats: dict[str, Any], start: float, end: float) -> dict[str, dict[str, float]]:
    """Per stage, over the steps begun in [start, end): their number, and the shares of the
    wall time it spent stepping (`busy`) and on a CPU (`cpu`, the stepping thread's), its
    replicas' summed. A step whose `cpu` falls short of its `busy` waited for a core: the cores
    were oversubscribed. (The simulated executors sleep through their steps: `cpu` near 0.)"""
    span = max(end - start, 1e-9)
    out: dict[str, dict[str, float]] = {}
    for st in stats.values():  # a stage's replicas add up
        for stage, log in st.steps.items():
            cpu = st.step_cpu.get(stage, [0.0] * len(log))
            took = [(wall, c) for (t, wall), c in zip(log, cpu, strict=True) if start <= t < end]
            acc = out.setdefault(stage, {"steps": 0, "busy": 0.0, "cpu": 0.0})
            acc["steps"] += len(took)
            acc["busy"] += sum(w for w, _ in took) / span
            acc["cpu"] += sum(c for _, c in took) / span
    return out


def report(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'config':16} {'batched':>8} {'streams':>7} {'frames/s':>9} {'worst rtf':>9} "
        f"{'first p50':>10} {'first p99':>10} {'stall':>8}"
    )
    for r in rows:
        print(
            f"{r['config']:16} {'yes' if r['batched'] else 'no':>8} {r['streams']:>7} "
            f"{r['frames_per_s']:>9.1f} {r['worst_rtf']:>9.2f} "
            f"{r['first_audio_ms_p50']:>8.0f}ms {r['first_audio_ms_p99']:>8.0f}ms "
            f"{r['worst_stall_ms']:>6.0f}ms"
        )
    print("stage time, as shares of each run's wall time: stepping / on a CPU (1% and over)")
    for r in rows:
        busiest = sorted(r["stages"].items(), key=lambda kv: -kv[1]["busy"])
        shares = "  ".join(
            f"{stage} {t['busy']:.2f}/{t['cpu']:.2f}" for stage, t in busiest if t["busy"] >= 0.01
        )
        kind = "batched" if r["batched"] else "max_batch 1"
        print(f"  {r['config']} {kind} {r['streams']}: {shares}")
    by = {(r["config"], r["batched"], r["streams"]): r for r in rows}
    for (config, batched, n), r in by.items():
        base = by.get((config, False, n))
        one = by.get((config, True, 1))
        if not batched or base is None or one is None or n == 1:
            continue
        ratio = r["frames_per_s"] / base["frames_per_s"]
        p99 = r["first_audio_ms_p99"] / one["first_audio_ms_p50"]
        verdict = "ok" if ratio >= 4 and r["worst_rtf"] < 1 and p99 <= 2 else "MISS"
        print(
            f"{config} {n} streams: batched / max_batch 1 frames/s = {ratio:.1f}x (target 4x), "
            f"worst rtf {r['worst_rtf']:.2f} (target < 1), first audio p99 / one-stream p50 = "
            f"{p99:.1f} (target <= 2): {verdict}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,simulated")
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stagger-ms", type=float, default=50.0)
    parser.add_argument("--device", default="cpu", help="where the tiny model's stages run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    rows = []
    for name in args.configs.split(","):
        for batched in (True, False):
            stagger = args.stagger_ms / 1e3
            rows += asyncio.run(run(name, batched, counts, args.max_tokens, stagger, args.device))
    report(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
