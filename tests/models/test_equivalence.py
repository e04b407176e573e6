"""The staged, streamed pipeline (seven real stage processes) against the serial oracle.

With greedy sampling the pipeline must give exactly the text tokens and the 16-code frames of
`generate(return_audio=True)`, for text, audio, image and audio+image prompts.

The waveform: code2wav streams chunks of 2, 2, 4, 8, then 10 frames: each chunk's frames go
through the pre-transformer with up to 144 frames of left context (its whole reach, the tiny
config's default) and only its own frames through the streamed convolutions, while generate
decodes all frames in one call. The joined stream must have exactly the reference length
(n * 1920 - 555 samples: nothing dropped or repeated at the seams) and match to float noise
(1e-5). Answers longer than the context are held to one call in
`tests/models/test_stream_pieces.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.models.reference import conversation, generate

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
MAX_FRAMES = 30  # generate's talker_max_new_tokens: 29 frames at most
GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": MAX_TOKENS,
          "talker_max_tokens": MAX_FRAMES}  # fmt: skip


def joined(outputs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Token ids, text, codes [n, 16] and the waveform of one request's terminal outputs."""
    audio = outputs.get("code2wav", [])
    assert [o["index"] for o in audio] == list(range(len(audio)))
    tokens = outputs.get("decode", [])
    assert [o["index"] for o in tokens] == list(range(len(tokens)))
    return {
        "text_ids": [o["token_id"] for o in tokens],
        "text": "".join(o["text"] for o in tokens),
        "codes": np.concatenate([o["codes"] for o in audio]) if audio else np.zeros((0, 16)),
        "wav": np.concatenate([o["pcm"] for o in audio]) if audio else np.zeros(0, np.float32),
        "chunks": audio,
    }


async def run_request(coord: Any, payload: dict[str, Any]) -> dict[str, Any]:
    stream = await coord.submit(payload)
    return joined(await stream.collect())


def check_against(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Tokens and codes exactly; the waveform to float noise (1e-5), with exactly its length."""
    assert got["text_ids"] == ref["text_ids"]
    np.testing.assert_array_equal(got["codes"], ref["codes"])
    n = ref["codes"].shape[0]
    assert got["wav"].shape == ref["wav"].shape == (n * 1920 - 555,)
    assert len(got["chunks"]) >= 4  # several seams
    np.testing.assert_allclose(got["wav"], ref["wav"], atol=1e-5)


@pytest.mark.parametrize("kind", ["text", "audio", "image", "audio_image"])
def test_pipeline_matches_generate(kind: str, pipeline: Any, tiny_dir: Any) -> None:
    lt, coord = pipeline
    payload = {**conversation(kind), **GREEDY}
    got = lt.run(run_request(coord, payload))
    ref = generate(tiny_dir, payload, MAX_TOKENS, MAX_FRAMES)
    assert len(ref["text_ids"]) == MAX_TOKENS and ref["codes"].shape[0] >= MAX_TOKENS
    check_against(got, ref)
    assert got["text"] == tokenizer_text(tiny_dir, ref["text_ids"])


def tokenizer_text(d: Any, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_concurrent_requests_match_each_alone(pipeline: Any) -> None:
    """Three requests with different prompts and sampling (two sampled with their own settings
    and seeds, one greedy), in flight together, give the same tokens, codes and waveform as
    each run alone: no state is shared between requests. The stages' step logs show that they
    did share steps, and the KV pools hold nothing once they are done."""
    lt, coord = pipeline
    a = {
        **conversation("audio_image"),
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 1,
        "talker_temperature": 0.9,
        "talker_seed": 11,
        "max_tokens": 10,
        "talker_max_tokens": 24,
    }
    b = {**conversation("text"), "temperature": 1.0, "seed": 2, "talker_temperature": 0.7,
         "talker_top_k": 20, "talker_seed": 12, "max_tokens": 8, "talker_max_tokens": 20,
         "speaker": "chelsie"}  # fmt: skip
    c = {**conversation("image"), **GREEDY}
    alone = [lt.run(run_request(coord, p)) for p in (a, b, c)]
    before = lt.run(coord.stats())

    async def together() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(run_request(coord, p) for p in (a, b, c))))

    both = lt.run(together())
    after = lt.run(coord.stats())
    for stage in ("thinker", "talker_ar"):
        (process,) = [p for p, st in after.items() if stage in st.steps]
        known = {start for start, _ in before[process].steps[stage]}
        log = zip(after[process].steps[stage], after[process].batches[stage], strict=True)
        new = [n for (start, _), n in log if start not in known]
        assert max(new) >= 2, (stage, new)  # a step served two or three of them at once
        in_use, blocks, evicted, _ = after[process].kv[stage]
        assert in_use == 0 and blocks > 0 and evicted == 0
    for x, y in zip(alone, both, strict=True):
        assert x["text_ids"] == y["text_ids"] and len(x["text_ids"]) > 0
        np.testing.assert_array_equal(x["codes"], y["codes"])
        # code2wav decodes chunks of equal shape from both requests in one call: other BLAS
        # blocking, the same samples to float noise.
        np.testing.assert_allclose(x["wav"], y["wav"], atol=1e-5)
    assert alone[0]["text_ids"] != alone[1]["text_ids"]
