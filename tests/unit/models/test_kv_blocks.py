"""The block KV cache: attention over each row's own blocks equals dense attention over that
row alone, memory follows tokens, and a full pool evicts kept sessions before it refuses."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from realtime_omni.models.qwen3_omni.cache import BlockCache, KeptSessions
from tests.conftest import ROOT

LAYERS, KV_HEADS, HEADS, DIM = 2, 2, 6, 8


def filled(lens: list[int], blocks: int = 256, seed: int = 0) -> tuple[BlockCache, list[int], dict]:
    """A cache whose rows hold `lens` random tokens (written through prefill windows), and the
    same keys and values dense per row and layer."""
    g = torch.Generator().manual_seed(seed)
    cache = BlockCache(LAYERS, KV_HEADS, DIM, len(lens) + 2, blocks, torch.float32, "cpu")
    rows, dense = [], {}
    for n in lens:
        row = cache.alloc()
        assert cache.reserve(row, n)
        window = cache.prefill(row, n)
        for layer in range(LAYERS):
            k = torch.randn(1, KV_HEADS, n, DIM, generator=g)
            v = torch.randn(1, KV_HEADS, n, DIM, generator=g)
            window.update(k, v, layer)
            dense[row, layer] = (k, v)
        window.commit()
        rows.append(row)
    return cache, rows, dense


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None = None):
    """Dense attention with repeated K/V, as transformers' sdpa path computes it."""
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = None
    if causal_from is not None:
        t = q.shape[2]
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(t)[:, None] + causal_from
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("lens", [[3, 40, 300, 301, 700, 17], [3, 40, 17]])
def test_decode_reads_each_rows_own_tokens_and_equals_dense_attention(lens: list[int]) -> None:
    """Rows of many lengths (several attention calls), and short rows (one padded call)."""
    cache, rows, dense = filled(lens)
    g = torch.Generator().manual_seed(1)
    for layer_pass in range(2):  # a second step reads the tokens the first wrote
        for r in rows:
            assert cache.reserve(r, cache.lens[r] + 1)
        window = cache.decode(rows)
        # grouped by length: 700 alone, 300 and 301 together, the short ones padded together
        assert window.slots_read() <= 1.25 * sum(cache.lens[r] + 1 for r in rows) + 256 * 3
        q = torch.randn(len(rows), HEADS, 1, DIM, generator=g)
        for layer in range(LAYERS):
            k = torch.randn(len(rows), KV_HEADS, 1, DIM, generator=g)
            v = torch.randn(len(rows), KV_HEADS, 1, DIM, generator=g)
            window.update(k, v, layer)
            got = window.attend(q, layer, None)
            for i, r in enumerate(rows):
                dk, dv = dense[r, layer]
                dense[r, layer] = dk, dv = (
                    torch.cat([dk, k[i : i + 1]], 2),
                    torch.cat([dv, v[i : i + 1]], 2),
                )
                want = reference(q[i : i + 1], dk, dv)
                torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)
        window.commit()
        assert [cache.lens[r] for r in rows] == [n + layer_pass + 1 for n in lens]


def test_a_prefill_after_history_is_causal_over_the_rows_own_tokens() -> None:
    cache, rows, dense = filled([5, 37])
    row = rows[1]
    g = torch.Generator().manual_seed(2)
    assert cache.reserve(row, 37 + 9)
    window = cache.prefill(row, 9)
    q = torch.randn(1, HEADS, 9, DIM, generator=g)
    k = torch.randn(1, KV_HEADS, 9, DIM, generator=g)
    v = torch.randn(1, KV_HEADS, 9, DIM, generator=g)
    window.update(k, v, 0)
    got = window.attend(q, 0, None)
    dk, dv = dense[row, 0]
    want = reference(q, torch.cat([dk, k], 2), torch.cat([dv, v], 2), causal_from=37)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_memory_follows_tokens_and_blocks_come_back() -> None:
    cache, rows, _ = filled([1, 16, 17, 100])
    assert cache.blocks_in_use() == 1 + 1 + 2 + 7
    held = cache.bytes_held() / (sum([1, 16, 17, 100]) * cache.bytes_per_token)
    assert held < 1.5  # at most a block's slack per row
    cache.truncate(rows[3], 20)
    assert cache.blocks_in_use() == 1 + 1 + 2 + 2 and cache.lens[rows[3]] == 20
    for r in rows:
        cache.free(r)
    assert cache.blocks_in_use() == 0 and cache.in_use() == 0


def test_a_full_pool_evicts_kept_sessions_first_then_refuses() -> None:
    cache = BlockCache(LAYERS, KV_HEADS, DIM, 8, 4, torch.float32, "cpu", block_tokens=16)
    kept = KeptSessions(cache, max_tokens=10_000)
    old = cache.alloc()
    assert cache.reserve(old, 32)
    cache.lens[old] = 32
    kept.keep("s", old, torch.zeros(32, 4))
    running = cache.alloc()
    assert cache.reserve(running, 32)  # the last two blocks
    new = cache.alloc()
    assert cache.reserve(new, 20)  # the kept session gives its blocks up
    assert kept.evictions == 1 and "s" not in kept and cache.blocks_in_use() == 4
    another = cache.alloc()
    assert not cache.reserve(another, 1)  # nothing left to evict: refused, nothing taken
    assert cache.blocks_in_use() == 4 and cache.table[another] == []


def test_kept_sessions_tensors_count_in_the_pool_and_admission_counts_before_evicting() -> None:
    cache = BlockCache(LAYERS, KV_HEADS, DIM, 8, 8, torch.float32, "cpu", block_tokens=16)
    kept = KeptSessions(cache, max_tokens=10_000)
    row = cache.alloc()
    assert cache.reserve(row, 32)
    cache.lens[row] = 32
    block_bytes = cache.block_bytes()
    # 1.5 blocks' worth of embeddings: charged as 2 blocks beside the row's own 2
    inputs = torch.zeros(int(1.5 * block_bytes) // 4)[None]
    kept.keep("s", row, inputs, (None, inputs[:, :1]))
    assert cache.charged == 2 and cache.free_blocks() == 8 - 2 - 2
    assert kept.blocks_held() == 4
    assert kept.fits(8 * 16) and not kept.fits(8 * 16 + 1)  # counted, nothing evicted
    assert "s" in kept and kept.evictions == 0
    other = cache.alloc()
    assert cache.reserve(other, 5 * 16)  # more than is free: the session gives way
    assert "s" not in kept and cache.charged == 0 and kept.evictions == 1


def test_kv_memory_benchmark_meets_its_target_at_the_real_sizes(tmp_path) -> None:
    """benchmarks/kv_memory.py on meta tensors: held and read within 1.25x the ideal, against
    the rows-times-longest cache before it (over 10x)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kv_memory
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for lens in kv_memory.CASES.values():
        r = kv_memory.run_case(lens, "meta", 1)
        assert r["bytes_held"] <= 1.25 * r["bytes_ideal"]
        assert r["read_per_step"] <= 1.25 * r["read_ideal"]
        assert r["slot_read_per_step"] > 10 * r["read_ideal"]


@pytest.mark.parametrize("bad", [0, -1])
def test_a_pool_without_blocks_is_refused_at_once(bad: int) -> None:
    with pytest.raises(ValueError, match="blocks"):
        BlockCache(LAYERS, KV_HEADS, DIM, 4, bad, torch.float32, "cpu")
