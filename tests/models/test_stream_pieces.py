"""Fast tests of the stream pieces: incremental detokenisation, code2wav chunking and its
streamed convolutions against one call of the real model."""

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


def stream(tiny_dir, codes: list[np.ndarray], **params: object) -> list[list[dict]]:
    """Each [n, 16] code array through one Code2WavExecutor, fed a frame per request per round
    (so their chunks are batched together), all outputs per request."""
    from realtime_omni.models.qwen3_omni.code2wav import Code2WavExecutor
    from realtime_omni.pipeline.executor import StageContext

    ex = Code2WavExecutor(StageContext(stage="code2wav", device="cpu", params=dict(params),
                                       model={"path": str(tiny_dir)}, max_batch=8))  # fmt: skip
    out: list[list[dict]] = [[] for _ in codes]
    for i in range(len(codes)):
        ex.add_request(str(i), {})
    for t in range(max(len(c) for c in codes) + 1):
        for i, c in enumerate(codes):
            if t < len(c):
                ex.add_item(str(i), "talker_ar", {"codes": c[t], "token_time": float(t)})
            elif t == len(c):
                ex.end_stream(str(i), "talker_ar")
        while ex.has_work():
            for e in ex.step():
                if e.data:
                    out[int(e.request_id)].append(e.data)
    assert not ex.reqs
    return out


@pytest.mark.parametrize(("first", "size", "sizes"), [(2, 10, [2, 2, 4, 8, 10, 10]),
                                                      (1, 3, [1, 1, 2, 3, 3, 3])])  # fmt: skip
def test_streamed_code2wav_equals_one_call(tiny_dir, first: int, size: int, sizes) -> None:
    """The convolutions stream with their state and the pre-transformer sees its whole reach
    (144 frames by default): the joined chunks of an answer of 200 frames, whose windows are
    cut from frame 154 on, and of one of 37, decoded in the same steps, equal one call of the
    real model on all frames to float noise, with exactly its length, whatever the chunks."""
    import torch

    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 2048, (n, 16)) for n in (200, 37)]
    model = load_part(tiny_dir, "code2wav", "cpu", torch.float32, load_config(tiny_dir))
    out = stream(tiny_dir, codes, first_chunk_frames=first, chunk_frames=size)
    for got, c in zip(out, codes, strict=True):
        ref = model(torch.from_numpy(c.T[None]))[0, 0].numpy()
        wav = np.concatenate([o["pcm"] for o in got])
        assert wav.shape == ref.shape == (len(c) * 1920 - 555,)
        np.testing.assert_allclose(wav, ref, atol=1e-5)
        assert [o["frames"] for o in got][:6] == sizes
        np.testing.assert_array_equal(np.concatenate([o["codes"] for o in got]), c)


def test_a_short_pre_transformer_context_is_bounded(tiny_dir) -> None:
    """With `left_context_frames` 25 the pre-transformer forgets what lies further back, so
    once an answer passes 25 frames its samples drift from one call's, a little: random
    weights attend almost uniformly over the 72-frame window, so every frame left out shifts
    the output (real weights attend mostly to the near past). The first 25 frames are exact,
    the rest stay within 20 % of the peak (measured: 8.6 %)."""
    import torch

    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    c = np.random.default_rng(1).integers(0, 2048, (120, 16))
    model = load_part(tiny_dir, "code2wav", "cpu", torch.float32, load_config(tiny_dir))
    ref = model(torch.from_numpy(c.T[None]))[0, 0].numpy()
    wav = np.concatenate([o["pcm"] for o in stream(tiny_dir, [c], left_context_frames=25)[0]])
    assert wav.shape == ref.shape
    exact = 26 * 1920 - 555  # the chunk starting at frame 26 is the first with its context cut
    np.testing.assert_allclose(wav[:exact], ref[:exact], atol=1e-5)
    err = np.abs(wav - ref).max() / np.abs(ref).max()
    assert 1e-4 < err <= 0.2


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


def test_later_chunks_of_several_lengths_decode_as_each_alone(tiny_dir) -> None:
    """`StreamingDecoder.decode` with `frames`: rows of 10, 7 and 3 frames padded to 10 in one
    call give each row's samples and convolution state as a call on its frames alone, and so
    the chunk after it too (to float noise: 1e-5, as the equivalence tests hold the waveform)."""
    import torch

    from realtime_omni.models.qwen3_omni.vocoder import StreamingDecoder
    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    model = load_part(tiny_dir, "code2wav", "cpu", torch.float32, load_config(tiny_dir))
    dec = StreamingDecoder(model)
    g = torch.Generator().manual_seed(3)
    frames = [10, 7, 3]
    codes = torch.randint(0, 2048, (3, 16, 2 + 10 + 4), generator=g)
    with torch.no_grad():
        h = dec.hidden(codes)
        together: list[dict] = [{} for _ in frames]
        alone: list[dict] = [{} for _ in frames]
        dec.decode(h[:, :2], together)
        for i in range(3):
            dec.decode(h[i : i + 1, :2], [alone[i]])
        pad = torch.stack([torch.cat([h[i, 2 : 2 + n], h[i, 2 + n : 12] * 0]) for i, n in
                           enumerate(frames)])  # fmt: skip
        wav = dec.decode(pad, together, frames)
        for i, n in enumerate(frames):
            ref = dec.decode(h[i : i + 1, 2 : 2 + n], [alone[i]])[0]
            assert ref.shape == (n * 1920,)
            torch.testing.assert_close(wav[i, : n * 1920], ref, atol=1e-5, rtol=0)
            for key, state in alone[i].items():
                torch.testing.assert_close(together[i][key], state, atol=1e-5, rtol=0)
        nxt = h[:, 12:16]  # the same 4 frames next for every row
        wav = dec.decode(nxt, together)
        for i in range(3):
            ref = dec.decode(nxt[i : i + 1], [alone[i]])[0]
            torch.testing.assert_close(wav[i], ref, atol=1e-5, rtol=0)


def test_transposed_convolutions_run_on_torch_kernels_and_the_flag_comes_back() -> None:
    """`vocoder._native` turns oneDNN off for its call only, and back on after it, however the
    call ends; the samples are those of oneDNN's kernels to float noise."""
    import torch

    from realtime_omni.models.qwen3_omni.vocoder import _native

    seen = []

    class Probe(torch.nn.ConvTranspose1d):
        def forward(self, x: torch.Tensor, output_size: object = None) -> torch.Tensor:
            seen.append(torch.backends.mkldnn.enabled)
            if x.shape[0] == 0:
                raise RuntimeError("empty")
            return super().forward(x)

    torch.manual_seed(0)
    conv = Probe(8, 4, 10, stride=5)
    x = torch.randn(3, 8, 50)
    assert torch.backends.mkldnn.enabled
    got = _native(conv, x)
    assert seen == [False] and torch.backends.mkldnn.enabled
    torch.testing.assert_close(got, conv(x), atol=1e-5, rtol=0)
    assert seen == [False, True]
    with pytest.raises(RuntimeError):
        _native(conv, x[:0])
    assert torch.backends.mkldnn.enabled


def test_stage_processes_keep_more_onednn_kernels_unless_told(monkeypatch) -> None:
    import os

    from realtime_omni.models.qwen3_omni.tensors import ONEDNN_KERNELS, setup_torch

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    setup_torch("cpu")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_KERNELS) != "1024"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    setup_torch("cpu")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"
