"""Batched stages give every request what it gets alone (and what `generate` gives).

The tiny config's stages run in this process (`inproc.py`), so the test decides when requests
arrive and which share a step: with `max_batch` 8, prompts of different lengths and modalities
arrive a few steps apart, the thinker prefills them in small chunks beside the decode rows, one
request is aborted half way, and each request's text tokens, codec frames and waveform must
equal the same request run alone with `max_batch` 1. The real stage processes are checked
against `generate` in test_equivalence.py with the same (batched) default config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import conversation, generate

KINDS = ["text", "audio", "image", "audio_image"]
GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 10, "talker_max_tokens": 24}


def pipeline(max_batch: int, prefill_tokens: int = 512) -> InProcess:
    cfg = tiny_config()
    for stage in cfg["stages"].values():
        stage["max_batch"] = max_batch
        stage["max_prefill_tokens_per_step"] = prefill_tokens
    return InProcess(cfg)


def result(p: InProcess, rid: str) -> dict[str, Any]:
    out = p.outputs[rid]
    audio = out["code2wav"]
    return {
        "text_ids": [o["token_id"] for o in out["decode"]],
        "codes": np.concatenate([o["codes"] for o in audio]),
        "wav": np.concatenate([o["pcm"] for o in audio]),
    }


def alone(payloads: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    p = pipeline(1)
    got = {}
    for rid, payload in payloads.items():
        p.submit(rid, payload)
        p.run()
        got[rid] = result(p, rid)
    assert max(p.batches["thinker"]) == 1
    return got


def together(payloads: dict[str, dict[str, Any]], abort: str | None = None) -> InProcess:
    """Requests arriving three steps apart into 8-wide stages that prefill 24 tokens a step;
    `abort` arrives first and is aborted once every request has started speaking."""
    p = pipeline(8, prefill_tokens=24)
    if abort:
        p.submit(abort, {**conversation("audio"), **GREEDY, "max_tokens": 40})
    for rid, payload in payloads.items():
        p.submit(rid, payload)
        for _ in range(3):
            p.step()
    if abort:
        while any(not p.outputs[rid]["code2wav"] for rid in payloads):
            p.step()
        p.abort(abort)
    p.run()
    return p


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["text_ids"] == b["text_ids"] and a["text_ids"]
    np.testing.assert_array_equal(a["codes"], b["codes"])
    assert a["wav"].shape == b["wav"].shape
    np.testing.assert_allclose(a["wav"], b["wav"], atol=1e-5)


@pytest.mark.slow
def test_batched_requests_match_each_alone_and_generate(tiny_dir: Path) -> None:
    payloads = {k: {**conversation(k), **GREEDY} for k in KINDS}
    ref = alone(payloads)
    p = together(payloads, abort="aborted")
    for rid in KINDS:
        assert_same(result(p, rid), ref[rid])
    # The steps really were shared, and the aborted request left nothing behind.
    assert max(p.batches["thinker"]) >= 4 and max(p.batches["talker_ar"]) >= 4
    assert max(p.batches["code2wav"]) >= 2
    for name in ("thinker", "talker_ar"):
        ex = p.stages[name].executor
        assert not ex.reqs and ex.cache.in_use() == 0  # type: ignore[attr-defined]
    gen = generate(tiny_dir, payloads["audio_image"], GREEDY["max_tokens"], 24)
    assert ref["audio_image"]["text_ids"] == gen["text_ids"]
    np.testing.assert_array_equal(ref["audio_image"]["codes"], gen["codes"])


@pytest.mark.slow
def test_sampled_requests_do_not_depend_on_their_batch(tiny_dir: Path) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "talker_temperature": 0.9,
               "max_tokens": 8, "talker_max_tokens": 16}  # fmt: skip
    payloads = {
        f"s{i}": {**conversation(k), **sampled, "seed": i, "talker_seed": 10 + i}
        for i, k in enumerate(["text", "audio", "text"])
    }
    ref = alone(payloads)
    p = together(payloads)
    for rid in payloads:
        assert_same(result(p, rid), ref[rid])
    assert ref["s0"]["text_ids"] != ref["s2"]["text_ids"]  # same prompt, other seed


@pytest.mark.slow
def test_a_one_token_answer_gives_the_talker_its_end_of_text(tiny_dir: Path) -> None:
    """With max_tokens 1 the only token goes into the talker's prompt head, and the next step
    still gets `tts_eos`, as every longer answer's end does; without it the talker ran on to
    max_frames on `tts_pad`. (generate itself fails on a one-token answer in transformers
    5.24: `_get_talker_assistant_parts` assumes two, so it cannot be the oracle here.)"""
    p = pipeline(1)
    p.submit("one", {**conversation("text"), **GREEDY, "max_tokens": 1})
    talker = p.stages["talker_ar"].executor
    while not p.outputs["one"]["code2wav"] and not talker.reqs.get("one", None):
        p.step()
    while talker.reqs["one"].spoken == 0:  # type: ignore[attr-defined]
        p.step()
    queued = list(talker.reqs["one"].tokens)  # type: ignore[attr-defined]
    assert len(queued) == 1 and queued[0].last  # the next text entry is tts_eos
    p.run()
    assert len(result(p, "one")["text_ids"]) == 1


@pytest.mark.slow
def test_an_answer_that_ends_on_the_stop_token_matches_generate(tiny_dir: Path) -> None:
    """Random weights never write <|im_end|>: make the 5th token of a greedy answer the stop
    token, and the batched stages must end there as generate does, text and speech alike."""
    payload = {**conversation("audio"), **GREEDY}
    ids = alone({"probe": payload})["probe"]["text_ids"]
    k = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    cfg = tiny_config(thinker={"stop_token_ids": [ids[k]]})
    for stage in cfg["stages"].values():
        stage["max_batch"] = 8
    p = InProcess(cfg)
    p.submit("stop", payload)
    p.submit("other", {**conversation("text"), **GREEDY})  # batched beside it
    p.run()
    got = result(p, "stop")
    gen = generate(tiny_dir, payload, GREEDY["max_tokens"], 24, eos=ids[k])
    assert got["text_ids"] == gen["text_ids"] == ids[: k + 1]
    np.testing.assert_array_equal(got["codes"], gen["codes"])


@pytest.mark.slow
def test_encoders_batch_the_requests_waiting_together(tiny_dir: Path) -> None:
    payloads = {k: {**conversation(k), **GREEDY} for k in ("audio", "image", "audio_image")}
    ref = alone(payloads)
    p = pipeline(8)
    sizes: dict[str, list[int]] = {"audio_encoder": [], "image_encoder": []}
    for name, seen in sizes.items():
        ex = p.stages[name].executor
        encode = ex._encode  # type: ignore[attr-defined]
        ex._encode = lambda b, encode=encode, seen=seen: seen.append(len(b)) or encode(b)  # type: ignore[attr-defined]
    for rid, payload in payloads.items():
        p.submit(rid, payload)  # all at once: one encoder step each serves them all
    p.run()
    assert sizes == {"audio_encoder": [2], "image_encoder": [2]}  # one forward for both
    for rid in payloads:
        assert_same(result(p, rid), ref[rid])


@pytest.mark.slow
def test_an_answer_that_ends_on_the_codec_end_matches_generate(tiny_dir: Path) -> None:
    """Random weights never pick the codec's end: with its codec_head row doubled (in both the
    pipeline's talker and generate's), greedy speech ends on it after 20 frames, before
    talker_max_tokens; the batched talker must end there too, frame for frame."""
    from tests.models.reference import load_full

    payload = {**conversation("text"), **GREEDY, "talker_max_tokens": 30}
    model, _ = load_full(tiny_dir)
    eos = model.config.talker_config.codec_eos_token_id
    row = model.talker.codec_head.weight.data[eos]
    saved = row.clone()
    row *= 2
    try:
        gen = generate(tiny_dir, payload, GREEDY["max_tokens"], 30)
    finally:
        row.copy_(saved)
    assert 4 < gen["codes"].shape[0] < 29  # ended on the codec's end, not on the limit
    p = pipeline(8)
    p.stages["talker_ar"].executor.model.codec_head.weight.data[eos] *= 2  # type: ignore[attr-defined]
    p.submit("eos", payload)
    p.submit("other", {**conversation("audio"), **GREEDY})  # batched beside it
    p.run()
    got = result(p, "eos")
    assert got["text_ids"] == gen["text_ids"]
    np.testing.assert_array_equal(got["codes"], gen["codes"])
    np.testing.assert_allclose(got["wav"], gen["wav"], atol=1e-5)
