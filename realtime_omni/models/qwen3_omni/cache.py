"""A KV cache for many requests at once: memory in fixed blocks from one pool, read per row.

`BlockCache(layers, kv_heads, head_dim, rows, blocks, block_tokens)` holds K and V per layer as
one pool of `blocks x block_tokens` token slots, `[slots, kv_heads, head_dim]`. A request takes
a row (`alloc`, the lowest free one: rows are bookkeeping, a list of blocks and a length, and
cost no memory) and gives it back (`free`). A row's tokens `[0, len)` live in its blocks in
order; `reserve(row, total)` takes blocks from the pool until the row can hold `total` tokens,
first asking `reclaim` (the kept sessions' least recently used) to give blocks back when the
pool is empty, and says False when even that is not enough: the caller then preempts a newer
request (see `KeptSessions.fits` for admission). Memory held is the blocks in use, at most
`block_tokens - 1` slots per row more than its tokens, plus `charged` blocks' worth of memory
held outside the pool on its account (the kept sessions' tensors), which `reserve` leaves
alone; on a CPU the pool is allocated with `torch.empty`, so pages never written are never
committed either.

A forward runs through a window of the cache, which the transformers attention layers call
`update(key, value, layer_idx)` on, and which `block_attention` (the attention implementation
registered as `rto_blocks`, set on the text config by `for_text_model`) reads back through the
model's kwargs (`blocks=window`):

- `decode(rows)`: one new token for each of `rows`, batch position i being row `rows[i]`; only
  these rows are in the batch. The rows are grouped by length, the longest first, so that a
  group's padded length times its rows is at most `PAD_RATIO` times the tokens it holds (or its
  longest row is short, `PAD_FREE_TOKENS`): each group is one attention call over exactly its
  rows' slots, so a step reads what the rows hold, not rows times the longest.
- `prefill(row, tokens)`: the next `tokens` tokens of one row, causal over its history.

GQA without repeated K/V: the query heads that share a K/V head are laid along the query axis
(`[kv_heads, group x q_len, head_dim]`), so one attention call per K/V head reads its keys once.
`commit()` after the forward advances the rows' lengths.

Pure torch; no sockets, no model code.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from realtime_omni.models.qwen3_omni.tensors import tensors_in

# A decode group's padded slots may exceed its rows' tokens by this factor...
PAD_RATIO = 1.25
# ...unless its longest row holds at most this many tokens (a few KiB per layer: cheaper to pad
# than to make another attention call).
PAD_FREE_TOKENS = 256
BLOCK_TOKENS = 16


class BlockCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        rows: int,
        blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        if blocks < 1 or block_tokens < 1:
            raise ValueError(f"a KV pool needs blocks >= 1 and block_tokens >= 1 (got {blocks})")
        self.rows = rows
        self.blocks = blocks
        self.block_tokens = block_tokens
        slots = blocks * block_tokens
        self.k = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)]
        self.v = [torch.empty(slots, kv_heads, head_dim, dtype=dtype, device=device)]
        for _ in range(layers - 1):
            self.k.append(torch.empty_like(self.k[0]))
            self.v.append(torch.empty_like(self.v[0]))
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * self.k[0].element_size()
        self.lens = [0] * rows
        self.table: list[list[int]] = [[] for _ in range(rows)]  # each row's blocks, in order
        self._slots: list[torch.Tensor] = [self._no_slots() for _ in range(rows)]
        self._free_rows = list(range(rows))
        self._free_blocks = list(range(blocks - 1, -1, -1))  # a stack: the lowest first
        self.reclaim: Callable[[], bool] | None = None  # frees some blocks; False: none left
        self.charged = 0  # blocks' worth of memory held outside the pool on its account

    @classmethod
    def for_text_model(
        cls, config: Any, rows: int, blocks: int, dtype: torch.dtype, device: torch.device | str
    ) -> BlockCache:
        """A cache shaped for a transformers decoder with `config` (its text config), whose
        attention is switched to `block_attention`."""
        config._attn_implementation = "rto_blocks"
        return cls(config.num_hidden_layers, *text_kv_shape(config), rows, blocks, dtype, device)

    # ---- rows and blocks -------------------------------------------------------------------

    def alloc(self) -> int:
        """A free row, empty; IndexError when all `rows` are taken."""
        if not self._free_rows:
            raise IndexError("every cache row is taken")
        self._free_rows.sort()
        return self._free_rows.pop(0)

    def free(self, row: int) -> None:
        self.truncate(row, 0)
        self._free_rows.append(row)

    def in_use(self) -> int:
        return self.rows - len(self._free_rows)

    def blocks_in_use(self) -> int:
        return self.blocks - len(self._free_blocks)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def free_blocks(self) -> int:
        """Blocks `reserve` may take without reclaiming (what is charged counts as taken)."""
        return len(self._free_blocks) - self.charged

    def reserve(self, row: int, total: int) -> bool:
        """Blocks for `row` to hold `total` tokens; False (nothing taken) if the pool, after
        `reclaim`, cannot give them."""
        need = self.blocks_for(total) - len(self.table[row])
        while need > self.free_blocks():
            if self.reclaim is None or not self.reclaim():
                return False
        if need > 0:
            new = [self._free_blocks.pop() for _ in range(need)]
            self.table[row] += new
            self._slots[row] = torch.cat([self._slots[row], self._block_slots(new)])
        return True

    def truncate(self, row: int, tokens: int) -> None:
        """Cut `row` to its first `tokens` tokens, giving back the blocks it no longer needs."""
        keep = math.ceil(tokens / self.block_tokens)
        self._free_blocks += reversed(self.table[row][keep:])
        self.table[row] = self.table[row][:keep]
        self._slots[row] = self._slots[row][: keep * self.block_tokens]
        self.lens[row] = min(self.lens[row], tokens)

    def bytes_held(self) -> int:
        return (self.blocks_in_use() + self.charged) * self.block_bytes()

    def block_bytes(self) -> int:
        return self.block_tokens * self.bytes_per_token

    def _block_slots(self, blocks: list[int]) -> torch.Tensor:
        base = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        offsets = torch.arange(self.block_tokens, device=base.device)
        return (base[:, None] * self.block_tokens + offsets).flatten()

    def _no_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long, device=self.k[0].device)

    # ---- windows ---------------------------------------------------------------------------

    def decode(self, rows: list[int]) -> _Window:
        """One token for each of `rows` (each `reserve`d for its length + 1)."""
        totals = [self.lens[r] + 1 for r in rows]
        write = torch.stack([self._slots[r][self.lens[r]] for r in rows])
        order = sorted(range(len(rows)), key=lambda i: -totals[i])
        groups: list[_Group] = []
        i = 0
        while i < len(order):
            longest = totals[order[i]]
            j = i + 1
            held = longest
            while j < len(order):
                t = totals[order[j]]
                if longest > PAD_FREE_TOKENS and longest * (j - i + 1) > PAD_RATIO * (held + t):
                    break
                held += t
                j += 1
            members = sorted(order[i:j])  # in batch order: one group of all is the batch as is
            groups.append(self._group([(b, rows[b], totals[b]) for b in members], longest))
            i = j
        return _Window(self, write, groups, None, {r: 1 for r in rows})

    def prefill(self, row: int, tokens: int) -> _Window:
        """The next `tokens` tokens of `row` (`reserve`d for them)."""
        start = self.lens[row]
        total = start + tokens
        slots = self._slots[row]
        causal = None
        if start or tokens > 1:
            q = torch.arange(tokens, device=slots.device)[:, None] + start
            causal = torch.arange(total, device=slots.device)[None, :] <= q
        group = _Group(torch.zeros(1, dtype=torch.long), slots[None, :total], None)
        return _Window(self, slots[start:total], [group], causal, {row: tokens})

    def _group(self, members: list[tuple[int, int, int]], longest: int) -> _Group:
        """Batch positions, rows and token counts of one decode group, padded to `longest`."""
        device = self.k[0].device
        index = torch.zeros(len(members), longest, dtype=torch.long, device=device)
        mask = None
        if any(t != longest for _, _, t in members):
            counts = torch.tensor([t for _, _, t in members], device=device)
            mask = (torch.arange(longest, device=device)[None, :] < counts[:, None])[:, None, None]
        for i, (_, row, t) in enumerate(members):
            slots = self._slots[row]
            index[i, :t] = slots[:t]
            index[i, t:] = slots[0]  # padding reads a written slot (never garbage: NaN * 0)
        batch = torch.tensor([b for b, _, _ in members], dtype=torch.long, device=device)
        return _Group(batch, index, mask)


def text_kv_shape(config: Any) -> tuple[int, int]:
    """(kv_heads, head_dim) of a transformers text config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_key_value_heads), int(head_dim)


class _Group:
    """Rows one attention call reads: their batch positions, their slots `[n, longest]`, and
    which of those are theirs (None: all)."""

    def __init__(self, batch: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None) -> None:
        self.batch = batch
        self.index = index
        self.mask = mask


class _Window:
    """The part of a BlockCache one forward reads and writes (see the module docstring)."""

    def __init__(
        self,
        cache: BlockCache,
        write: torch.Tensor,
        groups: list[_Group],
        causal: torch.Tensor | None,
        advance: dict[int, int],
    ) -> None:
        self.cache = cache
        self.write = write  # the new tokens' slots, in batch (decode) or token (prefill) order
        self.groups = groups
        self.causal = causal  # prefill: [tokens, total] which keys each query sees
        self._causal_heads: torch.Tensor | None = None  # the same for the heads along the queries
        self.advance = advance

    def slots_read(self) -> int:
        """Token slots one layer's attention reads (padding included)."""
        return sum(int(g.index.numel()) for g in self.groups)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V ([b, kv_heads, t, head_dim]) into their slots."""
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        # decode: batch b, one token each; prefill: one row, t tokens.
        k[self.write] = key.transpose(1, 2).flatten(0, 1)
        v[self.write] = value.transpose(1, 2).flatten(0, 1)
        return key, value

    def attend(self, query: torch.Tensor, layer_idx: int, scaling: float | None) -> torch.Tensor:
        """Attention of `query` [b, heads, q_len, head_dim] over each row's own slots, as
        [b, q_len, heads, head_dim]."""
        k, v = self.cache.k[layer_idx], self.cache.v[layer_idx]
        b, heads, q_len, dim = query.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        if self.causal is not None and self._causal_heads is None:  # once, not once a layer
            self._causal_heads = self.causal.repeat(group, 1)[None, None]
        out = query.new_empty(b, heads, q_len, dim)
        for g in self.groups:
            n = g.index.shape[0]
            whole = len(self.groups) == 1 and n == b  # the batch as it is, in its order
            keys = k[g.index].permute(0, 2, 1, 3)  # [n, kv_heads, longest, dim]
            values = v[g.index].permute(0, 2, 1, 3)
            q = query if whole else query[g.batch]
            # [n, kv_heads, group x q_len, dim]: the heads of one K/V head along the query axis
            q = q.reshape(n, kv_heads, group * q_len, dim)
            mask = g.mask if self._causal_heads is None else self._causal_heads
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
            o = o.reshape(n, heads, q_len, dim)
            if whole:
                out = o
            else:
                out[g.batch] = o
        return out.transpose(1, 2)

    def commit(self) -> None:
        for row, n in self.advance.items():
            self.cache.lens[row] += n


def block_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    blocks: _Window | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over a `_Window` passed to the forward as
    `blocks=window` (its `update` already wrote `key` and `value`)."""
    if blocks is None:
        raise ValueError("rto_blocks attention needs the cache window: forward(..., blocks=w)")
    return blocks.attend(query, module.layer_idx, scaling), None  # type: ignore[arg-type]


AttentionInterface.register("rto_blocks", block_attention)


def pool_blocks(
    params: dict[str, Any],
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    stage: str,
    pipeline: Any = None,
) -> int:
    """The size of a stage's KV pool in blocks, from its params: `kv_cache_tokens`, else
    `kv_cache_gib`, else on CUDA the pool the memory plan gives it on this card
    (`memory_plan.pool_bytes` of `pipeline`, the whole `PipelineConfig`: the card's memory less
    what every stage on the device holds and steps with and a reserve, divided between the unset
    pools there; the same figure `realtime-omni check --gpu-memory` prints), and on a CPU 1 GiB
    (`DEFAULT_CPU_GIB`). On CUDA without `pipeline`, `kv_cache_memory_fraction` (default 0.85)
    of the memory free once the weights are loaded: a stage alone on its GPU only."""
    kv_heads, head_dim = text_kv_shape(config)
    per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * dtype.itemsize
    per_block = per_token * BLOCK_TOKENS
    if "kv_cache_tokens" in params:
        tokens = int(params["kv_cache_tokens"])
        if tokens < BLOCK_TOKENS:
            raise ValueError(f"{stage}: kv_cache_tokens = {tokens}; at least {BLOCK_TOKENS}")
        return tokens // BLOCK_TOKENS
    if "kv_cache_gib" in params:
        nbytes = float(params["kv_cache_gib"]) * 2**30
    elif device.type == "cuda" and pipeline is not None:
        from realtime_omni.models.qwen3_omni.memory_plan import pool_bytes

        nbytes = pool_bytes(pipeline, stage, torch.cuda.mem_get_info(device)[1])
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = free * float(params.get("kv_cache_memory_fraction", 0.85))
    else:
        nbytes = DEFAULT_CPU_GIB * 2**30
    blocks = int(nbytes // per_block)
    if blocks < 1:
        raise ValueError(f"{stage}: a KV pool of {nbytes:.0f} bytes holds no block of {per_block}")
    return blocks


DEFAULT_CPU_GIB = 1.0


def admission(
    sessions: KeptSessions, stage: str, tokens: int, waited_s: float, timeout_s: float
) -> str:
    """Whether a waiting request that needs `tokens` token slots (its prompt and a decode
    margin) starts now: "admit" (a row, and blocks from the free ones and those evicting kept
    sessions would give back), "wait", or why it is refused: it could never fit, or it has
    waited `timeout_s`."""
    cache = sessions.cache
    if cache.blocks_for(tokens) > cache.blocks:
        return (
            f"{stage}: the prompt and its decode margin need {tokens} tokens of KV cache, more "
            f"than the whole pool ({cache.blocks} blocks of {cache.block_tokens} tokens); raise "
            "the stage's kv_cache_tokens or kv_cache_gib, or shorten the conversation"
        )
    if sessions.row_available() and sessions.fits(tokens):
        return "admit"
    if waited_s >= timeout_s:
        return (
            f"{stage}: waited {waited_s:.1f} s for KV cache blocks ({tokens} tokens) while "
            f"{cache.blocks_in_use()} of {cache.blocks} blocks ran other answers; raise the "
            "stage's kv_cache_tokens or admit_timeout_s, or lower max_batch"
        )
    return "wait"


class PreemptsNewest:
    """Decode's blocks for an executor whose requests (`reqs`) each hold a `row` of `cache` (or
    None) and an arrival order `seq`, and which can give one's blocks back (`_preempt`)."""

    reqs: dict[str, Any]
    cache: BlockCache

    def _preempt(self, rid: str) -> None: ...

    def _seq(self, rid: str) -> int:
        return int(self.reqs[rid].seq)

    def _drop(self, rid: str) -> None:
        """Forget `rid` here (failed or refused), its row and blocks given back."""
        r = self.reqs.pop(rid)
        if r.row is not None:
            self.cache.free(r.row)

    def _holding_row(self, rid: str) -> bool:
        return rid in self.reqs and self.reqs[rid].row is not None

    def _holding(self) -> list[str]:
        """Requests holding a row and blocks (held ones too)."""
        return [rid for rid, r in self.reqs.items() if r.row is not None]

    def _reserve_decode(self, rids: list[str]) -> list[str]:
        """A block for the next token of each of `rids`, oldest first: when the pool has none
        (kept sessions evicted already), the newest request holding blocks gives its back
        (`_preempt`), which may be one of `rids`; the oldest never pays. Gives those of `rids`
        that can never have it, alone in the pool and out of blocks: the caller fails them
        (`grown_past`), since preempting them would only start them over."""
        never = []
        for rid in sorted(rids, key=self._seq):
            r = self.reqs[rid]
            while r.row is not None and not self.cache.reserve(r.row, self.cache.lens[r.row] + 1):
                holders = self._holding()
                if holders == [rid]:
                    never.append(rid)
                    break
                self._preempt(max(holders, key=self._seq))
        return never

    def grown_past(self, stage: str) -> str:
        cache = self.cache
        return (
            f"{stage}: an answer outgrew the whole KV pool ({cache.blocks} blocks of "
            f"{cache.block_tokens} tokens) with nothing else in it; raise the stage's "
            "kv_cache_tokens or kv_cache_gib, or lower max_tokens"
        )


class KeptSessions:
    """Cache rows that conversations' finished turns left behind, for their next turns.

    `keep(session, row, inputs, extra)` holds `row` with the input rows `inputs` [n, D] whose
    keys and values fill it (and anything the executor needs again, `extra`); `take(session,
    inputs)` gives a new turn the longest common prefix of those and its own inputs, compared
    row by row (at least one input is left to compute, for the logits): the row, with its length
    cut to that prefix, how many inputs it covers, and `extra`; or nothing to reuse, with the
    row given back. Least recently used first out, within `max_tokens` input rows in all, the
    rows running requests need (`make_room`), and the blocks they need (the cache's `reclaim`).
    `evictions` counts the sessions given up for room.
    """

    def __init__(self, cache: BlockCache, max_tokens: int) -> None:
        self.cache = cache
        self.max_tokens = max_tokens
        self.evictions = 0
        self._kept: OrderedDict[str, tuple[int, torch.Tensor, Any]] = OrderedDict()
        self._charged: dict[str, int] = {}  # per session: blocks' worth of its kept tensors
        cache.reclaim = self.evict_oldest

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, session: object) -> bool:
        return session in self._kept

    def __iter__(self) -> Iterator[str]:
        return iter(self._kept)

    def keep(self, session: str, row: int, inputs: torch.Tensor, extra: Any = None) -> None:
        """Keep `row` for `session`'s next turn. Its tensors are charged to the pool (as
        blocks' worth of memory), and sessions are evicted, oldest first, until the pool is
        within its blocks and `max_tokens` again."""
        if session in self._kept:  # an older turn of it
            self.cache.free(self._pop(session)[0])
        self.cache.truncate(row, self.cache.lens[row])  # blocks reserved ahead go back
        self._kept[session] = (row, inputs, extra)
        nbytes = sum(t.numel() * t.element_size() for t in tensors_in((inputs, extra)))
        self._charged[session] = math.ceil(nbytes / self.cache.block_bytes())
        self.cache.charged += self._charged[session]
        while self._kept and (
            sum(len(k[1]) for k in self._kept.values()) > self.max_tokens
            or self.cache.free_blocks() < 0
        ):
            self.evict_oldest()

    def take(self, session: str | None, inputs: torch.Tensor) -> tuple[int | None, int, Any]:
        kept = self._pop(session) if session in self._kept else None
        if kept is None:
            return None, 0, None
        row, old, extra = kept
        n = min(len(old), len(inputs) - 1)
        same = (old[:n] == inputs[:n]).all(-1)
        shared = n if bool(same.all()) else int(same.int().argmin())
        if not shared:
            self.cache.free(row)
            return None, 0, None
        self.cache.truncate(row, shared)
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

    def blocks_held(self) -> int:
        """What evicting every kept session would give back: their blocks and their charge."""
        return sum(len(self.cache.table[row]) for row, _, _ in self._kept.values()) + sum(
            self._charged.values()
        )

    def fits(self, tokens: int) -> bool:
        """Whether a new request's `tokens` can have their blocks now, evicting kept sessions
        if need be (counted, nothing evicted: `reserve` evicts only as much as it takes)."""
        return self.cache.blocks_for(tokens) <= self.cache.free_blocks() + self.blocks_held()

    def evict_oldest(self) -> bool:
        if not self._kept:
            return False
        self.cache.free(self._pop(next(iter(self._kept)))[0])
        self.evictions += 1
        return True

    def _pop(self, session: str | None) -> tuple[int, torch.Tensor, Any]:
        self.cache.charged -= self._charged.pop(session, 0)  # type: ignore[arg-type]
        return self._kept.pop(session)  # type: ignore[arg-type]
