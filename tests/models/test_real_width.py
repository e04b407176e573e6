"""Every model stage at Qwen3-Omni's published widths, in bfloat16 on the CPU.

configs/real-width-cpu.yaml's stages run in this process (`inproc.py`) on the real-width model
(real_width.py: the published widths, experts, heads, vocabularies and codebooks with 2 layers
per stack, random weights, loaded from its published-layout checkpoint through weights.py).
One run per module: 8 requests (text, audio, image, audio+image, twice, with other content)
each alone, then the 8 arriving together into 8-wide stages; greedy, 4 text tokens, 3 frames.

What "the same" means in bf16. Alone and batched, a request's numbers go through other kernels
(8 rows against 1 in every matmul, other prefill chunks, masked attention), so its logits round
differently: by up to one bf16 ulp of the top logit here (2^-7 of its binade: 0.03 at 4). Each
greedy pick (every text token, every code of every frame) is compared with its twin in order:
the top logits must agree within TOL_ULPS ulps, and the picks must be equal unless the two best
logits are that close in either run (a near-tie, as frequent in bf16 as logits are coarse:
exact ties are common among 2,048 codes); from a pick that differs at a near-tie on, what
follows depends on it and is not compared. Text tokens and the codes that are compared must
match exactly; the waveforms of requests whose codes all match must agree within PCM_ATOL. Seen
on this CPU: every text token the same, 378 of 544 picks compared, 3 of 8 requests the same to
the last sample (code2wav gave identical samples for identical codes).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT, timeout
from tests.models.inproc import InProcess
from tests.models.reference import chirp, conversation
from tests.models.reference import test_image as image_array

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 4, "talker_max_tokens": 4}
KINDS = ["text", "audio", "image", "audio_image"] * 2
TOL_ULPS = 2
PCM_ATOL = 2.0**-7  # one bf16 ulp at the waveform's peak (1.0); seen: identical


class Pick(NamedTuple):
    token: int
    top: float  # the best logit
    margin: float  # it minus the second best


def payloads() -> dict[str, dict[str, Any]]:
    """8 requests; request i's thinker sampler has seed 100 + i, its talker's 200 + 2i and its
    code predictor's 201 + 2i (unused by greedy picks: they name whose pick is recorded)."""
    out = {}
    for i, kind in enumerate(KINDS):
        p = {**conversation(kind), **GREEDY, "seed": 100 + i, "talker_seed": 200 + 2 * i}
        if "audio0" in p:
            p["audio0"] = chirp(1.0 + 0.25 * i)
        if "image0" in p:
            p["image0"] = np.roll(image_array(), 7 * i, axis=1)
        if kind == "text":
            p["messages"][1]["content"][0]["text"] += " please" * (1 + i)
        out[f"r{i}"] = p
    return out


@pytest.fixture(scope="module")
def runs(real_width_dir: Path) -> Iterator[dict[str, Any]]:
    from realtime_omni.models.qwen3_omni import sampling

    picks: dict[int | None, list[Pick]] = {}
    init, pick = sampling.BatchPicker.__init__, sampling.BatchPicker.pick

    def recording_init(self: Any, samplers: list[Any], *a: Any, **k: Any) -> None:
        init(self, samplers, *a, **k)
        self.seeds = [s.seed for s in samplers]

    def recording_pick(self: Any, logits: Any) -> Any:
        out = pick(self, logits)
        best = logits.float().topk(2, dim=-1).values
        for i, seed in enumerate(self.seeds):
            top, second = float(best[i, 0]), float(best[i, 1])
            picks.setdefault(seed, []).append(Pick(int(out[i]), top, top - second))
        return out

    cfg = yaml.safe_load((ROOT / "configs" / "real-width-cpu.yaml").read_text())
    for stage in cfg["stages"].values():
        stage["max_batch"] = 8
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling.BatchPicker, "__init__", recording_init)
        mp.setattr(sampling.BatchPicker, "pick", recording_pick)
        p = InProcess(cfg)
        encoded = _record_encoder_outputs(p)
        reqs = payloads()
        for rid, payload in reqs.items():
            p.submit(rid, payload)
            p.run()
        alone = {rid: _result(p, rid) for rid in reqs}
        alone_picks = dict(picks)
        picks.clear()
        p.batches.clear()
        for rid, payload in reqs.items():
            p.submit(f"b{rid}", payload)
        p.run()
        yield {
            "p": p,
            "alone": alone,
            "batched": {rid: _result(p, f"b{rid}") for rid in reqs},
            "alone_picks": alone_picks,
            "batched_picks": dict(picks),
            "encoded": encoded,
        }


def _record_encoder_outputs(p: InProcess) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {"audio_encoder": [], "image_encoder": []}
    for name, outputs in seen.items():
        ex = p.stages[name].executor
        encode = ex._encode  # type: ignore[attr-defined]

        def recording(batch: Any, encode: Any = encode, outputs: Any = outputs) -> Any:
            out = encode(batch)
            outputs.extend(out)
            return out

        ex._encode = recording  # type: ignore[attr-defined]
    return seen


def _result(p: InProcess, rid: str) -> dict[str, Any]:
    out = p.outputs[rid]
    return {
        "text_ids": [o["token_id"] for o in out["decode"]],
        "codes": np.concatenate([o["codes"] for o in out["code2wav"]]),
        "pcm": np.concatenate([o["pcm"] for o in out["code2wav"]]),
    }


def test_loading_holds_each_part_and_nothing_more(real_width_dir: Path) -> None:
    """benchmarks/real_width.py's loading measure, in a fresh process (before this module's
    pipeline is built: the two would hold the model twice): every part's RSS peak is its final
    size (each tensor is read into place), and the final size is its parameters'."""
    child = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "real_width.py"), "--load-child",
         str(real_width_dir)],
        check=True, capture_output=True, text=True, timeout=timeout(120),
    )  # fmt: skip
    got = json.loads(child.stdout.strip().splitlines()[-1])
    slack = 256 << 20  # allocator and interpreter noise
    for part in got["parts"]:
        assert part["peak_bytes"] <= part["final_bytes"] + slack, part
        assert part["final_bytes"] <= 1.05 * part["param_bytes"] + slack, part
    assert got["load_peak_bytes"] <= 1.1 * (got["final_bytes"] + got["layer_bytes"])
    assert got["layer_bytes"] > 1.2e9  # a thinker layer: 128 experts of 2,048 x 768 x 3


def test_a_spoken_request_with_an_image_goes_through_every_stage(runs: dict[str, Any]) -> None:
    import torch

    p = runs["p"]
    got = runs["alone"]["r3"]  # audio + image, alone
    assert len(got["text_ids"]) == GREEDY["max_tokens"]
    assert all(0 <= t < 152064 for t in got["text_ids"])
    frames = got["codes"].shape[0]
    assert got["codes"].shape == (frames, 16) and frames >= 2
    assert ((got["codes"] >= 0) & (got["codes"] < 2048)).all()
    # Streamed code2wav makes what one call over the frames makes: n x 1,920 - 555 samples.
    assert got["pcm"].shape == (frames * 1920 - 555,) and np.isfinite(got["pcm"]).all()
    assert np.abs(got["pcm"]).max() > 0
    # The published widths, in bf16, in every stage.
    thinker = p.stages["thinker"].executor.model
    assert thinker.lm_head.weight.shape == (152064, 2048)
    assert thinker.lm_head.weight.dtype == torch.bfloat16
    experts = thinker.model.language_model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (128, 2 * 768, 2048)
    talker = p.stages["talker_ar"].executor.model
    assert talker.model.layers[0].mlp.experts.gate_up_proj.shape == (128, 2 * 384, 1024)
    assert talker.codec_head.weight.shape == (3072, 1024)
    assert talker.code_predictor.lm_head[0].weight.shape == (2048, 1024)
    code2wav = p.stages["code2wav"].executor.model
    assert code2wav.code_embedding.weight.shape == (16 * 2048, 1024)
    assert code2wav.config.decoder_dim == 1536
    audio, image = runs["encoded"]["audio_encoder"][1], runs["encoded"]["image_encoder"][1]
    assert audio["audio_embeds"].shape[-1] == 2048 == image["image_embeds"].shape[-1]
    assert image["deepstack"].shape[0] == 2  # one tap per vision block
    assert audio["audio_embeds"].dtype == torch.bfloat16


def test_a_batch_of_eight_gives_each_request_what_it_gives_alone(runs: dict[str, Any]) -> None:
    p, alone, batched = runs["p"], runs["alone"], runs["batched"]
    for stage in ("thinker", "talker_ar", "image_encoder", "audio_encoder"):
        assert max(p.batches[stage]) >= 4, stage  # the steps really were shared
    assert max(p.batches["code2wav"]) >= 2
    compared = total = whole = 0
    for i, rid in enumerate(alone):
        a, b = runs["alone_picks"], runs["batched_picks"]
        n_text = _compare(a[100 + i], b[100 + i], f"{rid} text")
        assert alone[rid]["text_ids"][:n_text] == batched[rid]["text_ids"][:n_text]
        compared, total = compared + n_text, total + len(a[100 + i])
        speech_a, speech_b = _speech(a, i), _speech(b, i)
        total += len(speech_a)
        if n_text < len(a[100 + i]):
            continue  # the talker was fed other text
        n_speech = _compare(speech_a, speech_b, f"{rid} speech")
        compared += n_speech
        frames = n_speech // 16
        np.testing.assert_array_equal(alone[rid]["codes"][:frames], batched[rid]["codes"][:frames])
        if n_speech == len(speech_a):
            whole += 1
            assert alone[rid]["pcm"].shape == batched[rid]["pcm"].shape
            np.testing.assert_allclose(alone[rid]["pcm"], batched[rid]["pcm"], atol=PCM_ATOL)
    # Most picks were compared, and some requests matched to the last sample.
    assert compared >= total // 2 and whole >= 2, (compared, total, whole)


def _speech(picks: dict[int | None, list[Pick]], i: int) -> list[Pick]:
    """Request i's talker picks in the order they were made: per frame code 0, then the code
    predictor's 15."""
    code0, rest = picks[200 + 2 * i], picks[201 + 2 * i]
    assert len(rest) == 15 * len(code0)
    return [x for f, c in enumerate(code0) for x in (c, *rest[15 * f : 15 * f + 15])]


def _compare(alone: list[Pick], batched: list[Pick], what: str) -> int:
    """How many picks, in order, are the same alone and batched (see the module docstring):
    all of them, or those before the first that differs, which must be a near-tie."""
    for n, (a, b) in enumerate(zip(alone, batched, strict=False)):
        tol = TOL_ULPS * _ulp(max(abs(a.top), abs(b.top)))
        assert abs(a.top - b.top) <= tol, f"{what} pick {n}: top logit {a.top} against {b.top}"
        if a.token != b.token:
            assert min(a.margin, b.margin) <= tol, f"{what} pick {n}: {a} against {b}"
            return n
    assert len(alone) == len(batched), what
    return len(alone)


def _ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(x, 2.0**-126))) - 7)
