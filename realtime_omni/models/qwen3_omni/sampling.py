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

    def uniforms(self, n: int, device: torch.device) -> torch.Tensor:
        """The next `n` draws in [0, 1) from this request's own generator, in one call."""
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self.seed is not None:
                self.generator.manual_seed(int(self.seed))
            else:
                self.generator.seed()
        return torch.rand(n, generator=self.generator, device=device)


class BatchPicker:
    """Picks for a batch's rows, row i with `samplers[i]`, set up once for `picks` picks in a
    row (a talker frame: the code predictor's 15): the rows' parameters as tensors and each
    sampling row's `picks` draws, taken from its own generator in one call. A row's picks
    depend only on its logits and its own generator (one draw per pick, inverse CDF over the
    tokens top-k and top-p keep), so they are the same whichever rows it is batched with; and
    nothing reads back to the host."""

    def __init__(self, samplers: list[Sampler], device: torch.device, picks: int = 1) -> None:
        self.n = len(samplers)
        self.hot = [i for i, s in enumerate(samplers) if s.temperature > 0]
        self.picks, self.done = picks, 0
        if not self.hot:
            return
        chosen = [samplers[i] for i in self.hot]
        self.temps = torch.tensor([s.temperature for s in chosen], device=device)[:, None]
        self.top_ks = [s.top_k for s in chosen]
        self.top_p = None
        if any(s.top_p < 1 for s in chosen):
            self.top_p = torch.tensor([s.top_p for s in chosen], device=device)[:, None]
        self.draws = torch.stack([s.uniforms(picks, device) for s in chosen])  # [hot, picks]

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [n] for `logits` [n, vocab], in a handful of batched ops."""
        if self.done >= self.picks:
            raise RuntimeError(f"BatchPicker: all {self.picks} picks made")
        self.done += 1
        logits = logits.float()
        if not self.hot:
            return logits.argmax(-1)
        vocab = logits.shape[-1]
        ks_host = [min(k or vocab, vocab) for k in self.top_ks]
        rows = logits if len(self.hot) == self.n else logits[self.hot]
        # Only the best max(top_k) tokens can be kept; the temperature divides those alone
        # (the same quotients, in the same order: x / t keeps the order of x).
        x, order = _top_k(rows, max(ks_host))
        x = x / self.temps
        if min(ks_host) < max(ks_host):  # rows that keep fewer than the batch's widest top-k
            ks = torch.tensor(ks_host, device=x.device)
            kth = x.gather(1, (ks - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        probs = x.softmax(-1)
        if self.top_p is not None:  # keep the smallest set reaching top_p
            cut = (probs.cumsum(-1) - probs >= self.top_p) & (self.top_p < 1)
            probs = x.masked_fill(cut, float("-inf")).softmax(-1)
        cdf = probs.cumsum(-1)
        u = self.draws[:, self.done - 1 : self.done]
        idx = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_max(x.shape[-1] - 1)
        picked = order.gather(1, idx)[:, 0]
        if len(self.hot) == self.n:
            return picked
        out = logits.argmax(-1)
        out[self.hot] = picked
        return out


def pick_batch(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """Token ids [n] for `logits` [n, vocab], row i with `samplers[i]`: one `BatchPicker` pick."""
    return BatchPicker(samplers, logits.device).pick(logits)


_BLOCK = 8


def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k)` of x [n, vocab]: the values, sorted, and their ids. On a CPU with a
    few rows or more it takes the k blocks of 8 tokens whose maxima are largest and the top k
    of those 8k: the k largest values lie in them (a block outside holds nothing above k other
    blocks' maxima), so the result is topk's. `torch.topk`'s partial sort branches on the data
    for every element; on 16 rows of 2,048 codes it took 300 us a call against 216 this way
    (and it is most of a talker step's sampling)."""
    n, vocab = x.shape
    if x.device.type != "cpu" or n < 4 or vocab % _BLOCK or 4 * k * _BLOCK > vocab:
        return torch.topk(x, k, dim=-1)
    blocks = x.reshape(n, vocab // _BLOCK, _BLOCK)
    _, which = torch.topk(blocks.amax(-1), k, dim=-1)
    near = blocks.gather(1, which[..., None].expand(-1, -1, _BLOCK)).view(n, k * _BLOCK)
    values, j = torch.topk(near, k, dim=-1)
    return values, which.gather(1, j // _BLOCK) * _BLOCK + j % _BLOCK


def special_token_id(d: Path, content: str) -> int | None:
    """The id of an added token (`<tool_call>`, say) in the checkpoint's `tokenizer.json`."""
    path = d / "tokenizer.json"
    if not path.is_file():
        return None
    for tok in json.loads(path.read_text()).get("added_tokens", []):
        if tok.get("content") == content:
            return int(tok["id"])
    return None
