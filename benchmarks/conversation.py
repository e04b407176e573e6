"""Conversation: a 10-turn conversation, kept KV caches against a full prefill every turn.

Runs the tiny model through the real stage processes (no gateway) twice in the same run: once
with a `session_id` on every turn, so the thinker continues the conversation's kept cache, and
once without, so every turn prefills the whole history again (what the stages did before).
Turns alternate a spoken question (a 1 s chirp) and a typed one; each turn's prompt holds the
whole conversation so far, the assistant's answers as they were generated, and turn 5 is cut by
a barge-in after 3 tokens (its answer stays in the history as far as it was heard). Per turn it
reports the prompt tokens the thinker prefilled, those it took from the kept cache, and the time
from submit to the first audio.

    python benchmarks/conversation.py [--turns 10] [--max-tokens 12] [--json PATH]

Target (DESIGN.md): with kept caches, turn 10's first audio is no slower than turn 1's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

BARGE_IN_TURN = 5  # 1-based
SYSTEM = {"role": "system", "content": "You are a helpful voice assistant."}


def chirp(seconds: float = 1.0, sr: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)


async def one_turn(
    coord: Coordinator, payload: dict[str, Any], cut_after: int | None
) -> dict[str, Any]:
    t0 = time.monotonic()
    stream = await coord.submit(payload)
    first_audio = None
    texts: list[str] = []
    first: dict[str, Any] = {}
    async for out in stream:
        d = out.data
        if "pcm" in d and first_audio is None:
            first_audio = (time.monotonic() - t0) * 1e3
        if "text" in d and "token_id" in d:
            first = first or d
            texts.append(d["text"])
            if cut_after is not None and len(texts) >= cut_after:
                await coord.abort(stream.request_id)  # the person talked over the answer
                break
    return {
        "text": "".join(texts),
        "first_audio_ms": first_audio,
        "prefill_tokens": int(first.get("prefill_tokens", 0)),
        "cached_tokens": int(first.get("cached_tokens", 0)),
    }


async def conversation(keep: bool, turns: int, max_tokens: int) -> list[dict[str, Any]]:
    data = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    # The whole history rides in each turn, as the gateway sends it (it sizes this edge so too).
    data["edges"].append({"src": "client", "dst": "preprocessing", "slot_bytes": 4 << 20})
    rows = []
    async with Coordinator(parse_config(data)) as coord:
        # Warm up outside the conversation (first calls of every kernel).
        warm = {"messages": [SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 2}
        await (await coord.submit({**warm, "talker_max_tokens": 2})).collect()
        history: list[dict[str, Any]] = [SYSTEM]
        arrays: dict[str, np.ndarray] = {}
        for i in range(1, turns + 1):
            if i % 2:
                name = f"audio{i}"
                arrays[name] = chirp()
                content: Any = [{"type": "audio", "audio": name}, {"type": "text", "text": "?"}]
            else:
                content = f"And what about point {i}?"
            history.append({"role": "user", "content": content})
            payload = {
                "messages": list(history),
                **arrays,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "talker_temperature": 0.0,
                "talker_max_tokens": 2 * max_tokens,
            }
            if keep:
                payload["session_id"] = "bench"
            cut = 3 if i == BARGE_IN_TURN else None
            row = await one_turn(coord, payload, cut)
            history.append({"role": "assistant", "content": row.pop("text")})
            rows.append({"turn": i, "kept": keep, "barge_in": cut is not None, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for keep in (True, False):
        print(f"measuring {'kept caches' if keep else 'full prefill'} ...", file=sys.stderr)
        rows += asyncio.run(conversation(keep, args.turns, args.max_tokens))
    by = {(r["kept"], r["turn"]): r for r in rows}
    print(f"{'turn':>4}  {'kept: prefill':>13} {'cached':>7} {'first audio':>12}   "
          f"{'full: prefill':>13} {'first audio':>12}")  # fmt: skip
    for t in range(1, args.turns + 1):
        k, f = by[(True, t)], by[(False, t)]
        mark = " (barge-in)" if k["barge_in"] else ""

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.0f}ms"

        print(
            f"{t:>4}  {k['prefill_tokens']:>13} {k['cached_tokens']:>7} "
            f"{ms(k['first_audio_ms']):>12}   {f['prefill_tokens']:>13} "
            f"{ms(f['first_audio_ms']):>12}{mark}"
        )
    last, first = by[(True, args.turns)], by[(True, 1)]
    if last["first_audio_ms"] and first["first_audio_ms"]:
        ratio = last["first_audio_ms"] / first["first_audio_ms"]
        verdict = "ok" if ratio <= 1.0 else "SLOWER"
        print(f"kept caches: turn {args.turns} / turn 1 first audio = {ratio:.2f} ({verdict})")
        full = by[(False, args.turns)]["first_audio_ms"]
        if full:
            print(f"turn {args.turns}: full prefill / kept first audio = "
                  f"{full / last['first_audio_ms']:.2f}x")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
