"""What a pipeline config puts on each GPU, against the card it names, and the KV pools it leaves.

`plan(cfg, card_bytes)` gives, per device (`cuda:N`, or `host/cuda:N` for a stage on another
host), the stages placed on it and for each: its weights, its KV pool, what it keeps between
steps, and the activations of its largest step; then the CUDA IPC slots senders there allocate,
and the reserve. It never touches a GPU:

- weights: from the checkpoint's shard headers when `model.path` is a directory here
  (`weights.part_bytes`), else from the published Qwen3-Omni-30B-A3B config
  (`real_width.build_config(None)`) on meta tensors; the talker adds its code predictor's fused
  copies (`step_memory.code_predictor_bytes`).
- KV pool: `params.kv_cache_tokens` or `kv_cache_gib` when set. An unset pool is what the card
  leaves after everything else on it (weights, kept memory, slots, every process's largest step,
  the reserve), divided between the unset pools sharing the device in proportion to their
  bytes per token (so each holds as many tokens); with the decode step measured again at that
  size (its attention gathers a layer's share of the pool), and the pool taken again.
- largest step: measured on meta tensors (`step_memory.py`, which says how); the stages of one
  process step one after another, so a process counts its largest stage's step.
- kept: the audio encoder's window cache (`params.cache_windows` windows, default 512).
- reserve: `CONTEXT_BYTES` for each process that uses the device (its CUDA context: ~400 MB with
  CUDA's lazy module loading, pytorch/pytorch#109888, and cuBLAS's workspaces) and
  `RESERVE_FRACTION` of the card for the allocator's fragmentation and what no measure sees
  (vLLM leaves the same 10 %: its `gpu_memory_utilization` defaults to 0.9).

`check(plans)` says what does not fit: the device, the stage and the shortfall. `render(plans)`
is the table `realtime-omni check --gpu` prints. `CARDS` holds the cards by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.config import PipelineConfig
from realtime_omni.pipeline.graph import Graph

GIB = 2**30
MIB = 2**20
# What CUDA can hand out on each card: nvidia-smi's memory.total (modal-labs/modal-client#2797
# lists H100 81,559 MiB, A100 80GB 81,920 MiB, L40S 46,068 MiB; H200 143,771 MiB as its own
# nvidia-smi prints it).
CARDS: dict[str, int] = {
    "h100-80": 81559 * MIB,
    "h200-141": 143771 * MIB,
    "a100-80": 81920 * MIB,
    "l40s-48": 46068 * MIB,
}
CONTEXT_BYTES = 512 * MIB
RESERVE_FRACTION = 0.10
BLOCK_TOKENS = 16  # cache.BLOCK_TOKENS, without importing torch for it

# The executors this plan knows, and the part of the checkpoint each loads.
_EXECUTORS = "realtime_omni.models.qwen3_omni."
PARTS = {
    _EXECUTORS + "thinker:ThinkerExecutor": "thinker",
    _EXECUTORS + "encoders:AudioEncoderExecutor": "audio_encoder",
    _EXECUTORS + "encoders:ImageEncoderExecutor": "image_encoder",
    _EXECUTORS + "talker:TalkerExecutor": "talker",
    _EXECUTORS + "code2wav:Code2WavExecutor": "code2wav",
}


@dataclass(frozen=True)
class StagePlan:
    stage: str
    process: str  # `process#replica`: its CUDA context and its steps
    part: str | None  # None: an executor this plan does not know (nothing counted)
    rows: int  # max_batch
    weights: int
    kv: int  # the KV pool (0: none)
    kv_per_token: int  # 0: no pool
    kv_planned: bool  # the plan sized it (no kv_cache_tokens / kv_cache_gib)
    kept: int
    step: int  # the largest step's activations
    step_what: str


@dataclass(frozen=True)
class DevicePlan:
    device: str
    card_name: str
    card: int
    stages: tuple[StagePlan, ...]
    slots: int  # CUDA IPC slot pools that senders on this device allocate
    source: str  # where the sizes come from

    @property
    def processes(self) -> int:
        return len({s.process for s in self.stages})

    @property
    def steps(self) -> int:
        """Each process's largest step, summed: the processes step at once."""
        most: dict[str, int] = {}
        for s in self.stages:
            most[s.process] = max(most.get(s.process, 0), s.step)
        return sum(most.values())

    @property
    def reserve(self) -> int:
        return self.processes * CONTEXT_BYTES + int(RESERVE_FRACTION * self.card)

    @property
    def used(self) -> int:
        held = sum(s.weights + s.kv + s.kept for s in self.stages)
        return held + self.slots + self.steps + self.reserve

    @property
    def spare(self) -> int:
        return self.card - self.used


def plan(cfg: PipelineConfig, card_bytes: int, card_name: str = "") -> list[DevicePlan]:
    """Every CUDA device of `cfg` as a card of `card_bytes` (`card_name`, for people), unset
    pools sized (see above)."""
    card_name = card_name or f"{_gib(card_bytes)} GiB"
    if not any(st.device.startswith("cuda") for st in cfg.stages.values()):
        return []
    graph = Graph(cfg)
    sizes = _Sizes(cfg.model)
    devices: dict[str, list[StagePlan]] = {}
    for name, st in cfg.stages.items():
        if not st.device.startswith("cuda"):
            continue
        one = sizes.stage(name, st, graph)
        hosts = st.replica_hosts or [st.host] * st.replicas
        for i, host in enumerate(hosts):  # each replica a process of its own, with all of it
            key = f"{host}/{st.device}" if host else st.device
            devices.setdefault(key, []).append(replace(one, process=f"{st.process or name}#{i}"))
    slots: dict[str, int] = {}
    for e in graph.edges:
        if e.transport == "cuda_ipc":
            st = cfg.stages[e.src]
            key = f"{st.host}/{st.device}" if st.host else st.device
            slots[key] = slots.get(key, 0) + e.slots * _aligned(e.slot_bytes)
    plans = []
    for key, stages in devices.items():
        dev = DevicePlan(key, card_name, card_bytes, tuple(stages), slots.get(key, 0), sizes.source)
        plans.append(_size_pools(dev, sizes, cfg, graph))
    return plans


def pool_bytes(cfg: PipelineConfig, stage: str, card_bytes: int) -> int:
    """The KV pool the plan gives `stage` (its first replica's device) on a card of
    `card_bytes`; ConfigError when its device does not fit."""
    for dev in plan(cfg, card_bytes, "this GPU"):
        for s in dev.stages:
            if s.stage == stage:
                problems = check([dev])
                if problems:
                    raise ConfigError(problems[0])
                return s.kv
    raise ConfigError(f"stage {stage!r} is on no CUDA device of the config")


def check(plans: list[DevicePlan]) -> list[str]:
    """What does not fit, a line a device: the device, the stages to change, the shortfall and
    the fix. Empty: everything fits."""
    out = []
    for dev in plans:
        where = f"{dev.device} ({dev.card_name}, {_gib(dev.card)} GiB)"
        starved = [s for s in dev.stages if s.kv_planned and s.kv < _min_pool(s)]
        if starved:
            s = starved[0]
            out.append(
                f"{where}: stage {s.stage}'s KV pool gets {_gib(s.kv)} GiB of what the rest "
                f"leaves, short by {_gib(_min_pool(s) - s.kv)} GiB of a block for each of its "
                f"{s.rows} rows. Fix: {_lighten(dev)}"
            )
            continue
        short = -dev.spare
        if short <= 0:
            continue
        pools = sorted((s for s in dev.stages if s.kv and not s.kv_planned), key=lambda s: -s.kv)
        head = f"{where}: short by {_gib(short)} GiB (it needs {_gib(dev.used)})"
        if pools and pools[0].kv > short:
            s = pools[0]
            out.append(
                f"{head}; stage {s.stage}'s KV pool is {_gib(s.kv)} GiB. Fix: set "
                f"stages.{s.stage}.params.kv_cache_gib to at most "
                f"{_gib(s.kv - short, down=True)}, or leave it unset for the plan to size it"
            )
        elif pools:
            named = ", ".join(f"{s.stage} {_gib(s.kv)} GiB" for s in pools)
            out.append(f"{head}, and still without the KV pools set here ({named}). Fix: "
                       f"{_lighten(dev)}")  # fmt: skip
        else:
            out.append(f"{head}. Fix: {_lighten(dev)}")
    return out


def _lighten(dev: DevicePlan) -> str:
    """The fix for a device whose stages need more than its card without their pools."""
    s = max(dev.stages, key=lambda s: s.step)
    return (
        f"a larger card, fewer stages on {dev.device}, or a smaller step: stage {s.stage}'s "
        f"({_gib(s.step)} GiB, {s.step_what}) shrinks with its max_batch ({s.rows})"
    )


def render(plans: list[DevicePlan]) -> str:
    """The plan as a table per device, in GiB."""
    lines = []
    for dev in plans:
        lines.append(f"{dev.device}: {dev.card_name}, {_gib(dev.card)} GiB (sizes: {dev.source})")
        lines.append(f"  {'stage':15} {'weights':>8} {'KV pool':>9} {'kept':>6} {'step':>6}  "
                     "largest step")  # fmt: skip
        for s in dev.stages:
            kv = f"{_gib(s.kv)}{'*' if s.kv_planned else ' '}" if s.kv else "- "
            kept = _gib(s.kept) if s.kept else "-"
            lines.append(f"  {s.stage:15} {_gib(s.weights):>8} {kv:>9} {kept:>6} "
                         f"{_gib(s.step):>6}  {s.step_what}")  # fmt: skip
        lines.append(f"  {'CUDA IPC slots':15} {_gib(dev.slots):>8}  what senders here allocate")
        n = dev.processes
        lines.append(
            f"  {'reserve':15} {_gib(dev.reserve):>8}  {n} CUDA context{'s' * (n != 1)} x "
            f"{CONTEXT_BYTES // MIB} MiB + {RESERVE_FRACTION:.0%} of the card"
        )
        verdict = "DOES NOT FIT" if check([dev]) else "fits"
        lines.append(f"  {'total':15} {_gib(dev.used):>8}  of {_gib(dev.card)}: {verdict}, "
                     f"{_gib(dev.spare)} GiB spare")  # fmt: skip
        if any(s.kv_planned for s in dev.stages):
            lines.append("  * sized by the plan (no kv_cache_tokens or kv_cache_gib)")
        if any(s.part is None for s in dev.stages):
            lines.append("  an executor this plan does not know counts nothing")
    return "\n".join(lines)


class _Sizes:
    """A stage's figures from the model's config, its parts built once on meta tensors."""

    def __init__(self, model: dict[str, Any]) -> None:
        from transformers.utils import logging as hf_logging

        from realtime_omni.models.qwen3_omni.tensors import model_dtype

        self.dtype = model_dtype(model, "cuda")
        path = model.get("path")
        self.checkpoint: Path | None = Path(str(path)).expanduser() if path else None
        if self.checkpoint is not None and not (self.checkpoint / "config.json").is_file():
            self.checkpoint = None
        self.source = (
            f"the checkpoint at {self.checkpoint}"
            if self.checkpoint is not None
            else "the published Qwen3-Omni-30B-A3B config"
            + (f"; model.path {path} is not here" if path else "")
        )
        # transformers warns of the thinker's rope fields it does not know; they are read.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            self.cfg = self._config()
        finally:
            hf_logging.set_verbosity(verbosity)
        self._parts: dict[str, Any] = {}

    def _config(self) -> Any:
        key = str(self.checkpoint)
        if key not in _CONFIGS:
            if self.checkpoint is not None:
                from realtime_omni.models.qwen3_omni.weights import load_config

                _CONFIGS[key] = load_config(self.checkpoint)
            else:
                from realtime_omni.models.qwen3_omni.real_width import build_config

                _CONFIGS[key] = build_config(None)
        return _CONFIGS[key]

    def part(self, name: str) -> Any:
        """The part on meta tensors (the thinker without its towers)."""
        if name not in self._parts:
            from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

            from realtime_omni.models.qwen3_omni.step_memory import build

            tc = self.cfg.thinker_config
            cls, part_cfg = {
                "thinker": (qo.Qwen3OmniMoeThinkerForConditionalGeneration, tc),
                "audio_encoder": (qo.Qwen3OmniMoeAudioEncoder, tc.audio_config),
                "image_encoder": (qo.Qwen3OmniMoeVisionEncoder, tc.vision_config),
                "talker": (qo.Qwen3OmniMoeTalkerForConditionalGeneration, self.cfg.talker_config),
                "code2wav": (qo.Qwen3OmniMoeCode2Wav, self.cfg.code2wav_config),
            }[name]
            module = build(cls, part_cfg, self.dtype)
            if name == "thinker":
                module.model.audio_tower = None
                module.model.visual = None
            self._parts[name] = module
        return self._parts[name]

    def weights(self, part: str) -> int:
        if self.checkpoint is not None:
            from realtime_omni.models.qwen3_omni.weights import part_bytes

            total = part_bytes(self.checkpoint, part, self.dtype)
        else:
            module = self.part(part)
            total = sum(p.numel() * p.element_size() for p in module.parameters())
        if part == "talker":
            from realtime_omni.models.qwen3_omni.step_memory import code_predictor_bytes

            total += code_predictor_bytes(self.part("talker"))
        return int(total)

    def text_config(self, part: str) -> Any:
        if part == "thinker":
            return self.cfg.thinker_config.text_config
        return self.cfg.talker_config.text_config

    def kv_per_token(self, part: str) -> int:
        text = self.text_config(part)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads = int(text.num_key_value_heads)
        return 2 * int(text.num_hidden_layers) * heads * int(head_dim) * self.dtype.itemsize

    def stage(self, name: str, st: Any, graph: Graph) -> StagePlan:
        process = f"{st.process or name}#0"
        part = PARTS.get(st.executor)
        if part is None:
            return StagePlan(name, process, None, st.max_batch, 0, 0, 0, False, 0, 0, "?")
        p = st.params
        per_token = self.kv_per_token(part) if part in ("thinker", "talker") else 0
        kv, planned = 0, False
        if per_token:
            block = per_token * BLOCK_TOKENS
            if "kv_cache_tokens" in p:
                kv = int(p["kv_cache_tokens"]) // BLOCK_TOKENS * block
            elif "kv_cache_gib" in p:
                kv = int(float(p["kv_cache_gib"]) * GIB // block) * block
            else:
                planned = True  # sized, and its step measured, once the rest is known
        kept = 0
        if part == "audio_encoder":
            from realtime_omni.models.qwen3_omni.step_memory import audio_window_bytes

            tc = self.cfg.thinker_config
            kept = int(p.get("cache_windows", 512)) * audio_window_bytes(
                tc.audio_config, self.dtype
            )
        step, what = (0, "") if planned else self.step(part, name, st, graph, kv)
        return StagePlan(name, process, part, st.max_batch, self.weights(part), kv, per_token,
                         planned, kept, step, what)  # fmt: skip

    def step(self, part: str, name: str, st: Any, graph: Graph, kv: int) -> tuple[int, str]:
        """The largest step's activations and what it is (measured once a process for the
        same model, stage settings, inbound slots and pool)."""
        inbound = max([e.slot_bytes for e in graph.in_edges[name]], default=0)
        key = (self.source, str(self.dtype), part, st.max_batch, st.max_prefill_tokens_per_step,
               json.dumps(st.params, sort_keys=True, default=str), inbound, kv)  # fmt: skip
        if key not in _STEPS:
            _STEPS[key] = self._measure(part, st, inbound, kv)
        return _STEPS[key]

    def _measure(self, part: str, st: Any, inbound: int, kv: int) -> tuple[int, str]:
        from realtime_omni.models.qwen3_omni import step_memory as sm

        rows, p, dtype = st.max_batch, st.params, self.dtype
        if part in ("thinker", "talker"):
            blocks = max(rows, kv // (self.kv_per_token(part) * BLOCK_TOKENS))
            longest = min(
                blocks * BLOCK_TOKENS, int(self.text_config(part).max_position_embeddings)
            )
            if part == "thinker":
                chunk = st.max_prefill_tokens_per_step
                peak = sm.thinker_step(self.cfg.thinker_config, dtype, rows, chunk, blocks)
                return peak, f"decode {rows} rows; prefill {chunk} at {longest:,}"
            width = int(self.cfg.thinker_config.text_config.hidden_size)
            prompt = max(1, inbound // (width * dtype.itemsize))
            peak = sm.talker_step(self.cfg.talker_config, dtype, rows, prompt, blocks)
            return peak, f"frame of {rows} rows; prefill {min(prompt, longest):,}"
        if part == "audio_encoder":
            audio = self.cfg.thinker_config.audio_config
            frames = max(1, inbound // (int(audio.num_mel_bins) * 4))  # float32 mel
            peak = sm.audio_step(audio, dtype, rows, frames)
            return peak, f"{rows} clips of {frames:,} mel frames"
        if part == "image_encoder":
            v = self.cfg.thinker_config.vision_config
            patch = int(v.in_channels * v.temporal_patch_size * v.patch_size**2) * 4  # float32
            side = sm.image_side(max(1, inbound // patch), int(v.spatial_merge_size))
            peak = sm.image_step(self.part(part), dtype, rows, side)
            return peak, f"{rows} images of {side}x{side} patches"
        c = self.cfg.code2wav_config
        chunk = int(p.get("chunk_frames", 10))
        context = int(p.get("left_context_frames", c.num_hidden_layers * c.sliding_window))
        chunks = min(rows, max(1, int(p.get("max_frames_per_step", 64)) // chunk))
        peak = sm.code2wav_step(self.part(part), chunks, chunk, context)
        return peak, f"{chunks} chunks of {chunk} frames after {context}"


# Read once a process: model configs by checkpoint ("None": the published one), and
# `_Sizes.step`'s measures.
_CONFIGS: dict[str, Any] = {}
_STEPS: dict[tuple[Any, ...], tuple[int, str]] = {}


def _size_pools(dev: DevicePlan, sizes: _Sizes, cfg: PipelineConfig, graph: Graph) -> DevicePlan:
    """Unset pools: what the device leaves, in proportion to bytes per token; the step of each
    measured at that size, and the pools taken again (smaller: the steps grew)."""
    planned = [s for s in dev.stages if s.kv_planned]
    if not planned:
        return dev
    stages = list(dev.stages)
    for remeasure in (True, False):
        cur = replace(dev, stages=tuple(stages))
        left = cur.spare + sum(s.kv for s in planned)
        weight = sum(s.kv_per_token for s in planned)
        for i, s in enumerate(stages):
            if not s.kv_planned:
                continue
            block = s.kv_per_token * BLOCK_TOKENS
            kv = max(0, int(left * s.kv_per_token / weight) // block * block)
            step, what = (s.step, s.step_what)
            if remeasure and kv > 0:  # none left: the device does not fit (`check`)
                assert s.part is not None
                step, what = sizes.step(s.part, s.stage, cfg.stages[s.stage], graph, kv)
            stages[i] = replace(s, kv=kv, step=step, step_what=what)
        planned = [s for s in stages if s.kv_planned]
    return replace(dev, stages=tuple(stages))


def _min_pool(s: StagePlan) -> int:
    """A pool must hold a block for each row it serves at least."""
    return s.kv_per_token * BLOCK_TOKENS * s.rows


def _aligned(n: int) -> int:
    align = 256  # relay.ALIGN: every slot starts aligned
    return (n + align - 1) // align * align


def _gib(n: int, down: bool = False) -> str:
    x = n / GIB
    return f"{math.floor(x * 100) / 100:.2f}" if down else f"{x:.2f}"
