"""Batched step times: the thinker, talker and code2wav executors at batch 1, 8 and 32.

Builds the three executors in this process on `--device` (the real classes; weights from the
tiny checkpoint, or random at the real Qwen3-Omni sizes with `--model real`), starts `--batch`
requests in each and times their steady steps after the prefills:

- thinker: one decode step (a token for every request);
- talker_ar: one frame for every request (a talker step and the code predictor's 15);
- code2wav: a 10-frame chunk per request (the pre-transformer over the chunk and its left
  context, the streamed convolutions over its 10 new frames).

It prints the median step time per stage and batch, and that time per request: how far a step
amortises over its batch. `--model real` writes the published Qwen3-Omni-30B-A3B config at its
full depth (`models/qwen3_omni/real_width.py`'s PUBLISHED, every width, expert count and
vocabulary checked against the released config.json; transformers' defaults differ in a dozen
places) with the tiny model's token ids, so the tiny tokenizer's prompts fit; there are no
weights to read (random, about 70 GB in bf16 on the device, made in seconds). Made for
`benchmarks/gpu_check.sh`; on a CPU, use the tiny model.

    python benchmarks/batch_steps.py [--model tiny|real] [--device cuda:0] [--dtype bfloat16]
        [--batches 1,8,32] [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _ids(node: Any, tiny: Any) -> None:
    """Copy every token id of the tiny config over the real one (same structure), and the
    fields the modeling code reads but the config classes do not declare."""
    if not isinstance(node, dict) or not isinstance(tiny, dict):
        return
    for k, v in tiny.items():
        if "token" in k or k.endswith("_id") or k == "speaker_id" or k not in node:
            node[k] = v
        else:
            _ids(node[k], v)


def real_size_dir(tiny: Path, out: Path, scale: dict[str, Any] | None = None) -> Path:
    """A config-only checkpoint of the published Qwen3-Omni-30B-A3B at its full depth
    (`real_width.PUBLISHED`; `scale` overrides the thinker's text sizes), with the tiny token
    ids so the tiny tokenizer's prompts fit."""
    from transformers import Qwen3OmniMoeConfig

    from realtime_omni.models.qwen3_omni.real_width import real_config_dict
    from realtime_omni.models.qwen3_omni.weights import RANDOM

    real = Qwen3OmniMoeConfig(**real_config_dict(None)).to_dict()
    text = real["thinker_config"]["text_config"]
    text.update(scale or {})
    text.pop("layer_types", None)  # made again from num_hidden_layers
    _ids(real, json.loads((tiny / "config.json").read_text()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(real))
    width = real["thinker_config"]["text_config"]["hidden_size"]
    (out / RANDOM).write_text(json.dumps({"widths": {"thinker.model.embed_tokens.weight": width}}))
    for f in tiny.iterdir():  # tokenizer, processor files, chat template
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "build_info.json"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def context(stage: str, model: dict[str, Any], device: str, batch: int, **params: Any) -> Any:
    from realtime_omni.pipeline.executor import StageContext

    down = {"thinker": ["decode", "talker_ar"], "talker_ar": ["code2wav"], "code2wav": ["client"]}
    return StageContext(stage, device, params, model, down[stage], max_batch=batch)


def prompt(cfg: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """A user turn of n text tokens and the assistant head, in the tiny ids."""
    body = rng.integers(300, 1800, n)
    head = [cfg.im_start_token_id, cfg.user_token_id]
    tail = [cfg.im_end_token_id, cfg.im_start_token_id, cfg.assistant_token_id, 198 % 1900]
    return np.array([*head, *body, *tail], dtype=np.int64)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Any, device: str, steps: int) -> float:
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(model: dict[str, Any], device: str, batch: int, steps: int) -> dict[str, float]:
    from realtime_omni.models.qwen3_omni.code2wav import Code2WavExecutor
    from realtime_omni.models.qwen3_omni.talker import TalkerExecutor
    from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor

    rng = np.random.default_rng(0)
    tokens = 3 * steps + 8
    # Small KV pools: the executors share one device here (and the default would give the
    # thinker's most of what its weights leave free).
    kv = {"kv_cache_gib": 2}
    thinker = ThinkerExecutor(context("thinker", model, device, batch, max_tokens=10**6, **kv))
    cfg = thinker.cfg
    for i in range(batch):
        ids = prompt(cfg, 64, rng)
        thinker.add_request(f"r{i}", {"p": {"input_ids": ids, "max_tokens": tokens}})
    speech: dict[str, list[dict[str, Any]]] = {f"r{i}": [] for i in range(batch)}

    def think() -> None:
        for e in thinker.step():
            if e.to == "talker_ar" and e.data is not None:
                speech[e.request_id].append(e.data)

    while any(not v for v in speech.values()):  # every prefill done
        think()
    out = {"thinker": timed(think, device, steps)}
    while min(len(v) for v in speech.values()) < steps + 4:
        think()

    params = {"temperature": 0.9, "top_k": 50, "max_frames": 10**6, **kv}
    talker = TalkerExecutor(context("talker_ar", model, device, batch, **params))
    for i in range(batch):
        talker.add_request(f"r{i}", {"p": {"input_ids": prompt(cfg, 64, rng)}})
        for item in speech[f"r{i}"]:
            talker.add_item(f"r{i}", "thinker", item)
    talker.step()  # the prefills
    out["talker_ar"] = timed(talker.step, device, steps)

    code2wav = Code2WavExecutor(
        context("code2wav", model, device, batch, max_frames_per_step=10**6)
    )
    frames = rng.integers(0, 2048, (36 + 10 * steps, 16))
    for i in range(batch):
        code2wav.add_request(f"r{i}", {})
        for f in frames:
            code2wav.add_item(f"r{i}", "talker_ar", {"codes": f, "token_time": 0.0})
    for _ in range(4):  # past the first chunks: every window has its full left context
        code2wav.step()
    out["code2wav"] = timed(code2wav.step, device, steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "real"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, else float32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny

    tiny = ensure_tiny(0)
    path = tiny
    if args.model == "real":
        path = real_size_dir(tiny, Path(tempfile.mkdtemp(prefix="rto-real-")))
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = {"path": str(path), "dtype": dtype}
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        print(f"  {args.model} batch {b} ...", file=sys.stderr, flush=True)
        for stage, ms in measure(model, args.device, b, args.steps).items():
            rows.append({"model": args.model, "device": args.device, "dtype": dtype,
                         "stage": stage, "batch": b, "step_ms": round(ms, 3)})  # fmt: skip
    print(f"{'stage':10} {'batch':>5} {'step':>10} {'per request':>12}")
    for r in rows:
        print(f"{r['stage']:10} {r['batch']:>5} {r['step_ms']:>8.2f}ms "
              f"{r['step_ms'] / r['batch']:>10.2f}ms")  # fmt: skip
    print(f"{args.model} model on {args.device} in {dtype}; median of {args.steps} steps each")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
