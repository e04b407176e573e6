"""KV memory held and read per decode step at the real thinker sizes: blocks against rows.

Builds the thinker's KV cache at Qwen3-Omni's sizes (48 layers, 4 key/value heads of 128,
32 query heads, bfloat16: 96 KiB a token) for 32 rows, fills them to each case's lengths and
runs one decode step's attention through every layer of the real code path
(`models/qwen3_omni/cache.py`), then reports:

- bytes held: the blocks the rows hold (the pool's own size is configured apart);
- bytes read per decode step: the key/value slots the step's attention reads, padding included;
- each against its ideal, `tokens x bytes per token`, in the same run;
- beside them, the cache before blocks (`SlotCache`, one capacity for every row, doubled from
  256 when any row outgrew it; a decode step read every row up to the longest), by its rule.

Cases: 31 rows of 500 tokens and one of 9,000; the same with one of 30,000. On `--device meta`
(the default) nothing is allocated and the attention runs on shapes only; `--device cuda:0` (or
cpu) allocates the pool for real and also times the step's attention (median of `--steps`).
Target: held and read within 1.25x the ideal in every case. `--json` writes `{"rows": [{"case",
"tokens", "bytes_held", "bytes_ideal", "read_per_step", "read_ideal"}]}` (bytes), one row per
case with blocks and one per case for the cache before them (`case` ending "rows-before-blocks").

    python benchmarks/kv_memory.py [--device meta|cpu|cuda:0] [--steps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.models.qwen3_omni.cache import BLOCK_TOKENS, BlockCache  # noqa: E402

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 48, 4, 32, 128  # the published thinker
ROWS = 32
CASES = {"31x500+9000": [500] * 31 + [9000], "31x500+30000": [500] * 31 + [30000]}


def slot_rule(lens: list[int], per_token: int) -> tuple[int, int]:
    """(held, read per decode step) of the cache before blocks: every row had the capacity of
    the longest (256 doubled until the longest fitted) and a step read every row to it."""
    capacity = 256
    while capacity < max(lens) + 1:
        capacity *= 2
    return ROWS * capacity * per_token, ROWS * (max(lens) + 1) * per_token


def run_case(lens: list[int], device: str, steps: int) -> dict[str, Any]:
    dtype = torch.bfloat16
    blocks = sum(-(-(n + 1) // BLOCK_TOKENS) for n in lens) + 1
    cache = BlockCache(LAYERS, KV_HEADS, HEAD_DIM, ROWS, blocks, dtype, device)
    rows = [cache.alloc() for _ in lens]
    for row, n in zip(rows, lens, strict=True):
        assert cache.reserve(row, n + 1)  # its tokens and the step's new one
        cache.lens[row] = n
    per_token = cache.bytes_per_token
    window = cache.decode(rows)
    query = torch.zeros(len(rows), HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
    new = torch.zeros(len(rows), KV_HEADS, 1, HEAD_DIM, dtype=dtype, device=device)
    times = []
    for _ in range(steps if device != "meta" else 1):
        start = time.perf_counter()
        for layer in range(LAYERS):
            window.update(new, new, layer)
            window.attend(query, layer, HEAD_DIM**-0.5)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    tokens = sum(lens)
    slot_held, slot_read = slot_rule(lens, per_token)
    row = {
        "tokens": tokens,
        "bytes_held": cache.bytes_held(),
        "bytes_ideal": tokens * per_token,
        # slots_read is per layer in token slots; per_token counts every layer's K and V.
        "read_per_step": window.slots_read() * per_token,
        "read_ideal": (tokens + len(lens)) * per_token,
        "slot_bytes_held": slot_held,
        "slot_read_per_step": slot_read,
        "attention_groups": len(window.groups),
    }
    if device != "meta":
        row["attention_ms"] = statistics.median(times)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="meta")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    gib = 2**30
    print(f"thinker KV at real sizes, {ROWS} rows, bf16, blocks of {BLOCK_TOKENS}: {args.device}")
    for case, lens in CASES.items():
        r = {"case": case, **run_case(lens, args.device, args.steps)}
        out.append(r)
        held, read = r["bytes_held"] / r["bytes_ideal"], r["read_per_step"] / r["read_ideal"]
        print(
            f"  {case}: {r['tokens']} tokens, ideal {r['bytes_ideal'] / gib:.2f} GiB held, "
            f"{r['read_ideal'] / gib:.3f} GiB read a step\n"
            f"    blocks: held {r['bytes_held'] / gib:.2f} GiB ({held:.3f}x), "
            f"read {r['read_per_step'] / gib:.3f} GiB ({read:.3f}x) "
            f"in {r['attention_groups']} attention calls a layer"
            + (f", attention {r['attention_ms']:.1f} ms a step" if "attention_ms" in r else "")
            + f"\n    rows before: held {r['slot_bytes_held'] / gib:.2f} GiB "
            f"({r['slot_bytes_held'] / r['bytes_ideal']:.1f}x), "
            f"read {r['slot_read_per_step'] / gib:.3f} GiB "
            f"({r['slot_read_per_step'] / r['read_ideal']:.1f}x)"
        )
    ok = all(
        r["bytes_held"] <= 1.25 * r["bytes_ideal"] and r["read_per_step"] <= 1.25 * r["read_ideal"]
        for r in out
    )
    print(f"target held and read <= 1.25x ideal: {'met' if ok else 'MISSED'}")
    if args.json:  # the shape issue 30 names; the cache before blocks as rows of its own
        keys = ("case", "tokens", "bytes_held", "bytes_ideal", "read_per_step", "read_ideal")
        rows = [{k: r[k] for k in keys} for r in out]
        rows += [
            {**{k: r[k] for k in keys}, "case": f"{r['case']} rows-before-blocks",
             "bytes_held": r["slot_bytes_held"], "read_per_step": r["slot_read_per_step"]}
            for r in out
        ]  # fmt: skip
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
