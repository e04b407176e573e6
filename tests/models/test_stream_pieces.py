"""Fast tests of the pure parts: incremental detokenisation and code2wav seam arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from realtime_omni.models.qwen3_omni.detok import IncrementalDetokenizer


def byte_decode(ids: list[int]) -> str:
    """A byte-level 'tokenizer': one token per byte, like BPE fallbacks for rare characters."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    "text", ["hello world", "héllo wörld", "日本語のテキスト", "emoji 🎉🎶 ok"]
)
def test_detokenizer_never_splits_a_character(text: str) -> None:
    d = IncrementalDetokenizer(byte_decode)
    deltas = [d.push(b) for b in text.encode()]
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_detokenizer_with_the_tiny_tokenizer(tiny_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "Hello, how is the weather today? Ça va 🌧️ 雨"
    ids = tok(text)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    d = IncrementalDetokenizer(lambda x: tok.decode(x, skip_special_tokens=True))
    deltas = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_chunk_plan_tiles_the_one_call_output_exactly() -> None:
    """Emulate code2wav with a causal 'vocoder' (each frame -> its 1,920 samples, minus the 555
    the real one cuts at the end of every call): the joined chunks equal one call on all frames,
    whatever the chunk sizes and context, so no sample is dropped or repeated at a seam."""
    from realtime_omni.models.qwen3_omni.code2wav import ChunkPlan

    spf, lost = 1920, 555

    def vocode(frames: np.ndarray) -> np.ndarray:
        return np.repeat(frames.astype(np.float64), spf)[: frames.size * spf - lost]

    frames = np.arange(37) + 1.0
    for first, size, ctx in [(2, 10, 25), (1, 4, 1), (3, 7, 2), (2, 10, 100)]:
        plan = ChunkPlan(spf, lost, first, size, ctx)
        out, s, n = [], 0, 0
        while (e := plan.next_end(s, len(frames), final=True)) is not None:
            w = plan.window(s)
            out.append(vocode(frames[w:e])[plan.trim(s) :])
            s = e
            n += 1
        joined = np.concatenate(out)
        np.testing.assert_array_equal(joined, vocode(frames))
        assert out[0].size == min(first, 37) * spf - lost


def test_chunk_plan_waits_for_a_full_chunk_until_the_end() -> None:
    from realtime_omni.models.qwen3_omni.code2wav import ChunkPlan

    plan = ChunkPlan(first_chunk_frames=2, chunk_frames=10)
    assert plan.next_end(0, 1, final=False) is None
    assert plan.next_end(0, 2, final=False) == 2
    assert plan.next_end(2, 3, final=False) is None
    assert plan.next_end(2, 9, final=False) == 4  # as many as were sent: 2
    assert plan.next_end(4, 9, final=False) == 8  # 4
    assert plan.next_end(8, 15, final=False) is None  # 8: waits for the 8th
    assert plan.next_end(8, 17, final=False) == 16
    assert plan.next_end(16, 30, final=False) == 26  # at most chunk_frames
    assert plan.next_end(2, 3, final=True) == 3
    assert plan.next_end(5, 5, final=True) is None
    sizes, s = [], 0
    while (e := plan.next_end(s, 60, final=False)) is not None:
        sizes.append(e - s)
        s = e
    assert sizes == [2, 2, 4, 8, 10, 10, 10, 10]
