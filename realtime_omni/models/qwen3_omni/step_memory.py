"""The activation memory of a stage's largest step, measured on meta tensors.

Each `*_step` function builds its part on the meta device (no memory, no weights) and runs the
calls its executor makes in one step at the largest shapes the config allows, under
`PeakBytes`, which adds up the storages the ops create while they live: the peak is what the
step allocates beyond the weights, the KV pool and what existed before. The steps:

- thinker: a decode forward of `rows` requests whose rows together hold the whole KV pool (the
  block attention gathers a group's keys and values per layer: a layer's share of the pool),
  and a prefill chunk of `prefill_tokens` at the end of the longest context the pool holds
  (with every layer's hidden states, as when it speaks); the larger of the two.
- talker: the same decode through its own pool, then the code predictor's steps for the batch
  (its first two: the 13 after them allocate what the second does); and a prefill of
  `prompt_rows` rows (a talker prompt is prefilled in one forward).
  Both are measured at 3 and 4 layers and taken to their depth in a line (`_deep`): the layers
  are alike, and each adds the same to what a forward holds (its hidden state); for the
  published config this gave what all 48 (and 20) layers measured, in seconds less.
- audio encoder: `rows` clips of `mel_frames` frames, each cut into the 8 s windows the
  executor encodes side by side; measured at 2 of the tower's layers, which are alike and keep
  nothing between them (the 32 of them take seconds on meta tensors, with the same peak).
- image encoder: `rows` images of `side` x `side` patches (`image_side`: the largest square
  grid in what the edge into it carries).
- code2wav: `rows` chunks of `chunk_frames` frames behind `left_context_frames` of context,
  first chunks (no state), as one pre-transformer call and one pass of the convolutions.

What a meta run cannot see is modelled, and said here: attention (SDPA) counts its output and,
for a boolean mask, the additive mask CUDA's fused kernels make of it, never the scores (flash
and memory-efficient attention keep them in on-chip memory); the MoE experts' grouped products
count their output (their meta kernels take bfloat16 alone); host float tensors mixed into meta
ones (the vision tower's interpolation weights) move to meta.
What requests hold between steps outside the KV pool (a prompt's embeddings while it prefills)
and the allocator's rounding are left to the plan's reserve (memory_plan.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from realtime_omni.models.qwen3_omni.tensors import tensors_in

META = "meta"


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that ops inside it create, each freed when the
    last tensor on it is collected. Storages made before it (parameters, a KV pool) are not
    counted, nor views or in-place results of them. `live` is what is still held at exit."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage -> [tensors on it, bytes]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {_key(t) for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            self._track(t, given)
        return out

    def _track(self, t: torch.Tensor, given: set[int]) -> None:
        key = _key(t)
        held = self._held.get(key)
        if held is None:
            if key in given:  # a view or in-place result of a storage not counted
                return
            held = self._held[key] = [0, t.untyped_storage().nbytes()]
            self.live += held[1]
            self.peak = max(self.peak, self.live)
        held[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        held = self._held[key]
        held[0] -= 1
        if held[0] == 0:
            del self._held[key]
            self.live -= held[1]


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class AsOnCuda(TorchFunctionMode):
    """Meta runs that allocate as CUDA does: attention as a fused kernel (its output, and the
    additive mask made of a boolean one, never the scores); the experts' grouped products as
    their output, in any dtype; host floats mixed into meta ops moved to meta."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, _, v = args[:3]
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is not None and mask.dtype == torch.bool:
                additive = torch.empty(mask.shape, dtype=q.dtype, device=q.device)
                del additive  # held while the kernel runs, freed with it
            return out
        given = list(tensors_in((args, kwargs)))
        if func in _GROUPED_MM:  # [S, K] x [E, K, N] -> [S, N], for any dtype
            a, b = args[:2]
            return a.new_empty(a.shape[0], b.shape[-1])
        if any(t.is_meta for t in given) and any(map(_host_float, given)):
            args, kwargs = pytree.tree_map(_to_meta, (args, kwargs))
        return func(*args, **kwargs)


# The MoE experts' grouped products (transformers' `grouped_mm` experts), whose meta kernels
# take bfloat16 alone.
_GROUPED_MM = {
    f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f
}


def _host_float(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_floating_point() and t.dim() > 0


def _to_meta(t: Any) -> Any:
    return t.to(META) if isinstance(t, torch.Tensor) and _host_float(t) else t


def measure(run: Any) -> int:
    """Peak bytes `run()` allocates, without gradients, as on CUDA."""
    with torch.no_grad(), AsOnCuda(), PeakBytes() as peak:
        run()
    return peak.peak


def build(cls: Any, part_cfg: Any, dtype: torch.dtype) -> Any:
    """A part on the meta device, in eval mode."""
    with torch.device(META):
        module = cls._from_config(part_cfg, dtype=dtype)
    return module.eval().requires_grad_(False)


def _filled_cache(text_cfg: Any, rows: int, blocks: int, per_row: int, dtype: torch.dtype) -> Any:
    """A meta BlockCache with `rows` rows of `per_row` tokens each (the pool's blocks)."""
    from realtime_omni.models.qwen3_omni.cache import BlockCache

    cache = BlockCache.for_text_model(text_cfg, rows, blocks, dtype, META)
    for _ in range(rows):
        row = cache.alloc()
        if per_row and not cache.reserve(row, per_row + 1):
            raise ValueError(f"{rows} rows of {per_row} tokens do not fit {blocks} blocks")
        cache.lens[row] = per_row
    return cache


def _context(blocks: int, rows: int, text_cfg: Any) -> tuple[int, int]:
    """Tokens each of `rows` decode rows holds when they share the pool's `blocks` (one slot
    left for the token the step adds), and the most one row holds."""
    from realtime_omni.models.qwen3_omni.cache import BLOCK_TOKENS

    longest = int(text_cfg.max_position_embeddings)
    per_row = min(longest, blocks // rows * BLOCK_TOKENS - 1)
    return max(0, per_row), max(1, min(longest, blocks * BLOCK_TOKENS))


def thinker_step(
    thinker_cfg: Any, dtype: torch.dtype, rows: int, prefill_tokens: int, pool_blocks: int
) -> int:
    """The thinker's step (its `thinker_config`; towers left out as the stage leaves them)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

    text = thinker_cfg.text_config
    per_row, longest = _context(pool_blocks, rows, text)
    chunk = min(prefill_tokens, longest)

    def at(depth: int) -> tuple[int, int]:
        cfg = copy.deepcopy(thinker_cfg)
        cfg.text_config.num_hidden_layers = depth
        cfg.audio_config.encoder_layers = cfg.vision_config.depth = 1  # dropped below
        thinker = build(qo.Qwen3OmniMoeThinkerForConditionalGeneration, cfg, dtype)
        thinker.model.audio_tower = thinker.model.visual = None
        lm = thinker.model.language_model
        cache = _filled_cache(lm.config, rows, pool_blocks, per_row, dtype)
        long = _filled_cache(lm.config, 1, pool_blocks, longest - chunk, dtype)
        long.reserve(0, longest)

        def decode() -> None:  # thinker.py's `_decode`
            window = cache.decode(list(range(rows)))
            ids = torch.zeros(rows, 1, dtype=torch.long, device=META)
            pos = torch.zeros(3, rows, 1, dtype=torch.long, device=META)
            out = thinker(input_ids=ids, position_ids=pos, cache=window, blocks=window,
                          use_cache=True)  # fmt: skip
            out.logits[:, -1].float()

        def prefill() -> None:  # thinker.py's `_prefill_chunk`, speaking (hidden states kept)
            window = long.prefill(0, chunk)
            x = torch.empty(1, chunk, text.hidden_size, dtype=dtype, device=META)
            pos = torch.zeros(3, 1, chunk, dtype=torch.long, device=META)
            out = lm(inputs_embeds=x, position_ids=pos, cache=window, blocks=window,
                     use_cache=True, output_hidden_states=True)  # fmt: skip
            thinker.lm_head(out.last_hidden_state[0, -1:]).float()

        return measure(decode), measure(prefill)

    return max(_deep(at, int(text.num_hidden_layers)))


def talker_step(
    talker_cfg: Any, dtype: torch.dtype, rows: int, prompt_rows: int, pool_blocks: int
) -> int:
    """The talker's step (its `talker_config`); the code predictor's fused weights
    (`code_predictor_bytes`) are not in the figure."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

    from realtime_omni.models.qwen3_omni.code_predictor import CodePredictorLoop

    text = talker_cfg.text_config
    per_row, longest = _context(pool_blocks, rows, text)
    width = int(text.hidden_size)
    n = max(1, min(prompt_rows, longest))

    def at(depth: int) -> tuple[int, int]:
        cfg = copy.deepcopy(talker_cfg)
        cfg.text_config.num_hidden_layers = depth
        talker = build(qo.Qwen3OmniMoeTalkerForConditionalGeneration, cfg, dtype)
        cache = _filled_cache(talker.model.config, rows, pool_blocks, per_row, dtype)
        fresh = _filled_cache(talker.model.config, 1, pool_blocks, 0, dtype)
        fresh.reserve(0, n)

        def forward(x: torch.Tensor, window: Any) -> Any:  # talker.py's `_forward`
            pos = torch.zeros(3, x.shape[0], x.shape[1], dtype=torch.long, device=META)
            return talker(
                inputs_embeds=x, position_ids=pos, cache=window, blocks=window, use_cache=True,
                output_hidden_states=True, generation_step=0,
            )  # fmt: skip

        def decode() -> None:
            x = torch.empty(rows, 1, width, dtype=dtype, device=META)
            out = forward(x, cache.decode(list(range(rows))))
            out.logits[:, -1].float()

        def prefill() -> None:
            out = forward(torch.empty(1, n, width, dtype=dtype, device=META), fresh.prefill(0, n))
            out.logits[0, -1].float()

        return measure(decode), measure(prefill)

    talker = build(qo.Qwen3OmniMoeTalkerForConditionalGeneration, _shallow(talker_cfg), dtype)
    loop = CodePredictorLoop(talker)

    def residuals() -> None:  # the frame's code predictor steps, the talker's output held
        hidden = torch.empty(rows, 1, width, dtype=dtype, device=META)
        code0 = torch.zeros(rows, dtype=torch.long, device=META)
        picks = []

        def pick(logits: torch.Tensor) -> torch.Tensor:
            # Its first step (2 positions) and second (1) allocate what every later one does
            # (the cache is preallocated; a step's attention reads a view of it): stop there.
            picks.append(logits.float().argmax(-1))
            if len(picks) == 2:
                raise _Enough
            return picks[-1]

        with contextlib.suppress(_Enough):
            loop.frame(hidden, code0, pick)

    return max(*_deep(at, int(text.num_hidden_layers)), measure(residuals))


class _Enough(Exception):
    """Raised out of a measured loop once the rest of it can only repeat what it did."""


def _deep(at: Any, layers: int) -> tuple[int, ...]:
    """`at(layers)`'s peaks, from `at(3)` and `at(4)`: the layers are alike, and what a forward
    holds grows by the same (a layer's hidden state) with each, wherever its peak falls."""
    if layers <= 4:
        return tuple(at(layers))
    a, b = at(3), at(4)
    return tuple(y + (layers - 4) * (y - x) for x, y in zip(a, b, strict=True))


def _shallow(talker_cfg: Any) -> Any:
    cfg = copy.deepcopy(talker_cfg)
    cfg.text_config.num_hidden_layers = 1
    return cfg


def code_predictor_bytes(talker: Any) -> int:
    """What `CodePredictorLoop` holds beside the talker's weights (its fused copies)."""
    from realtime_omni.models.qwen3_omni.code_predictor import CodePredictorLoop

    with torch.no_grad(), PeakBytes() as held:
        loop = CodePredictorLoop(talker)
    del loop
    return held.peak


def audio_step(audio_cfg: Any, dtype: torch.dtype, rows: int, mel_frames: int) -> int:
    """The audio tower (its config; measured at 2 layers: see the module docstring)."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

    cfg = audio_cfg.__class__(**{**audio_cfg.to_dict(), "encoder_layers": 2})
    tower = build(qo.Qwen3OmniMoeAudioEncoder, cfg, dtype)
    window = max(1, cfg.n_window_infer // (2 * cfg.n_window)) * 2 * cfg.n_window
    clip = [min(window, mel_frames - a) for a in range(0, mel_frames, window)]
    lengths = torch.tensor(clip * rows)

    def run() -> None:
        mel = torch.empty(cfg.num_mel_bins, mel_frames * rows, device=META)  # float32 in
        tower(mel.to(dtype), feature_lens=lengths, return_dict=True).last_hidden_state.clone()

    return measure(run)


def audio_window_bytes(audio_cfg: Any, dtype: torch.dtype) -> int:
    """One kept 8 s window's embeddings (the audio executor keeps `cache_windows` of them)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    window = max(1, audio_cfg.n_window_infer // (2 * audio_cfg.n_window)) * 2 * audio_cfg.n_window
    tokens = int(_get_feat_extract_output_lengths(torch.tensor(window)))
    return tokens * int(audio_cfg.output_dim) * dtype.itemsize


def image_side(patches: int, merge: int) -> int:
    """The side of the largest square grid of whole merge units within `patches` patches."""
    return max(merge, math.isqrt(patches) // merge * merge)


def image_step(vision: Any, dtype: torch.dtype, rows: int, side: int) -> int:
    """`vision` from `build(VisionEncoder)`: `rows` images of `side` x `side` patches."""
    patch = vision.config.in_channels * vision.config.temporal_patch_size
    patch *= vision.config.patch_size**2

    def run() -> None:  # encoders.py's `ImageEncoderExecutor._encode`
        grid = torch.tensor([[1, side, side]] * rows)
        pixels = torch.empty(rows * side * side, patch, device=META)  # float32 in
        out = vision(pixels.to(dtype), grid_thw=grid)
        torch.stack(list(out.deepstack_features))

    return measure(run)


def code2wav_step(code2wav: Any, rows: int, chunk_frames: int, left_context_frames: int) -> int:
    """`code2wav` from `build(Code2Wav)`, decoded as `vocoder.StreamingDecoder` does."""
    from realtime_omni.models.qwen3_omni.vocoder import StreamingDecoder

    decoder = StreamingDecoder(code2wav)
    groups = int(code2wav.config.num_quantizers)

    def run() -> None:
        codes = torch.zeros(rows, groups, left_context_frames + chunk_frames, device=META)
        # `decoder.hidden`'s two calls, with a cache: without one, transformers probes the
        # positions for packed sequences, a data-dependent branch meta tensors cannot take.
        x = code2wav.code_embedding(codes.long() + code2wav.code_offset).mean(1)
        hidden = code2wav.pre_transformer(inputs_embeds=x, use_cache=True).last_hidden_state
        decoder.decode(hidden[:, -chunk_frames:], [{} for _ in range(rows)]).float()

    return measure(run)
