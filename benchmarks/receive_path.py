"""The server's WebRTC receive path: from an RTP packet's arrival to its audio in the session.

A caller and the server's side of a call in this process, over loopback UDP (aiortc both ends,
`tests/integration/rtp_link.py`): the caller sends a tone in 20 ms Opus packets, paced in real
time, and the server hears it through `webrtc_input.listen`, as the gateway does, with aiortc's
own jitter buffer (`webrtc_reorder_packets: null`, the baseline) and with the packets taken as
they arrive (`2`, the default), alternated in one run. For every packet: the delay from its
arrival (after SRTP, before aiortc's receiver) to the `Session.push_audio` call with its audio,
and to the end of the 32 ms VAD window that audio ends in (the VAD judges whole windows). Per
call: packets whose audio never reached the session beyond those the link dropped (the last
`TAIL_FRAMES` are left out of every figure: a buffer may still hold them when the call ends).

Two links: `clean`, and `lossy` (2 % of packets dropped, 1 % overtaken by the next one, seeded).

    python benchmarks/receive_path.py [--rounds N] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.rtp_link import Call, call  # noqa: E402

TAIL_FRAMES = 25  # not counted: aiortc's buffer holds up to 15 packets after a loss
VAD_WINDOW = 512  # samples at 16 kHz: 32 ms
PATHS = {"aiortc jitter buffer": None, "as they arrive": 2}
LINKS = {"clean": (0.0, 0.0), "lossy": (0.02, 0.01)}  # (dropped, overtaken)
BUDGET_MS = 5.0  # the server's own receive path: well under one 20 ms frame


async def one_call(frames: int, wait: int | None, drop: set[int], late: set[int]) -> dict[str, Any]:
    async with call(frames, wait, drop, late) as c:
        await asyncio.wait_for(c.sender.done.wait(), frames * 0.02 + 20)
        await asyncio.sleep(0.5)
        return measure(c, frames - TAIL_FRAMES, drop)


def measure(c: Call, counted: int, drop: set[int]) -> dict[str, Any]:
    push, window, lost = [], [], 0
    for i in range(1, counted):
        if i in drop:
            continue
        if i not in c.heard.heard:
            lost += 1
            continue
        at, samples = c.heard.heard[i]
        full = c.heard.time_when(-(-samples // VAD_WINDOW) * VAD_WINDOW)
        push.append((at - c.link.arrived[i]) * 1000)
        if full is not None:
            window.append((full - c.link.arrived[i]) * 1000)
    return {"push_ms": push, "window_ms": window, "lost": lost}


def link_faults(
    frames: int, dropped: float, overtaken: float, seed: int
) -> tuple[set[int], set[int]]:
    """Packets to drop and to deliver one place late (never packet 0: it names the stream)."""
    rng = random.Random(seed)
    drop = {i for i in range(1, frames) if rng.random() < dropped}
    late = {
        i
        for i in range(1, frames - 1)
        if i not in drop and i + 1 not in drop and rng.random() < overtaken
    }
    return drop, late


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3, help="calls per path and link, alternated")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each call")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    frames = int(args.seconds * 50) + TAIL_FRAMES
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for link, (dropped, overtaken) in LINKS.items():
            drop, late = link_faults(frames, dropped, overtaken, seed=r)
            paths = list(PATHS.items())
            for name, wait in paths if r % 2 == 0 else paths[::-1]:  # neither always first
                got = asyncio.run(one_call(frames, wait, drop, late))
                acc = results.setdefault((link, name), {"push": [], "window": [], "lost": []})
                acc["push"] += got["push_ms"]
                acc["window"] += got["window_ms"]
                acc["lost"].append(got["lost"])
    rows = [
        {
            "link": link,
            "path": name,
            "packets": len(acc["push"]),
            "to_push_audio_ms_p50": pct(acc["push"], 50),
            "to_push_audio_ms_p90": pct(acc["push"], 90),
            "to_vad_window_ms_p50": pct(acc["window"], 50),
            "frames_lost_beyond_dropped_per_call": statistics.median(acc["lost"]),
        }
        for (link, name), acc in sorted(results.items())
    ]
    print(
        f"RTP packet arrival -> Session.push_audio, {args.rounds} calls of {args.seconds:g} s a "
        "row (lossy: 2 % dropped, 1 % overtaken by the next packet)"
    )
    head = ("link", "path", "packets", "push p50", "push p90", "window p50", "lost/call")
    print("{:7} {:22} {:>7} {:>9} {:>9} {:>11} {:>9}".format(*head))
    for row in rows:
        print(
            "{link:7} {path:22} {packets:>7} {to_push_audio_ms_p50:>7.1f}ms "
            "{to_push_audio_ms_p90:>7.1f}ms {to_vad_window_ms_p50:>9.1f}ms "
            "{frames_lost_beyond_dropped_per_call:>9g}".format(**row)
        )
    ours = [r for r in rows if r["path"] == "as they arrive"]
    ok = all(
        r["to_push_audio_ms_p50"] <= BUDGET_MS and r["frames_lost_beyond_dropped_per_call"] == 0
        for r in ours
    )
    print(
        f"verdict: {'PASS' if ok else 'FAIL'} (as they arrive: push p50 <= {BUDGET_MS:g} ms, "
        "no frame lost beyond the dropped, on both links)"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
