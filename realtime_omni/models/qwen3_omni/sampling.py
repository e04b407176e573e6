"""Per-request token sampling: greedy at temperature 0, else temperature, top-k and top-p with
the request's own seeded generator (two requests never share random state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
        """The token id as a 0-d tensor on the logits' device: no host sync, so a batch's picks
        can be read back together."""
        if self.temperature == 0:
            return logits.argmax(-1)
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device)
            if self.seed is not None:
                self.generator.manual_seed(int(self.seed))
            else:
                self.generator.seed()
        x = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(x, min(self.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1:
            sorted_x, order = torch.sort(x, descending=True)
            cum = sorted_x.softmax(-1).cumsum(-1)
            cut = cum - sorted_x.softmax(-1) >= self.top_p  # keep the smallest set reaching top_p
            x = x.masked_fill(cut.scatter(0, order, cut), float("-inf"))  # no host sync
        probs = x.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.generator)[0]
