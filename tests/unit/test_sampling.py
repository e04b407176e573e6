"""pick_batch: each row with its own sampler, whatever its batch-mates."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from realtime_omni.models.qwen3_omni.sampling import Sampler, pick_batch  # noqa: E402


def samplers() -> list[Sampler]:
    return [Sampler(0.9, 0.8, 40, seed=1), Sampler(0.0), Sampler(1.2, 1.0, 0, seed=2),
            Sampler(0.7, 0.95, 5, seed=3)]  # fmt: skip


def test_a_row_picks_the_same_alone_and_batched() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    batched, alone = samplers(), samplers()
    together = [pick_batch(batched, logits).tolist() for _ in range(20)]
    each = [[int(s.pick(logits[i])) for i, s in enumerate(alone)] for _ in range(20)]
    assert together == each
    assert len({tuple(r[0] for r in together)}) > 0 and len({r[0] for r in together}) > 1


def test_greedy_top_k_and_top_p_cuts() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1)
    cut = [Sampler(1.0, 1.0, 1, seed=0), Sampler(1.0, 1e-6, 0, seed=0), Sampler(0.0)]
    for _ in range(10):
        assert pick_batch(cut, logits).tolist() == best.tolist()
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    s = [Sampler(2.0, 1.0, 5, seed=4)]
    assert {int(pick_batch(s, logits[:1])[0]) for _ in range(200)} <= top5
