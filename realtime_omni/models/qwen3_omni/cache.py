"""A KV cache for many requests at once: one row per request in fixed per-layer buffers.

`SlotCache(layers, kv_heads, head_dim, rows)` holds K and V as `[rows, kv_heads, capacity,
head_dim]` per layer. A request takes a row (`alloc`, the lowest free one, so the rows in use
stay packed at the front) and gives it back (`free`); its tokens sit at columns `[0, len)`.
Adding or removing a request copies nothing; the time axis doubles when a row outgrows it (one
copy, amortised over the tokens that filled it).

A forward runs through a window of the cache, an object the transformers attention layers
call `update(key, value, layer_idx)` on:

- `decode(hi, active)`: one new token for each row in `[0, hi)`. Rows not in `active` (free,
  held, or still prefilling) ride along with a dummy token: it is written at their current end,
  where their next real token overwrites it, and they attend to column 0 only; their outputs are
  thrown away. Every row reads its own history through a mask, so the K/V buffers are sliced,
  never gathered.
- `prefill(row, tokens)`: the next `tokens` prompt tokens of one row, causal over its history.

`window.mask` is the attention mask to pass with the forward (None where the plain causal
kernel already computes the same thing: one row, nothing hidden), and `commit()` after the
forward advances the rows' lengths.

Pure torch; no sockets, no model code.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch


class SlotCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        rows: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 256,
        sdpa: bool = True,
    ) -> None:
        self.rows = rows
        self.capacity = capacity
        self.sdpa = sdpa  # bool masks for SDPA, additive float masks for eager attention
        shape = (rows, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lens = [0] * rows
        self._free = list(range(rows))

    @classmethod
    def for_text_model(
        cls, config: Any, rows: int, dtype: torch.dtype, device: torch.device | str
    ) -> SlotCache:
        """A cache shaped for a transformers decoder with `config` (its text config)."""
        head_dim = getattr(config, "head_dim", None)
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim or config.hidden_size // config.num_attention_heads,
            rows,
            dtype,
            device,
            sdpa=config._attn_implementation == "sdpa",
        )

    # ---- rows ------------------------------------------------------------------------------

    def alloc(self) -> int:
        """A free row, emptied; IndexError when all `rows` are taken."""
        if not self._free:
            raise IndexError("every cache row is taken")
        self._free.sort()
        row = self._free.pop(0)
        self.lens[row] = 0
        return row

    def free(self, row: int) -> None:
        self.lens[row] = 0
        self._free.append(row)

    def in_use(self) -> int:
        return self.rows - len(self._free)

    def span(self) -> int:
        """One past the highest row in use: what a decode window must cover."""
        used = set(range(self.rows)) - set(self._free)
        return max(used) + 1 if used else 0

    # ---- windows ---------------------------------------------------------------------------

    def decode(self, hi: int, active: list[int]) -> _Window:
        lens = [self.lens[r] for r in range(hi)]
        self._reserve(max(lens) + 1)
        total = max(lens) + 1
        device = self.k[0].device
        starts = torch.tensor(lens, device=device)
        mask: torch.Tensor | None = None
        if hi > 1 or active != [0]:
            cols = torch.arange(total, device=device)
            allowed = cols[None, :] <= starts[:, None]
            dummy = [r for r in range(hi) if r not in set(active)]
            if dummy:
                allowed[dummy] = cols[None, :] == 0
            mask = self._mask(allowed[:, None, None, :])
        return _Window(self, slice(0, hi), starts, 1, total, mask, {r: 1 for r in active})

    def prefill(self, row: int, tokens: int) -> _Window:
        start = self.lens[row]
        total = start + tokens
        self._reserve(total)
        mask = None
        if start:  # causal with an offset: the plain kernel's mask is anchored at column 0
            device = self.k[0].device
            q = torch.arange(tokens, device=device)[:, None] + start
            allowed = torch.arange(total, device=device)[None, :] <= q
            mask = self._mask(allowed[None, None])
        return _Window(self, slice(row, row + 1), start, tokens, total, mask, {row: tokens})

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if self.sdpa:
            return allowed
        neg = torch.finfo(self.k[0].dtype).min
        zero = torch.zeros((), dtype=self.k[0].dtype, device=allowed.device)
        return torch.where(allowed, zero, neg)

    def _reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        cap = self.capacity
        while cap < total:
            cap *= 2
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = old.new_zeros((*old.shape[:2], cap, old.shape[3]))
                new[:, :, : self.capacity] = old
                buffers[i] = new
        self.capacity = cap


class _Window:
    """The part of a SlotCache one forward reads and writes (see the module docstring)."""

    def __init__(
        self,
        cache: SlotCache,
        rows: slice,
        starts: torch.Tensor | int,
        tokens: int,
        total: int,
        mask: torch.Tensor | None,
        advance: dict[int, int],
    ) -> None:
        self.cache = cache
        self.rows = rows
        self.starts = starts
        self.tokens = tokens
        self.total = total
        self.mask = mask
        self.advance = advance
        if isinstance(starts, torch.Tensor):
            self._index = torch.arange(rows.start, rows.stop, device=starts.device)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        if isinstance(self.starts, torch.Tensor):  # decode: one token per row, at its end
            k[self._index, :, self.starts] = key[:, :, 0]
            v[self._index, :, self.starts] = value[:, :, 0]
        else:
            end = self.starts + self.tokens
            k[self.rows, :, self.starts : end] = key
            v[self.rows, :, self.starts : end] = value
        return k[self.rows, :, : self.total], v[self.rows, :, : self.total]

    # What transformers' mask builder asks of a cache when no mask is passed (one row).
    is_compileable = False

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return int(self.starts) if not isinstance(self.starts, torch.Tensor) else self.total - 1

    def get_mask_sizes(self, q_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.total, 0

    def commit(self) -> None:
        for row, n in self.advance.items():
            self.cache.lens[row] += n


class KeptSessions:
    """Cache rows that conversations' finished turns left behind, for their next turns.

    `keep(session, row, inputs, extra)` holds `row` with the input rows `inputs` [n, D] whose
    keys and values fill it (and anything the executor needs again, `extra`); `take(session,
    inputs)` gives a new turn the longest common prefix of those and its own inputs, compared
    row by row (at least one input is left to compute, for the logits): the row, with its length
    cut to that prefix, how many inputs it covers, and `extra`; or nothing to reuse, with the
    row given back. Least recently used first out, within `max_tokens` input rows in all and
    whatever rows running requests need (`evict_oldest`).
    """

    def __init__(self, cache: SlotCache, max_tokens: int) -> None:
        self.cache = cache
        self.max_tokens = max_tokens
        self._kept: OrderedDict[str, tuple[int, torch.Tensor, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, session: object) -> bool:
        return session in self._kept

    def __iter__(self) -> Iterator[str]:
        return iter(self._kept)

    def keep(self, session: str, row: int, inputs: torch.Tensor, extra: Any = None) -> None:
        if session in self._kept:  # an older turn of it
            self.cache.free(self._kept.pop(session)[0])
        self._kept[session] = (row, inputs, extra)
        while self._kept and sum(len(k[1]) for k in self._kept.values()) > self.max_tokens:
            self.evict_oldest()

    def take(self, session: str | None, inputs: torch.Tensor) -> tuple[int | None, int, Any]:
        kept = self._kept.pop(session, None) if session is not None else None
        if kept is None:
            return None, 0, None
        row, old, extra = kept
        n = min(len(old), len(inputs) - 1)
        same = (old[:n] == inputs[:n]).all(-1)
        shared = n if bool(same.all()) else int(same.int().argmin())
        if not shared:
            self.cache.free(row)
            return None, 0, None
        self.cache.lens[row] = shared
        return row, shared, extra

    def row_available(self) -> bool:
        """A row is free, or a kept one can be given up for it."""
        return self.cache.in_use() - len(self._kept) < self.cache.rows

    def make_room(self, session: str | None) -> bool:
        """Whether a new turn of `session` can have a row now: its session's kept row, a free
        row, or the least recently used kept row given up for it."""
        if session in self._kept or self.cache.in_use() < self.cache.rows:
            return True
        return self.evict_oldest()

    def evict_oldest(self) -> bool:
        if not self._kept:
            return False
        self.cache.free(self._kept.popitem(last=False)[1][0])
        return True
