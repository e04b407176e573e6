"""Sampling: each row with its own sampler, whatever its batch-mates; top-k by blocks is topk."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from realtime_omni.models.qwen3_omni.sampling import (  # noqa: E402
    BatchPicker,
    Sampler,
    _top_k,
    pick_batch,
)


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


def test_a_row_picks_the_same_over_a_frame_alone_and_batched() -> None:
    """A talker frame's 15 picks from one `BatchPicker`, the draws taken up front."""
    g = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, 2048, generator=g) for _ in range(15)]
    picker = BatchPicker(samplers(), torch.device("cpu"), picks=15)
    together = [picker.pick(x).tolist() for x in steps]
    alone = [BatchPicker([s], torch.device("cpu"), picks=15) for s in samplers()]
    each = [[int(p.pick(x[i : i + 1])[0]) for i, p in enumerate(alone)] for x in steps]
    assert together == each
    assert len({row[0] for row in together}) > 1  # the sampled row does sample
    with pytest.raises(RuntimeError):
        picker.pick(steps[0])


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("k", [5, 50])
def test_top_k_by_blocks_is_topk(rows: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows * k)
    for vocab in (2048, 3072, 2050):  # 2,050: not whole blocks, topk itself
        x = torch.randn(rows, vocab, generator=g)
        values, ids = _top_k(x, k)
        want = torch.topk(x, k, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices)
    # Ties: the same values (which of two equal tokens is kept may differ).
    x = torch.randint(0, 40, (rows, 2048), generator=g).float()
    assert torch.equal(_top_k(x, k)[0], torch.topk(x, k, dim=-1).values)
