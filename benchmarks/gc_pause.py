"""Full cyclic-GC passes in a stage process, with and without the start-up heap frozen.

Builds the executors of a config's process group as a stage process does (imports and models,
with the collector off), collects loading's garbage once, then times `gc.collect()` passes: first
over everything (the baseline: what a pass cost before stage processes froze their start-up
heap), then after `gc.freeze()`, as `Worker.run` does, with a few thousand live objects made
afterwards (what serving adds) so the frozen pass has work.

    python benchmarks/gc_pause.py [--config configs/tiny.yaml] [--process front] [--passes 5]
                                  [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.executor import StageContext, load_executor  # noqa: E402
from realtime_omni.pipeline.graph import Graph  # noqa: E402


def pass_ms(passes: int) -> float:
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs/tiny.yaml")
    ap.add_argument("--process", default="front", help="the process group whose stages to build")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    cfg = parse_config(yaml.safe_load(args.config.read_text()))
    graph = Graph(cfg)
    if args.process not in graph.groups:
        sys.exit(f"--process {args.process!r}: one of {sorted(graph.groups)}")
    gc.disable()  # as a stage process loads
    executors = []
    for name in graph.groups[args.process].stages:
        st = cfg.stages[name]
        ctx = StageContext(name, st.device, dict(st.params), dict(cfg.model))
        executors.append(load_executor(st.executor, ctx))
    gc.enable()
    made = len(gc.get_objects())
    start_up = pass_ms(1)  # loading's garbage
    objects = len(gc.get_objects())
    full = pass_ms(args.passes)
    gc.freeze()
    serving = [{"request": i, "state": [i] * 4} for i in range(5000)]  # made after start-up
    frozen = pass_ms(args.passes)
    print(f"{args.config.name}, process {args.process}: {made} objects made by start-up,")
    kept = gc.get_freeze_count()
    print(f"  {objects} left after its one pass ({start_up:.1f} ms); {kept} frozen")
    print(f"  full pass, nothing frozen (baseline): {full:8.1f} ms")
    print(f"  full pass, start-up frozen:           {frozen:8.1f} ms")
    print(f"  median of {args.passes} passes each; {len(serving)} objects made after the freeze")
    if args.json:
        figures = {"objects": objects, "frozen": kept, "full_pass_ms": full}
        args.json.write_text(json.dumps({**figures, "frozen_pass_ms": frozen}, indent=2))


if __name__ == "__main__":
    main()
