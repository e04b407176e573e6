"""Where a stage's weights come from, and loading only its own part of them.

`model_dir(model)` resolves the config's `model` section: `model.path` names a local checkpoint
directory (the published Qwen3-Omni layout: `config.json` and safetensors shards); without it,
`model.tiny_seed` selects the tiny random-weight model (tiny.py) and `model.real_width_seed` the
random-weight model at the published widths with 2 layers per stack (real_width.py), each built
on first use into `model.cache_dir` (default under `.cache/` in the repository root) in the
published layout, and read from there as a checkpoint is. Nothing is downloaded.

`load_part(dir, part, device, dtype)` builds one part's module with its parameters on the meta
device, reads only the tensors whose checkpoint keys start with the part's prefix (a progress bar
counts them) into place, converting them the way transformers does for the full model (prefix
renames, MoE experts fused: each expert read into its slot of the layer's fused tensors), and
assigns them: loading holds the part and one tensor more, never a copy of it (`_read`). Buffers
are computed at construction and moved to the device.
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
# Each part's checkpoint keys: their prefix, and the prefixes under it that are other parts'.
PREFIXES: dict[str, tuple[str, tuple[str, ...]]] = {
    "thinker": ("thinker.", ("thinker.audio_tower.", "thinker.visual.")),
    "audio_encoder": ("thinker.audio_tower.", ()),
    "image_encoder": ("thinker.visual.", ()),
    "talker": ("talker.", ()),
    "code2wav": ("code2wav.", ()),
}
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
    if model.get("real_width_seed") is not None:
        from realtime_omni.models.qwen3_omni.real_width import ensure_real_width

        return ensure_real_width(int(model["real_width_seed"]), model.get("cache_dir"))
    seed = model.get("tiny_seed")
    if seed is None:
        raise ConfigError(
            "model.path is not set and neither is model.tiny_seed. Fix: set model.path to a "
            "local Qwen3-Omni checkpoint directory, or model.tiny_seed: 0 for the tiny model "
            "(model.real_width_seed: 0 for the real widths at 2 layers a stack)"
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
    build: dict[str, tuple[Any, Any]] = {
        "thinker": (m.Qwen3OmniMoeThinkerForConditionalGeneration, tc),
        "audio_encoder": (m.Qwen3OmniMoeAudioEncoder, tc.audio_config),
        "image_encoder": (m.Qwen3OmniMoeVisionEncoder, tc.vision_config),
        "talker": (m.Qwen3OmniMoeTalkerForConditionalGeneration, cfg.talker_config),
        "code2wav": (m.Qwen3OmniMoeCode2Wav, cfg.code2wav_config),
    }
    if part not in build:
        raise ValueError(f"unknown part {part!r}; one of {PARTS}")
    cls, part_cfg = build[part]
    prefix, skip = PREFIXES[part]
    if random_weights(d):
        return _random_part(cls, part_cfg, part, device, dtype)
    with _params_on_meta():
        module = cls._from_config(part_cfg)
    if part == "thinker":
        # The encoders run as stages of their own; the thinker takes their outputs.
        module.model.audio_tower = None
        module.model.visual = None
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


def part_bytes(d: Path, part: str, dtype: Any) -> int:
    """The bytes of the part's parameters as `load_part` holds them, from the checkpoint's
    shard headers alone: floating point tensors in `dtype`, the others as stored."""
    import torch

    prefix, skip = PREFIXES[part]
    total = 0
    for path in _shards(d):
        shard = _Shard(path)
        for key in shard.names():
            if key.startswith(prefix) and not key.startswith(skip):
                stored = getattr(torch, _Shard._DTYPES[shard.entries[key]["dtype"]])
                size = dtype.itemsize if stored.is_floating_point else stored.itemsize
                total += size * int(torch.Size(shard.shape(key)).numel())
    return total


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
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]).

    Read into place: a layer's fused tensors are allocated when its first expert is read and
    each expert is read into its slot; every other tensor is read into a tensor of its own.
    Shards are read with plain reads, not mapped (a mapped shard's pages count in the process's
    RSS while it is open: up to a whole shard, ~4 GB in the published checkpoint), so loading
    holds the part plus at most one tensor (one staging copy where the device or dtype
    differs from the checkpoint's). benchmarks/real_width.py measures it."""
    import torch
    from tqdm import tqdm

    def module_key(key: str) -> str:
        k = key[len(prefix) :]
        if part == "thinker" and k.startswith("model.") and not k.startswith("model.language_"):
            k = "model.language_model." + k[len("model.") :]
        return k

    shards = {shard: _Shard(shard) for shard in _shards(d)}
    keys: dict[Path, list[str]] = {}
    expected: dict[str, int] = {}  # expert tensors per fused layer
    experts: dict[str, int] = {}  # experts per fused layer
    for path, shard in shards.items():
        keys[path] = [k for k in shard.names() if k.startswith(prefix) and not k.startswith(skip)]
        for key in keys[path]:
            if hit := _EXPERT.match(module_key(key)):
                expected[hit[1]] = expected.get(hit[1], 0) + 1
                experts[hit[1]] = max(experts.get(hit[1], 0), int(hit[2]) + 1)
    incomplete = sorted(b for b, n in expected.items() if n != len(_PROJ) * experts[b])
    if incomplete:
        raise ConfigError(
            f"model.path = {str(d)!r}: the experts of {incomplete[:2]} are incomplete. "
            "Fix: point model.path at a complete Qwen3-Omni checkpoint"
        )
    out: dict = {}
    fused: dict[str, dict[str, Any]] = {}  # layer -> its fused tensors while being filled
    filled: dict[str, int] = {}
    with tqdm(desc=f"loading {part}", unit=" tensors", leave=False) as bar:
        for path, shard in shards.items():
            with shard:
                for key in keys[path]:
                    k = module_key(key)
                    hit = _EXPERT.match(k)
                    bar.update()
                    if hit is None:
                        out[k] = shard.read(key, device, dtype)
                        continue
                    base, e, proj = hit[1], int(hit[2]), hit[3]
                    rows, cols = shard.shape(key)
                    layer = fused.setdefault(base, {})
                    name = "down_proj" if proj == "down_proj" else "gate_up_proj"
                    if name not in layer:
                        per_expert = rows if name == "down_proj" else 2 * rows
                        shape = (experts[base], per_expert, cols)
                        layer[name] = torch.empty(shape, dtype=dtype, device=device)
                    slot = layer[name][e]
                    if proj == "gate_proj":
                        slot = slot[:rows]
                    elif proj == "up_proj":
                        slot = slot[rows:]
                    shard.read_into(key, slot)
                    filled[base] = filled.get(base, 0) + 1
                    if filled[base] == expected[base]:
                        out.update({f"{base}.{n}": v for n, v in fused.pop(base).items()})
    return out


class _Shard:
    """One safetensors file, read tensor by tensor with plain reads into memory the caller
    keeps (see `_read`). Use as a context manager around the reads."""

    _DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
               "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
               "BOOL": "bool"}  # fmt: skip

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            self.entries: dict[str, Any] = json.loads(f.read(n))
        self.entries.pop("__metadata__", None)
        self.base = 8 + n
        self._file: Any = None

    def __enter__(self) -> _Shard:
        self._file = self.path.open("rb", buffering=0)
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()
        self._file = None

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key]["shape"])

    def read(self, key: str, device: str, dtype: Any) -> Any:
        """The tensor, floating point ones in `dtype`, on `device`."""
        import torch

        entry = self.entries[key]
        stored = getattr(torch, self._DTYPES[entry["dtype"]])
        want = dtype if stored.is_floating_point else stored
        on_host = torch.device(device).type == "cpu"
        t = torch.empty(entry["shape"], dtype=want if on_host else stored)
        self.read_into(key, t)
        return t if on_host else t.to(device=device, dtype=want)

    def read_into(self, key: str, out: Any) -> None:
        """Read the tensor into `out` (its shape; any dtype and device: converted on the way
        through a host copy where `out` is not a contiguous host tensor of the stored dtype)."""
        import torch

        entry = self.entries[key]
        stored = getattr(torch, self._DTYPES[entry["dtype"]])
        direct = out.dtype == stored and out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(entry["shape"], dtype=stored)
        start, end = entry["data_offsets"]
        buf = dst.reshape(-1).view(torch.uint8).numpy()
        if len(buf) != end - start or list(dst.shape) != list(entry["shape"]):
            raise ConfigError(f"{self.path}: tensor {key!r} does not have the size its header says")
        self._file.seek(self.base + start)
        done = 0
        while done < len(buf):
            n = self._file.readinto(buf[done:])
            if not n:
                raise ConfigError(f"{self.path}: truncated at tensor {key!r}")
            done += n
        if not direct:
            out.copy_(dst)


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
            assert p is not None  # registered just now
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
