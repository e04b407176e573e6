"""code2wav's streamed convolutions over chunks of every shape: how many oneDNN kernels are
kept, and oneDNN's transposed convolutions against PyTorch's own.

oneDNN builds a kernel the first time it meets a convolution and an input shape (batch rows x
samples), and keeps the last 1,024 by default; code2wav's steps come in every shape (a step
batches the chunks that are due, 1 to 16 or more rows of 1 to 10 frames). This decodes chunks of
`--rows` x `--frames` in a shuffled order twice with the tiny model, in one fresh process per
variant (every shape is new in the first pass), the variants alternated `--rounds` times, and
prints the median time of each pass:

- `onednn-1024`: every convolution through oneDNN, its default 1,024 kernels kept;
- `onednn`: the same with the stages' `tensors.ONEDNN_KERNELS` kept;
- `native`: as the stages run: that many kept, the transposed convolutions through PyTorch's
  own kernels (`vocoder._native`).

    python benchmarks/vocoder_shapes.py [--rows 1,2,3,4,6,8,12,16] [--frames 2,4,8,10]
        [--rounds 3] [--json PATH]

`--json` writes `{"rows": [{"variant", "first_ms", "known_ms"}]}`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


VARIANTS = ("onednn-1024", "onednn", "native")


def passes(variant: str, rows: list[int], frames: list[int]) -> tuple[float, float]:
    """Seconds of the first and the second pass over every shape, in this process."""
    import os

    import torch

    from realtime_omni.models.qwen3_omni import vocoder
    from realtime_omni.models.qwen3_omni.tensors import setup_torch
    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny
    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    if variant == "onednn-1024":
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "1024"
    setup_torch("cpu")  # one thread, as a stage runs
    vocoder.NATIVE_TRANSPOSED = variant == "native"
    d = ensure_tiny(0)
    model = load_part(d, "code2wav", "cpu", torch.float32, load_config(d))
    dec = vocoder.StreamingDecoder(model)
    shapes = [(r, f) for r in rows for f in frames]
    random.Random(0).shuffle(shapes)
    torch.manual_seed(0)
    hidden = model.config.hidden_size
    took = []
    for _ in range(2):
        t = 0.0
        for r, f in shapes:
            states: list[vocoder.State] = [{} for _ in range(r)]
            dec.decode(torch.randn(r, 2, hidden), states)  # a first chunk, then a later one
            x = torch.randn(r, f, hidden)
            start = time.perf_counter()
            dec.decode(x, states)
            t += time.perf_counter() - start
        took.append(t)
    return took[0], took[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--frames", default="2,4,8,10")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    frames = [int(x) for x in args.frames.split(",")]
    if args.variant:  # one variant in this fresh process
        first, second = passes(args.variant, rows, frames)
        print(f"{first} {second}")
        return
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in got:
            out = subprocess.run(
                [sys.executable, __file__, "--variant", variant, "--rows", args.rows,
                 "--frames", args.frames],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            first, second = (float(x) for x in out.stdout.split())
            got[variant].append((first, second))
    n = len(rows) * len(frames)
    print(f"{n} chunk shapes, {args.rounds} rounds, medians:")
    out = []
    for variant, runs in got.items():
        first = statistics.median(r[0] for r in runs) * 1e3
        second = statistics.median(r[1] for r in runs) * 1e3
        print(f"  {variant:11} first meeting {first:7.0f} ms   known shapes {second:7.0f} ms")
        out.append({"variant": variant, "first_ms": first, "known_ms": second})
    if args.json:
        args.json.write_text(json.dumps({"rows": out}, indent=2))


if __name__ == "__main__":
    main()
