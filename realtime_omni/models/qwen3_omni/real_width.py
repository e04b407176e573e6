"""Qwen3-Omni-30B-A3B at its published widths and 2 layers per stack, random bf16 weights.

`ensure_real_width(seed, cache_dir)` returns a checkpoint directory in the published layout
(`config.json`, `model-0000k-of-0000n.safetensors` shards with `model.safetensors.index.json`,
the checkpoint's key names: per-expert `...mlp.experts.<e>.{gate,up,down}_proj.weight`,
`thinker.audio_tower.*`, `thinker.visual.*`, `thinker.model.*`, `talker.*`, `code2wav.*`), built
on first use under `.cache/` like the tiny model (tiny.py) and read by the same `weights.py`
path a real checkpoint takes. Nothing is downloaded.

Every width, head count, expert count, vocabulary, codebook and code2wav's upsampling is the
published model's (PUBLISHED below); only the depths change: 2 layers in the thinker, talker,
code predictor, audio encoder, vision encoder and code2wav's pre-transformer. What the depth
forces: `accept_hidden_layer` 24 of 48 becomes 1 of 2 (the middle, as published), and the vision
tower's deepstack taps [8, 16, 24] of 27 blocks become [0, 1] (one per block; the thinker adds
them after its layers 0 and 1 as it adds the published three after 0, 1 and 2). 2.6 B
parameters, 5.2 GB in bf16: the thinker's 2 layers of 128 experts are 2.4 GB, its embedding and
lm_head 0.6 GB each.

Where the values come from. transformers' own `Qwen3OmniMoe*Config` defaults (5.24) match the
published config for the audio and vision towers (but their output width), the code predictor
(but its code groups), code2wav, and the thinker's and talker's widths, KV heads, experts and
expert widths; they differ, and are set here as published, in: the thinker's vocabulary
(3,584 -> 152,064), layers and query heads (28 -> 48, 32), head_dim (unset -> 128) and
intermediate_size (18,944 -> 768, unused: every layer is MoE); the encoders' output width
(3,584 -> 2,048); the talker's experts per token (8 -> 6), norm_topk_prob (false -> true), shared
expert (undeclared -> 768) and head_dim (128); num_code_groups (32 -> 16); the codec ids
(4196.. -> 2148..2157) and speakers; accept_hidden_layer (18 -> 24); position_id_per_seconds
(25 -> 13); the audio token ids (151646 / 151647 -> 151675 / 151669); max_position_embeddings
(32,768 -> 65,536).

Each published value was checked against two public copies of Qwen/Qwen3-Omni-30B-A3B-Instruct's
config.json found with the code search tools (a dump of the config as transformers 5.7 loaded it
from the checkpoint, and an inline copy of the released config.json in a third-party Rust
parser's tests), which agree with each other and with the project's reference notes (48 layers,
2,048 wide, head_dim 128, 128 experts top-8, vocab 152,064; talker 20 layers, 1,024 wide, 128
experts top-6 plus a shared expert; code predictor 5 layers; code2wav 8 layers, window 72; 16
codebooks of 2,048; upsampling (8,5,4,3)x(2,2)). Token ids are the real ones (special tokens
151643..151675, roles system 8948, user 872, assistant 77091): the tokenizer is tiny.py's
byte-level BPE with its special tokens and role words moved to those ids, so every id a prompt
holds is one the real checkpoint gives it meaning to; ids nothing maps to decode to nothing.

Weights: transformers' init scheme (normal layers std `initializer_range` 0.02, norms 1,
biases 0, code2wav's layer scales 0.01, ConvNeXt gammas 1e-6, SnakeBeta 0) but drawn as uniform
bytes scaled to that std (numpy's generator, ~1.7 ns a weight, where a bf16 `normal_` takes
~11 ns: 30 s for this model) and written tensor by tensor in bf16: the build never holds more
than one shard (SHARD_BYTES), and no fp32 copy of anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from realtime_omni.models.qwen3_omni.tiny import (
    CHAT_TEMPLATE,
    MARKER,
    REPO_ROOT,
    SPEAKERS,
    SPECIAL_TOKENS,
    _save_processor_files,
    build_tokenizer,
    ensure_built,
    set_text_ends,
)

VERSION = 1  # bumped when what is built changes
LAYERS = 2  # per stack
SHARD_BYTES = 1 << 30  # a thinker layer's experts (1.2 GB) straddle shards, as in real ones

# Real ids: the added tokens from <|endoftext|> = 151643 on, in tiny.py's order (the
# checkpoint's), and the role words of Qwen's vocabulary.
IDS = {tok: 151643 + i for i, tok in enumerate(SPECIAL_TOKENS)}
ROLE_IDS = {"system": 8948, "user": 872, "assistant": 77091}

_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20],
          "interleaved": True}  # fmt: skip

# The published config (Qwen3-Omni-30B-A3B-Instruct), the fields that shape the model; depths
# as published. `real_config_dict` reduces the depths.
PUBLISHED: dict[str, Any] = dict(
    thinker_config=dict(
        audio_config=dict(
            num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20,
            encoder_ffn_dim=5120, d_model=1280, max_source_positions=1500, n_window=50,
            output_dim=2048, n_window_infer=800, conv_chunksize=500, downsample_hidden_size=480,
            activation_function="gelu", initializer_range=0.02,
        ),
        vision_config=dict(
            depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
            num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
            hidden_act="gelu_pytorch_tanh", initializer_range=0.02,
        ),
        text_config=dict(
            vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            max_position_embeddings=65536, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rms_norm_eps=1e-6, hidden_act="silu", rope_parameters=dict(_MROPE),
            initializer_range=0.02,
        ),
        audio_token_id=IDS["<|audio_pad|>"], image_token_id=IDS["<|image_pad|>"],
        video_token_id=IDS["<|video_pad|>"], audio_start_token_id=IDS["<|audio_start|>"],
        audio_end_token_id=IDS["<|audio_end|>"], vision_start_token_id=IDS["<|vision_start|>"],
        vision_end_token_id=IDS["<|vision_end|>"], user_token_id=ROLE_IDS["user"],
        position_id_per_seconds=13, seconds_per_chunk=2, initializer_range=0.02,
    ),
    talker_config=dict(
        text_config=dict(
            vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20,
            num_attention_heads=16, num_key_value_heads=2, head_dim=128,
            max_position_embeddings=65536, moe_intermediate_size=384, num_experts=128,
            num_experts_per_tok=6, norm_topk_prob=True, shared_expert_intermediate_size=768,
            decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, hidden_act="silu",
            rope_parameters=dict(_MROPE), initializer_range=0.02,
        ),
        code_predictor_config=dict(
            vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=32768, rms_norm_eps=1e-6, num_code_groups=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, initializer_range=0.02,
        ),
        num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24,
        codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156,
        codec_think_eos_id=2157, codec_pad_id=2148, codec_bos_id=2149, speaker_id=dict(SPEAKERS),
        spatial_merge_size=2, audio_token_id=IDS["<|audio_pad|>"],
        image_token_id=IDS["<|image_pad|>"], video_token_id=IDS["<|video_pad|>"],
        audio_start_token_id=IDS["<|audio_start|>"], audio_end_token_id=IDS["<|audio_end|>"],
        vision_start_token_id=IDS["<|vision_start|>"], position_id_per_seconds=13,
        seconds_per_chunk=2, initializer_range=0.02,
    ),
    code2wav_config=dict(
        codebook_size=2048, hidden_size=1024, max_position_embeddings=8000,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_attention_heads=16,
        num_key_value_heads=16, sliding_window=72, intermediate_size=3072, num_hidden_layers=8,
        num_quantizers=16, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
        decoder_dim=1536, layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
        initializer_range=0.02,
    ),
    enable_audio_output=True, im_start_token_id=IDS["<|im_start|>"],
    im_end_token_id=IDS["<|im_end|>"], tts_pad_token_id=IDS["<tts_pad>"],
    tts_bos_token_id=IDS["<tts_text_bos>"], tts_eos_token_id=IDS["<tts_text_eos>"],
    system_token_id=ROLE_IDS["system"], user_token_id=ROLE_IDS["user"],
    assistant_token_id=ROLE_IDS["assistant"], initializer_range=0.02,
)  # fmt: skip


def default_dir(seed: int, layers: int = LAYERS) -> Path:
    depth = "" if layers == LAYERS else f"-{layers}l"
    return REPO_ROOT / ".cache" / f"real-width-qwen3-omni-{VERSION}-{seed}{depth}"


def ensure_real_width(
    seed: int, cache_dir: str | os.PathLike[str] | None = None, layers: int = LAYERS
) -> Path:
    """The checkpoint directory for `seed` at `layers` layers per stack, built on first use
    (2 layers: about 25 s and 5.2 GB on disk; concurrent callers wait for one build, as
    `ensure_tiny`'s do)."""
    out = Path(cache_dir) if cache_dir else default_dir(seed, layers)
    return ensure_built(out, lambda tmp: build_real_width(seed, tmp, layers))


def real_config_dict(layers: int | None = LAYERS) -> dict[str, Any]:
    """PUBLISHED with at most `layers` layers per stack (None: the published depths), as
    `Qwen3OmniMoeConfig(**d)` takes it. A stack keeps its published depth where `layers` reaches
    it (the code predictor's 5, code2wav's 8, ...), and with it its published taps: the vision
    tower's deepstack indexes and the talker's `accept_hidden_layer`."""
    d = json.loads(json.dumps(PUBLISHED))
    if layers is None:
        return d
    thinker, talker = d["thinker_config"], d["talker_config"]
    stacks = [
        (thinker["text_config"], "num_hidden_layers"),
        (thinker["audio_config"], "encoder_layers"),
        (thinker["vision_config"], "depth"),
        (talker["text_config"], "num_hidden_layers"),
        (talker["code_predictor_config"], "num_hidden_layers"),
        (d["code2wav_config"], "num_hidden_layers"),
    ]
    for stack, key in stacks:
        stack[key] = min(layers, stack[key])
    vision = thinker["vision_config"]
    if vision["depth"] < PUBLISHED["thinker_config"]["vision_config"]["depth"]:
        vision["deepstack_visual_indexes"] = list(range(min(vision["depth"], 3)))
    depth = thinker["text_config"]["num_hidden_layers"]
    if depth < PUBLISHED["thinker_config"]["text_config"]["num_hidden_layers"]:
        talker["accept_hidden_layer"] = max(1, depth // 2)  # published: 24 of 48
    return d


def published_depth() -> int:
    """The deepest stack's published depth: `real_config_dict` of this is PUBLISHED."""
    return int(PUBLISHED["thinker_config"]["text_config"]["num_hidden_layers"])


def checkpoint_bytes(layers: int | None) -> int:
    """The bf16 checkpoint's tensor bytes at `layers` layers per stack (a meta-device model:
    no memory, well under a second)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(build_config(layers))
    return 2 * sum(p.numel() for p in model.parameters())


def deepest_fitting(budget_bytes: int) -> int:
    """The most layers per stack whose checkpoint fits in `budget_bytes` (at least 1)."""
    lo, hi = 1, published_depth()
    while lo < hi:  # checkpoint_bytes grows with the depth
        mid = (lo + hi + 1) // 2
        if checkpoint_bytes(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def build_config(layers: int | None = LAYERS) -> Any:
    from transformers import Qwen3OmniMoeConfig

    cfg = Qwen3OmniMoeConfig(**real_config_dict(layers))
    set_text_ends(cfg, eos=IDS["<|im_end|>"], pad=IDS["<|endoftext|>"])
    return cfg


def build_real_width(seed: int, out_dir: str | os.PathLike[str], layers: int = LAYERS) -> None:
    """Write the checkpoint, tokenizer and processor files into `out_dir`."""
    import numpy as np
    import torch
    from safetensors import safe_open
    from transformers import Qwen3OmniMoeForConditionalGeneration

    out = Path(out_dir)
    cfg = build_config(layers)
    with torch.device("meta"):  # names, shapes and module classes; no memory
        model = Qwen3OmniMoeForConditionalGeneration(cfg)
    rng = np.random.default_rng(seed)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for key, tensor in checkpoint_tensors(model, rng):
        if size + tensor.nbytes > SHARD_BYTES and shards[-1]:
            _write_shard(out, len(shards), shards[-1])
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    _write_shard(out, len(shards), shards[-1])
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(1, n + 1):  # temporary names -> the published pattern, now n is known
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(out / f"part-{i}.safetensors", out / name)
        with safe_open(str(out / name), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                weight_map[k] = name
        total += (out / name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg.save_pretrained(out)
    tokenizer = build_tokenizer(IDS, ROLE_IDS)
    tokenizer.save_pretrained(out)
    _save_processor_files(out)
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    params = sum(p.numel() for p in model.parameters())
    (out / MARKER).write_text(json.dumps({"seed": seed, "params": params, "layers": layers}))


def _write_shard(out: Path, i: int, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(out / f"part-{i}.safetensors"), metadata={"format": "pt"})
    tensors.clear()


def checkpoint_key(name: str) -> str:
    """A parameter of `Qwen3OmniMoeForConditionalGeneration` -> its checkpoint key (for the
    fused experts, the key prefix of the per-expert tensors)."""
    for module, ckpt in (
        ("thinker.model.audio_tower.", "thinker.audio_tower."),
        ("thinker.model.visual.", "thinker.visual."),
        ("thinker.model.language_model.", "thinker.model."),
    ):
        if name.startswith(module):
            return ckpt + name[len(module) :]
    return name


def checkpoint_tensors(model: Any, rng: Any) -> Iterator[tuple[str, Any]]:
    """(checkpoint key, bf16 tensor) for every parameter of the meta-device `model`, in its
    order; fused experts come out as the checkpoint's per-expert projections."""
    import torch

    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        leaf = name.rpartition(".")[2]
        key = checkpoint_key(name)
        if leaf == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows
            experts, two_i, hidden = p.shape
            base = key[: -len(leaf)]
            for e in range(experts):
                yield f"{base}{e}.gate_proj.weight", _random((two_i // 2, hidden), rng)
                yield f"{base}{e}.up_proj.weight", _random((two_i // 2, hidden), rng)
        elif leaf == "down_proj" and p.dim() == 3:  # [E, H, I]
            base = key[: -len(leaf)]
            for e in range(p.shape[0]):
                yield f"{base}{e}.down_proj.weight", _random(tuple(p.shape[1:]), rng)
        else:
            value = _constant(owner, leaf, model.config)
            if value is None:
                yield key, _random(tuple(p.shape), rng)
            else:
                yield key, torch.full(tuple(p.shape), value, dtype=torch.bfloat16)


def _constant(owner: Any, leaf: str, cfg: Any) -> float | None:
    """transformers' constant initial value of a parameter, or None for a random one."""
    kind = type(owner).__name__
    if leaf == "bias":
        return 0.0
    if "Norm" in kind:  # LayerNorm, the RMSNorms
        return 1.0
    if kind.endswith("LayerScale"):
        return float(cfg.code2wav_config.layer_scale_initial_scale)
    if "SnakeBeta" in kind:
        return 0.0
    if leaf == "gamma":  # ConvNeXt block
        return 1e-6
    return None


_UNIFORM_BYTE_STD = 256 / 12**0.5  # a uniform int8's standard deviation


def _random(shape: tuple[int, ...], rng: Any, std: float = 0.02) -> Any:
    """Uniform random bf16 of standard deviation `std` (transformers' `initializer_range`)."""
    import numpy as np
    import torch

    n = int(np.prod(shape))
    words = rng.integers(0, 2**64 - 1, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    t = torch.from_numpy(words.view(np.int8)[:n]).to(torch.bfloat16)
    return t.mul_(std / _UNIFORM_BYTE_STD).reshape(shape)
