"""Per-request token sampling: greedy at temperature 0, else temperature, top-k and top-p with
the request's own seeded generator (two requests never share random state)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


def checkpoint_defaults(d: Path) -> dict[str, Any]:
    """What the checkpoint's `generation_config.json` says of sampling, as `generate` reads it:
    the thinker's `temperature`, `top_p`, `top_k` (greedy unless `do_sample`) and
    `eos_token_ids`; the talker's `talker_*` fields where the file has them. Empty without one."""
    path = d / "generation_config.json"
    if not path.is_file():
        return {}
    gc = json.loads(path.read_text())
    out: dict[str, Any] = {}
    if "do_sample" in gc:
        if gc["do_sample"]:
            out["temperature"] = float(gc.get("temperature", 1.0))
            out["top_p"] = float(gc.get("top_p", 1.0))
            out["top_k"] = int(gc.get("top_k", 50))
        else:
            out["temperature"] = 0.0
    eos = gc.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if f"talker_{key}" in gc:
            out[f"talker_{key}"] = gc[f"talker_{key}"]
    return out


@dataclass
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], prefix: str = "", **defaults: Any) -> Sampler:
        def get(name: str) -> Any:
            return meta.get(prefix + name, defaults.get(name, getattr(cls, name)))

        s = cls(float(get("temperature")), float(get("top_p")), int(get("top_k")), get("seed"))
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
            raise ValueError(f"bad sampling parameters {s}")
        return s

    def pick(self, logits: torch.Tensor) -> int:
        """One token id from `logits` [vocab] (float)."""
        return int(self.pick_tensor(logits))

    def pick_tensor(self, logits: torch.Tensor) -> torch.Tensor:
        """The token id as a 0-d tensor on the logits' device: no host sync."""
        return pick_batch([self], logits[None])[0]

    def uniform(self, device: torch.device) -> torch.Tensor:
        """One draw in [0, 1) from this request's own generator."""
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.seed is not None:
                self.generator.manual_seed(int(self.seed))
            else:
                self.generator.seed()
        return torch.rand((), generator=self.generator, device=device)


def pick_batch(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Token ids [n] for `logits` [n, vocab], row i with `samplers[i]`, in a handful of batched
    ops and without a host sync. A row's pick depends only on its logits and its own generator
    (one uniform draw per pick, inverse CDF over the tokens top-k and top-p keep), so it is the
    same whichever rows it is batched with."""
    logits = logits.float()
    hot = [i for i, s in enumerate(samplers) if s.temperature > 0]
    if not hot:
        return logits.argmax(-1)
    device = logits.device
    chosen = [samplers[i] for i in hot]
    vocab = logits.shape[-1]
    temps = torch.tensor([s.temperature for s in chosen], device=device)
    ks_host = [min(s.top_k or vocab, vocab) for s in chosen]
    rows = logits if len(hot) == len(samplers) else logits[hot]
    # Only the best max(top_k) tokens can be kept: a top-k beats sorting the whole vocabulary.
    x, order = torch.topk(rows / temps[:, None], max(ks_host), dim=-1)
    if min(ks_host) < max(ks_host):  # rows that keep fewer than the batch's widest top-k
        ks = torch.tensor(ks_host, device=device)
        kth = x.gather(1, (ks - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if any(s.top_p < 1 for s in chosen):  # keep the smallest set reaching top_p
        top_p = torch.tensor([s.top_p for s in chosen], device=device)[:, None]
        cut = (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
        probs = x.masked_fill(cut, float("-inf")).softmax(-1)
    cdf = probs.cumsum(-1)
    u = torch.stack([s.uniform(device) for s in chosen])
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_max(x.shape[-1] - 1)
    picked = order.gather(1, idx)[:, 0]
    if len(hot) == len(samplers):
        return picked
    out = logits.argmax(-1)
    out[hot] = picked
    return out


def special_token_id(d: Path, content: str) -> int | None:
    """The id of an added token (`<tool_call>`, say) in the checkpoint's `tokenizer.json`."""
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    for tok in json.loads(path.read_text()).get("added_tokens", []):
        if tok.get("content") == content:
            return int(tok["id"])
    return None
