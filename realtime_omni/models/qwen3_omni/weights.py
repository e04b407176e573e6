"""Where a stage's weights come from, and loading only its own part of them.

`model_dir(model)` resolves the config's `model` section: `model.path` names a local checkpoint
directory (the published Qwen3-Omni layout: `config.json` and safetensors shards); without it,
`model.tiny_seed` selects the tiny random-weight model, built on first use into `model.cache_dir`
(default `.cache/tiny-qwen3-omni-<seed>` under the repository root). Nothing is downloaded.

`load_part(dir, part, device, dtype)` builds one part's module with its parameters on the meta
device, reads only the tensors whose checkpoint keys start with the part's prefix (a progress bar
counts them), converts them the way transformers does for the full model (prefix renames, MoE
experts fused layer by layer on the host as they are read) and assigns them. Buffers are
computed at construction and moved to the device.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from realtime_omni.errors import ConfigError

PARTS = ("thinker", "audio_encoder", "image_encoder", "talker", "code2wav")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def model_dir(model: dict[str, Any]) -> Path:
    """The checkpoint directory the config's `model` section names; ConfigError if unusable."""
    path = model.get("path")
    if path:
        d = Path(str(path)).expanduser()
        fix = (
            "set model.path to a local Qwen3-Omni checkpoint directory (config.json and "
            "*.safetensors), or remove it and set model.tiny_seed for the tiny test model"
        )
        if not d.is_dir():
            raise ConfigError(f"model.path = {str(path)!r}: no such directory. Fix: {fix}")
        if not (d / "config.json").is_file() or not (_shards(d) or random_weights(d)):
            raise ConfigError(
                f"model.path = {str(path)!r}: not a Qwen3-Omni checkpoint (expected config.json "
                f"and model*.safetensors in it). Fix: {fix}"
            )
        return d
    seed = model.get("tiny_seed")
    if seed is None:
        raise ConfigError(
            "model.path is not set and neither is model.tiny_seed. Fix: set model.path to a "
            "local Qwen3-Omni checkpoint directory, or model.tiny_seed: 0 for the tiny model"
        )
    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny

    return ensure_tiny(int(seed), model.get("cache_dir"))


def load_config(d: Path) -> Any:
    """The full `Qwen3OmniMoeConfig` of a checkpoint, with the fix-ups config.json cannot carry."""
    from transformers import Qwen3OmniMoeConfig

    from realtime_omni.models.qwen3_omni.tiny import patch_config

    cfg = Qwen3OmniMoeConfig.from_pretrained(d)
    return patch_config(cfg)


def load_part(d: Path, part: str, device: str, dtype: Any, cfg: Any = None) -> Any:
    """One part of the model, in eval mode, on `device` with parameters in `dtype`.

    thinker: `Qwen3OmniMoeThinkerForConditionalGeneration` without its audio and vision towers
    (its forward then takes precomputed encoder outputs); audio_encoder / image_encoder: the
    towers; talker: `Qwen3OmniMoeTalkerForConditionalGeneration` with its code predictor;
    code2wav: `Qwen3OmniMoeCode2Wav`.
    """
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    cfg = cfg or load_config(d)
    tc = cfg.thinker_config
    build: dict[str, tuple[Any, Any, str]] = {
        "thinker": (m.Qwen3OmniMoeThinkerForConditionalGeneration, tc, "thinker."),
        "audio_encoder": (m.Qwen3OmniMoeAudioEncoder, tc.audio_config, "thinker.audio_tower."),
        "image_encoder": (m.Qwen3OmniMoeVisionEncoder, tc.vision_config, "thinker.visual."),
        "talker": (m.Qwen3OmniMoeTalkerForConditionalGeneration, cfg.talker_config, "talker."),
        "code2wav": (m.Qwen3OmniMoeCode2Wav, cfg.code2wav_config, "code2wav."),
    }
    if part not in build:
        raise ValueError(f"unknown part {part!r}; one of {PARTS}")
    cls, part_cfg, prefix = build[part]
    if random_weights(d):
        return _random_part(cls, part_cfg, part, device, dtype)
    with _params_on_meta():
        module = cls._from_config(part_cfg)
    skip: tuple[str, ...] = ()
    if part == "thinker":
        # The encoders run as stages of their own; the thinker takes their outputs.
        module.model.audio_tower = None
        module.model.visual = None
        skip = ("thinker.audio_tower.", "thinker.visual.")
    state = _read(d, prefix, skip, device, dtype, part)
    expected = set(module.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ConfigError(
            f"model.path = {str(d)!r}: the {part} weights do not fit the model config "
            f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}). Fix: point "
            "model.path at a complete Qwen3-Omni checkpoint whose config.json matches its weights"
        )
    module.load_state_dict(state, assign=True, strict=True)
    for name, buf in list(module.named_buffers()):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        owner._buffers[name.rpartition(".")[2]] = buf.to(device)
    return module.eval().requires_grad_(False)


RANDOM = "random_weights.json"  # a checkpoint directory with it holds only the config


def random_weights(d: Path) -> bool:
    """Whether `d` is a config without weights, for measuring a model's sizes (`benchmarks/
    batch_steps.py` writes one): every part is built with random weights on its device."""
    return (d / RANDOM).is_file()


def _random_part(cls: Any, part_cfg: Any, part: str, device: str, dtype: Any) -> Any:
    import torch

    with torch.device(device):
        module = cls._from_config(part_cfg, dtype=dtype)
    if part == "thinker":
        module.model.audio_tower = None
        module.model.visual = None
    return module.eval().requires_grad_(False)


def read_rows(d: Path, key: str, rows: list[int], device: str, dtype: Any) -> Any:
    """Rows of one 2-D checkpoint tensor (e.g. a few thinker embeddings the talker needs)."""
    import torch
    from safetensors import safe_open

    if random_weights(d):
        width = json.loads((d / RANDOM).read_text())["widths"][key]
        gen = torch.Generator().manual_seed(len(rows))
        return torch.randn(len(rows), width, generator=gen).to(device=device, dtype=dtype)

    for shard in _shards(d):
        with safe_open(str(shard), "pt") as f:
            if key in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                sl = f.get_slice(key)
                t = torch.stack([sl[r : r + 1][0] for r in rows])
                return t.to(device=device, dtype=dtype)
    raise ConfigError(f"model.path = {str(d)!r}: no tensor {key!r}. Fix: use a full checkpoint")


def _shards(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    return sorted(d.glob("*.safetensors"))


def _read(d: Path, prefix: str, skip: tuple[str, ...], device: str, dtype: Any, part: str) -> dict:
    """The part's tensors under module keys, converted as transformers converts them for the
    full model (prefix renames; each MoE layer's per-expert projections fused into
    `gate_up_proj` and `down_proj`). Experts are gathered on the host and fused layer by
    layer as soon as a layer's last one is read, then moved to `device`: the device never holds
    the unfused copy, the host at most one layer of it (Qwen3-Omni-30B-A3B: ~0.4 GB a thinker
    layer against ~60 GB of fused experts)."""
    from safetensors import safe_open
    from tqdm import tqdm

    def module_key(key: str) -> str:
        k = key[len(prefix) :]
        if part == "thinker" and k.startswith("model.") and not k.startswith("model.language_"):
            k = "model.language_model." + k[len("model.") :]
        return k

    def convert(t: Any, to: str) -> Any:
        return t.to(device=to, dtype=dtype if t.is_floating_point() else None)

    shards = _shards(d)
    keys: dict[Path, list[str]] = {}
    layer_size: dict[str, int] = {}  # expert tensors per fused layer
    for shard in shards:
        with safe_open(str(shard), "pt", device="cpu") as f:
            keys[shard] = [k for k in f.keys() if k.startswith(prefix) and not k.startswith(skip)]  # noqa: SIM118
        for key in keys[shard]:
            if hit := _EXPERT.match(module_key(key)):
                layer_size[hit[1]] = layer_size.get(hit[1], 0) + 1
    out: dict = {}
    pending: dict[str, dict[tuple[str, int], Any]] = {}
    with tqdm(desc=f"loading {part}", unit=" tensors", leave=False) as bar:
        for shard in shards:
            with safe_open(str(shard), "pt", device="cpu") as f:
                for key in keys[shard]:
                    k = module_key(key)
                    hit = _EXPERT.match(k)
                    if hit is None:
                        out[k] = convert(f.get_tensor(key), device)
                    else:
                        layer = pending.setdefault(hit[1], {})
                        layer[(hit[3], int(hit[2]))] = convert(f.get_tensor(key), "cpu")
                        if len(layer) == layer_size[hit[1]]:
                            out.update(_fuse(hit[1], pending.pop(hit[1]), device))
                    bar.update()
    if pending:
        raise ConfigError(
            f"model.path = {str(d)!r}: the experts of {sorted(pending)[:2]} are incomplete. "
            "Fix: point model.path at a complete Qwen3-Omni checkpoint"
        )
    return out


def _fuse(base: str, experts: dict[tuple[str, int], Any], device: str) -> dict:
    """One MoE layer's experts as the fused module keys: gate and up stacked and joined."""
    import torch

    n = 1 + max(i for _, i in experts)
    stack = {p: torch.stack([experts.pop((p, i)) for i in range(n)]) for p in _PROJ}
    return {
        base + ".gate_up_proj": torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1).to(device),
        base + ".down_proj": stack["down_proj"].to(device),
    }


_PROJ = ("gate_proj", "up_proj", "down_proj")


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Construct modules with parameters on the meta device (no memory, no init) while buffers
    (rotary frequencies, code offsets) are computed for real."""
    import torch
    from torch import nn

    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Any) -> None:
        original(self, name, param)
        if param is not None:
            p = self._parameters[name]
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
