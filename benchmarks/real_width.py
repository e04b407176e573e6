"""Qwen3-Omni's published widths on this CPU in bf16: loading's memory, each stage's step, KV bytes.

The model is real_width.py's (every width, expert count, head count, vocabulary and codebook of
Qwen3-Omni-30B-A3B, 2 layers per stack unless `--layers` says otherwise, random weights in the
published checkpoint layout; built into .cache/ on first use), read through weights.py as a real
checkpoint is.

1. Loading, in a fresh process: every part through `weights.load_part`, as the stages load them
   (thinker, audio and image encoders, talker, code2wav), one after the other, all kept. On the
   CPU, RSS from /proc/self/status: `final` = RSS after all minus RSS before (imports done),
   `peak` = the high-water mark (VmHWM) minus RSS before, `layer` = the largest decoder layer's
   parameter bytes (a thinker layer: 128 experts). Target: peak <= 1.1 x (final + layer). Per
   part the same, the mark reset before each (/proc/self/clear_refs). On CUDA the same from the
   device's allocator (`memory_allocated`, `max_memory_allocated`).
2. Steps: configs/real-width-cpu.yaml's stages in this process (tests/models/inproc.py's
   harness: no sockets, one thread as a stage process with `threads: 1`), 8 rows wide, greedy:
   one audio+image request alone, then 8 requests at once. Per stage the median duration of
   the steps that served exactly 1 (then 8) requests, or as many as any step served (`served`:
   code2wav serves those with a chunk ready); the thinker's prefill steps (a request's first
   token) apart from its decode steps. Baseline in the same run: the prefill's lm_head
   on a [1, 1, D] view with the prompt's stride, as thinker.py called it before session 23
   (torch.matmul runs it as a bmm over a transposed copy of the weight), against the same
   product as [1, D] @ W.T, as it calls it now.
3. KV bytes per token, thinker and talker (their `BlockCache`s): the pool's bytes per token
   slot (its K and V tensors over its slots) and, sampled at every step of the 8-request run,
   bytes held over tokens held at the step holding the most, against
   layers x 2 x kv_heads x head_dim x dtype bytes.

    .venv/bin/python benchmarks/real_width.py [--json PATH] [--tokens 8] [--frames 10]
        [--layers 2|N|auto] [--device cpu|cuda:0] [--cache-dir DIR|auto]

`--layers auto` takes the published depth (48 thinker layers, every stack as published: 70.5 GB
in bf16) where its checkpoint fits both the free space of the cache folder and the memory of
`--device` (less room for the KV pools and activations), else the deepest that fits, and says
which; `--cache-dir auto` builds it in whichever of .cache/, /dev/shm and the temp folder has the
most room. Made for benchmarks/gpu_check.sh's `real` step on a lent GPU; on this CPU only the
2-layer default is practical (a layer of the thinker is 1.2 GB to build, load and step).

`--json` writes the shape issue 30 names, `{"load_peak_bytes", "final_bytes", "layer_bytes",
"steps": [{"stage", "batch", "ms"}], "kv_bytes_per_token"}` (bytes; ms; `kv_bytes_per_token`
the thinker's pool, its K and V tensors' bytes over its token slots); the rest is printed.
Memory: ~6 GB at 2 layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARTS = ("thinker", "audio_encoder", "image_encoder", "talker", "code2wav")
MODEL_STAGES = ("image_encoder", "audio_encoder", "thinker", "talker_ar", "code2wav")
KV_GIB = {"thinker": 8, "talker_ar": 2}
# What a device must hold beside the weights: the KV pools above, activations and workspaces.
DEVICE_ROOM_BYTES = 24 << 30


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


class Meter:
    """Bytes held now and the high-water mark since `reset`: the process's RSS on the CPU, the
    device allocator's on CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.torch = torch

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def now(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else status()["VmRSS"]

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else status()["VmHWM"]


def load_child(d: Path, device: str) -> dict[str, Any]:
    """Step 1, in the process this runs in (a fresh one)."""
    import torch

    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    torch.set_grad_enabled(False)
    cfg = load_config(d)
    meter = Meter(device)
    before = meter.now()
    parts, kept, layer = [], [], 0
    for part in PARTS:
        meter.reset()
        start = meter.now()
        t0 = time.perf_counter()
        module = load_part(d, part, device, torch.bfloat16, cfg)
        seconds = time.perf_counter() - t0
        final, peak = meter.now(), meter.peak()
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        big = max(
            (
                sum(p.numel() * p.element_size() for p in m.parameters())
                for name, stack in module.named_modules()
                if name.rpartition(".")[2] in ("layers", "blocks")
                for m in stack
            ),
            default=0,
        )
        layer = max(layer, big)
        parts.append({"part": part, "peak_bytes": peak - start, "final_bytes": final - start,
                      "param_bytes": params, "layer_bytes": big,
                      "load_s": round(seconds, 2)})  # fmt: skip
        kept.append(module)
    after = meter.now()
    # The run's peak: the highest of the parts' marks, each over the bytes held before all.
    peak = max(p["peak_bytes"] + sum(q["final_bytes"] for q in parts[:i]) for i, p in
               enumerate(parts))  # fmt: skip
    return {"load_peak_bytes": peak, "final_bytes": after - before, "layer_bytes": layer,
            "param_bytes": sum(p["param_bytes"] for p in parts), "parts": parts}  # fmt: skip


def payloads(n: int, tokens: int, frames: int) -> dict[str, dict[str, Any]]:
    from tests.models.reference import chirp, conversation
    from tests.models.reference import test_image as image_array

    greedy = {"temperature": 0, "talker_temperature": 0, "max_tokens": tokens,
              "talker_max_tokens": frames}  # fmt: skip
    out = {}
    for i in range(n):
        p = {**conversation("audio_image"), **greedy}
        p["audio0"] = chirp(1.0 + 0.25 * i)
        p["image0"] = np.roll(image_array(), 7 * i, axis=1)
        out[f"r{i}"] = p
    return out


def run_steps(d: Path, tokens: int, frames: int, device: str) -> dict[str, Any]:
    """Steps 2 and 3."""
    import torch

    from realtime_omni.models.qwen3_omni.cache import text_kv_shape
    from tests.models.inproc import InProcess

    cfg = yaml.safe_load((ROOT / "configs" / "real-width-cpu.yaml").read_text())
    cfg["model"] = {"path": str(d), "dtype": "bfloat16"}
    for name, stage in cfg["stages"].items():
        stage["max_batch"] = 8
        if device != "cpu" and name in MODEL_STAGES:
            stage["device"] = device
            if name in KV_GIB:  # the stages share one device here: pools sized, not fractions
                stage.setdefault("params", {})["kv_cache_gib"] = KV_GIB[name]
    p = InProcess(cfg)
    times: list[tuple[str, int, float]] = []  # (stage, requests served, ms)
    kv: dict[str, list[tuple[int, int]]] = {"thinker": [], "talker_ar": []}
    for name, stage in p.stages.items():
        step = stage.step

        def timed(name: str = name, step: Any = step) -> Any:
            t0 = time.perf_counter()
            emits = step()
            ms = (time.perf_counter() - t0) * 1e3
            served = len({e.request_id for e in emits})
            if name == "thinker" and any(
                e.data is not None and e.data.get("index") == 0 for e in emits
            ):
                name = "thinker_prefill"
            times.append((name, served, ms))
            if name.startswith("thinker") or name == "talker_ar":
                cache = p.stages[name.removesuffix("_prefill")].executor.cache  # type: ignore[attr-defined]
                kv[name.removesuffix("_prefill")].append((cache.bytes_held(), sum(cache.lens)))
            return emits

        stage.step = timed  # type: ignore[method-assign]

    out: dict[str, Any] = {"steps": []}
    for batch in (1, 8):
        times.clear()
        for rid, payload in payloads(batch, tokens, frames).items():
            p.submit(f"{batch}-{rid}", payload)
        p.run()
        for stage in dict.fromkeys(s for s, _, _ in times):
            # code2wav serves the requests with a chunk ready: rarely all 8 in one step.
            served = min(batch, max(n for s, n, _ in times if s == stage))
            ms = [m for s, n, m in times if s == stage and n == served]
            row = {"stage": stage, "batch": batch, "ms": round(statistics.median(ms), 2)}
            out["steps"].append({**row, "served": served, "n": len(ms)})

    out["kv_bytes_per_token"] = {}
    for name, samples in kv.items():
        ex = p.stages[name].executor
        cache = ex.cache  # type: ignore[attr-defined]
        text = ex.model.model.config if name == "talker_ar" else ex.lm.config  # type: ignore[attr-defined]
        pool = sum(t.nbytes for t in (*cache.k, *cache.v))
        held, tokens_held = max(samples, key=lambda s: s[1])
        _, head_dim = text_kv_shape(text)
        itemsize = cache.k[0].element_size()
        formula = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * itemsize
        out["kv_bytes_per_token"][name] = {
            "pool_slot": pool / (cache.blocks * cache.block_tokens), "held": held / tokens_held,
            "formula": formula, "tokens_held": tokens_held, "bytes_held": held,
            "layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads,
            "head_dim": head_dim, "dtype_bytes": itemsize,
        }  # fmt: skip

    # The prefill's lm_head on a [1, 1, D] view of the prompt's hidden states (as thinker.py
    # called it before session 23), against the [1, D] product it makes now.
    lm_head = p.stages["thinker"].executor.model.lm_head  # type: ignore[attr-defined]
    hidden = torch.randn(1, 64, lm_head.in_features, dtype=torch.bfloat16)
    as_made = hidden[:, -1:]
    plain = hidden[0, -1:]
    out["lm_head_prefill_ms"] = {
        "as_3d_view": round(_time(lambda: lm_head(as_made)), 1),
        "as_2d": round(_time(lambda: lm_head(plain)), 1),
    }
    return out


def _time(fn: Any, repeat: int = 3) -> float:
    ms = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def cache_root(arg: str | None) -> Path:
    """The folder the checkpoint's folder is built in: `arg`, or with "auto" whichever of
    .cache/, /dev/shm and the temp folder has the most room."""
    import shutil
    import tempfile

    from realtime_omni.models.qwen3_omni.real_width import default_dir

    here = default_dir(0).parent
    if arg != "auto":
        return Path(arg) if arg else here
    here.mkdir(parents=True, exist_ok=True)
    candidates = [here, Path("/dev/shm"), Path(tempfile.gettempdir())]
    return max((c for c in candidates if c.is_dir()), key=lambda c: shutil.disk_usage(c).free)


def choose_layers(arg: str, device: str, where: Path) -> int:
    """`--layers`: a number, or "auto": the published depth if its checkpoint fits on the disk
    that holds `where` and in `device`'s memory (beside DEVICE_ROOM_BYTES), else the deepest."""
    import shutil

    import torch

    from realtime_omni.models.qwen3_omni.real_width import (
        checkpoint_bytes,
        deepest_fitting,
        published_depth,
    )

    if arg != "auto":
        return int(arg)
    where.mkdir(parents=True, exist_ok=True)
    disk = shutil.disk_usage(where).free - (2 << 30)
    if torch.device(device).type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory - DEVICE_ROOM_BYTES
    else:  # the CPU: the weights, a copy of a layer, and the checkpoint if it lies in tmpfs
        available = int(Path("/proc/meminfo").read_text().split("MemAvailable:")[1].split()[0])
        memory = available * 1024 - (8 << 30)
        if str(where).startswith("/dev/shm"):
            memory //= 2
    budget = min(disk, memory)
    full = published_depth()
    layers = full if checkpoint_bytes(full) <= budget else deepest_fitting(budget)
    print(
        f"--layers auto: {layers} of {full} ({checkpoint_bytes(layers) / 1e9:.1f} GB in bf16; "
        f"{disk / 1e9:.0f} GB free at {where}, {memory / 1e9:.0f} GB of {device} to spare)",
        flush=True,
    )
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tokens", type=int, default=8, help="text tokens per request")
    parser.add_argument("--frames", type=int, default=10, help="talker frames per request")
    parser.add_argument("--layers", default="2", help="layers per stack: a number, or auto")
    parser.add_argument("--device", default="cpu", help="where the model stages run")
    parser.add_argument("--cache-dir", help="the folder to build the checkpoint in (or auto)")
    parser.add_argument("--load-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        print(json.dumps(load_child(args.load_child, args.device)))
        return

    from realtime_omni.models.qwen3_omni.real_width import default_dir, ensure_real_width

    root = cache_root(args.cache_dir)
    layers = choose_layers(args.layers, args.device, root)
    t0 = time.perf_counter()
    d = ensure_real_width(0, root / default_dir(0, layers).name, layers)
    print(f"checkpoint at {d} ({time.perf_counter() - t0:.0f} s)", flush=True)
    child = subprocess.run(
        [sys.executable, __file__, "--load-child", str(d), "--device", args.device],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    result.update(run_steps(d, args.tokens, args.frames, args.device))
    result["layers"] = layers
    target = 1.1 * (result["final_bytes"] + result["layer_bytes"])
    result["load_target_bytes"] = int(target)

    gb = 1e9
    print(
        f"{layers} layers per stack on {args.device}\n"
        f"loading every part: peak {result['load_peak_bytes'] / gb:.2f} GB, final "
        f"{result['final_bytes'] / gb:.2f} GB (parameters {result['param_bytes'] / gb:.2f} GB), "
        f"one layer {result['layer_bytes'] / gb:.2f} GB; target peak <= "
        f"{target / gb:.2f} GB: {'met' if result['load_peak_bytes'] <= target else 'MISSED'}"
    )
    print(f"{'part':14} {'peak GB':>8} {'final GB':>9} {'params GB':>10} {'load s':>7}")
    for q in result["parts"]:
        print(
            f"{q['part']:14} {q['peak_bytes'] / gb:>8.2f} {q['final_bytes'] / gb:>9.2f} "
            f"{q['param_bytes'] / gb:>10.2f} {q['load_s']:>7.1f}"
        )
    print(f"\n{'stage':16} {'batch':>5} {'served':>6} {'step ms':>9} {'steps':>6}")
    for s in result["steps"]:
        print(f"{s['stage']:16} {s['batch']:>5} {s['served']:>6} {s['ms']:>9.1f} {s['n']:>6}")
    lm = result["lm_head_prefill_ms"]
    print(
        f"\nprefill lm_head: {lm['as_3d_view']:.0f} ms on a [1, 1, D] view (as before), "
        f"{lm['as_2d']:.0f} ms as [1, D] @ W.T"
    )
    print(f"\n{'KV':10} {'pool/slot':>10} {'held/token':>11} {'formula':>8}  (bytes per token)")
    for name, k in result["kv_bytes_per_token"].items():
        print(
            f"{name:10} {k['pool_slot']:>10.0f} {k['held']:>11.0f} {k['formula']:>8}  = "
            f"{k['layers']} x 2 x {k['kv_heads']} x {k['head_dim']} x {k['dtype_bytes']}; "
            f"held at {k['tokens_held']} tokens"
        )
    if args.json:
        shape = {k: result[k] for k in ("load_peak_bytes", "final_bytes", "layer_bytes")}
        shape["steps"] = [{k: st[k] for k in ("stage", "batch", "ms")} for st in result["steps"]]
        shape["kv_bytes_per_token"] = result["kv_bytes_per_token"]["thinker"]["pool_slot"]
        args.json.write_text(json.dumps(shape, indent=2))


if __name__ == "__main__":
    main()
