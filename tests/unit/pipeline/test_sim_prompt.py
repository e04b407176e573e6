"""Simulated stages charge a conversation payload for what it holds: the audio windows not yet
encoded, the prompt past a session's kept prefix; a prefill-only request; every step's cost
split among the requests it served."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import yaml

from realtime_omni.pipeline.executor import StageContext
from realtime_omni.pipeline.sim_prompt import audio_tokens, shared_tokens, truncated
from realtime_omni.pipeline.simulated import SimulatedExecutor
from tests.conftest import ROOT
from tests.unit.pipeline.test_simulated import Clock

RATE = 16000
PRICE = 0.5  # thinker ms per prompt token: first_step_ms 500 / prompt_tokens 1000


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("realtime_omni.pipeline.simulated.time.sleep", c)
    return c


def stage(role: str, budget: int = 4096, **params: Any) -> Any:
    ctx = StageContext("s", "cpu", {"role": role, **params}, {}, ["next"],
                       max_prefill_tokens_per_step=budget)  # fmt: skip
    return SimulatedExecutor(ctx)


def thinker(budget: int = 4096) -> Any:
    return stage("generate", budget, first_step_ms=500, prompt_tokens=1000, step_ms=10,
                 context_tokens=300, image_tokens=100)  # fmt: skip


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(int(seconds * RATE)).astype(np.float32)


def turn(audio: np.ndarray, **extra: Any) -> dict[str, Any]:
    """A conversation payload whose last user turn is `audio` and a camera frame after it."""
    content = [{"type": "audio", "audio": "a0"}, {"type": "image", "image": "i0"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    image = np.zeros((8, 8, 3), np.uint8)
    return {"messages": messages, "a0": audio, "i0": image, "session_id": "s", **extra}


def windows(audio: np.ndarray, **extra: Any) -> dict[str, Any]:
    """What preprocessing tells the next stages of `turn(audio)`."""
    pre = stage("transform", audio_window_frames=800)
    pre.add_request("p", {"client": turn(audio, **extra)})
    return dict(pre.reqs["p"].meta)  # what its step emits, without the step


def test_audio_tokens_count_as_the_audio_tower_does() -> None:
    # transformers' _get_feat_extract_output_lengths at these lengths (checked against it)
    got = [audio_tokens(f) for f in (1, 7, 50, 99, 100, 101, 800, 850, 1650, 2000)]
    assert got == [1, 1, 7, 13, 13, 14, 104, 111, 215, 260]


def test_preprocessing_reads_the_turns_audio_as_the_encoders_windows(clock: Clock) -> None:
    audio = speech(16.5)
    whole = windows(audio)["audio_windows"]
    assert [n for _, n in whole] == [104, 104, 7]  # two 8 s windows and 0.5 s
    part = windows(audio[: int(8.5 * RATE)])["audio_windows"]
    assert part[0] == whole[0] and part[1] != whole[1]  # the same first window; a new tail
    assert "audio_windows" not in windows(audio)["messages"][1]  # nothing else is touched


def test_the_audio_encoder_pays_for_windows_it_has_not_encoded(clock: Clock) -> None:
    enc = stage("transform", first_step_ms=60, per_token_ms=0.5)
    audio = speech(20)
    for rid, seconds in (("a", 8.5), ("b", 16.5), ("c", 20)):
        enc.add_request(rid, {"pre": windows(audio[: int(seconds * RATE)])})
        enc.step()
    # a: window 1 and a 7-token tail; b: window 2 and a new tail; c: its 4 s tail (52 tokens)
    assert clock.slept == [111 * 0.5, 111 * 0.5, 52 * 0.5]
    enc.add_request("again", {"pre": windows(audio)})
    enc.step()
    assert clock.slept[-1] == 0  # the whole turn again: every window is kept
    enc.add_request("plain", {"pre": {"max_tokens": 3}})
    enc.step()
    assert clock.slept[-1] == 60  # a synthetic request: the fixed figure


def test_a_turn_prefilled_while_spoken_leaves_its_last_part_to_the_answer(clock: Clock) -> None:
    audio = speech(20)
    part = windows(audio[: int(8.5 * RATE)], prefill_only=True)
    th = thinker()
    th.add_request("p1", {"pre": part})
    assert [e.done for e in th.step()] == [True]
    assert clock.slept == [(300 + 111) * PRICE]  # context, window 1, tail: no image
    assert th.sessions["s"] == [("context", 300), *part["audio_windows"]]
    th.add_request("answer", {"pre": {**windows(audio), "max_tokens": 2}})
    token = next(e.data for e in th.step() if e.data)
    # context and window 1 were kept: window 2, the 4 s tail and the image are prefilled
    assert clock.slept[-1] == (104 + 52 + 100) * PRICE
    assert token["cached_tokens"] == 404 and token["prefill_tokens"] == 256
    fresh = thinker()
    fresh.add_request("whole", {"pre": {**windows(audio), "max_tokens": 2}})
    fresh.step()
    assert clock.slept[-1] == (300 + 260 + 100) * PRICE  # the same turn in one prefill


def test_a_prefill_only_request_makes_nothing_and_keeps_its_prefix(clock: Clock) -> None:
    th = thinker()
    th.add_request("p", {"pre": windows(speech(2), prefill_only=True)})
    emits = th.step()
    assert [(e.request_id, e.data, e.done) for e in emits] == [("p", None, True)]
    assert not th.reqs and list(th.sessions) == ["s"]
    assert th.step_shares() == {"p": (300 + 26) * PRICE / 1000}


def test_a_step_of_prefill_alone_costs_at_least_a_decode_steps_weights(clock: Clock) -> None:
    th = stage("generate", first_step_ms=100, prompt_tokens=1000, step_ms=12, context_tokens=1)
    th.add_request("p", {"pre": windows(speech(1), prefill_only=True)})  # 14 tokens: 1.4 ms
    th.step()
    assert clock.slept == [12]


def test_an_abort_mid_prefill_keeps_what_was_prefilled(clock: Clock) -> None:
    th = thinker(budget=100)
    th.add_request("p", {"pre": windows(speech(2), prefill_only=True)})
    th.step()
    th.step()
    th.abort("p")  # after 200 of its 326 tokens
    assert th.sessions["s"] == [("context", 200)]
    th.add_request("a", {"pre": {**windows(speech(2)), "max_tokens": 1}})
    for _ in range(5):
        th.step()
    assert sum(clock.slept[2:]) == (326 + 100 - 200) * PRICE


def test_a_request_waits_for_its_sessions_prefill_only_request(clock: Clock) -> None:
    th = thinker(budget=200)
    audio = speech(9)
    th.add_request("p", {"pre": windows(audio[: 8 * RATE + 800], prefill_only=True)})
    th.add_request("a", {"pre": {**windows(audio), "max_tokens": 1}})
    th.step()  # p's first 200 tokens; `a` waits rather than take no prefix
    assert th.shares == {"p": 200 * PRICE / 1000}
    got = [e for _ in range(4) for e in th.step()]
    token = next(e.data for e in got if e.data)
    assert token["cached_tokens"] == 404  # p's context and window 1


def test_a_steps_shares_add_up_to_its_cost(clock: Clock) -> None:
    th = stage("generate", first_step_ms=100, prompt_tokens=100, step_ms=10, per_request_ms=2)
    th.add_request("a", {"pre": {"max_tokens": 5}})
    th.step()
    th.add_request("b", {"pre": {"max_tokens": 5}})
    th.step()  # a decodes (10 + 2) beside b's prefill (100)
    assert th.step_shares() == pytest.approx({"a": 0.012, "b": 0.1})
    assert clock.slept[-1] == pytest.approx(112)
    chunk = stage("chunk", base_ms=3, step_ms=1, longest_ms=2, first_chunk=2, chunk=2)
    for rid, n in (("x", 2), ("y", 4)):
        chunk.add_request(rid, {})
        for _ in range(n):
            chunk.add_item(rid, "up", {"token_time": 0.0})
    chunk.step()  # two chunks of 2: 3 + 1 x 4 + 2 x 2
    assert sum(chunk.step_shares().values()) * 1000 == pytest.approx(clock.slept[-1]) == 11


def test_blocks_share_their_common_start() -> None:
    kept = [("context", 300), ("w1", 104), ("t", 7)]
    assert shared_tokens(kept, [("context", 300), ("w1", 104), ("w2", 104)]) == 404
    assert shared_tokens([("context", 120)], [("context", 300), ("w1", 9)]) == 120
    assert shared_tokens(kept, kept) == 410  # one token is always left to compute
    assert truncated(kept, 350) == [("context", 300), ("w1", 50)]


def test_a_conversation_without_an_image_costs_no_image_work(clock: Clock) -> None:
    """A call with no camera: no image tokens in the thinker's prompt, no image encoder step;
    the talker prefills the same prompt past its own kept prefix."""
    pre = stage("transform", audio_window_frames=800)
    payload = turn(speech(2))
    payload["messages"][-1]["content"].pop()  # the camera frame
    pre.add_request("p", {"client": payload})
    meta = dict(pre.reqs["p"].meta)
    assert meta["image"] is False
    enc = stage("transform", first_step_ms=148, skip_without_image=True)
    enc.add_request("p", {"pre": meta})
    enc.step()
    assert enc.step_shares() == {"p": 0.0}
    talker = stage("follow", first_step_ms=210, prompt_tokens=1214, step_ms=20,
                   context_tokens=300, image_tokens=784, per_input=2)  # fmt: skip
    talker.add_request("a", {"pre": {**meta, "max_tokens": 1}})
    talker.add_item("a", "thinker", {"token_time": 0.0})
    talker.step()
    assert talker.step_shares()["a"] == pytest.approx(210 / 1214 * (300 + 26) / 1000)
    talker.end_stream("a", "thinker")
    assert [e.done for e in talker.step()] == [False, True]  # its second frame, and done
    assert talker.sessions["s"] == [("context", 300), *meta["audio_windows"]]  # kept


def test_a_first_pass_costs_at_least_its_sources_figure_a_continuation_per_token(
    clock: Clock,
) -> None:
    """The floors (the report's audio figures): every encoder pass, and a conversation's first
    prefill in the thinker and the talker; a prefill past a kept prefix pays per token."""
    enc = stage("transform", first_step_ms=60, per_token_ms=0.5, min_step_ms=60)
    audio = speech(3)  # 39 tokens: 19.5 ms
    enc.add_request("a", {"pre": windows(audio)})
    enc.step()
    enc.add_request("again", {"pre": windows(audio)})  # every window encoded: no pass
    enc.step()
    enc.add_request("long", {"pre": windows(speech(20, seed=1))})  # 260 tokens: 130 ms
    enc.step()
    assert clock.slept == [60, 0, 130]

    th = stage("generate", first_step_ms=500, prompt_tokens=1000, step_ms=10, context_tokens=30,
               min_prefill_ms=88)  # fmt: skip
    th.add_request("p", {"pre": windows(audio, prefill_only=True)})  # 30 + 39 tokens: 34.5 ms
    th.step()
    assert clock.slept[-1] == 88
    th.add_request("answer", {"pre": {**windows(speech(4)), "max_tokens": 1}})
    th.step()  # the context was kept: its 52 audio tokens at 0.5 ms
    assert clock.slept[-1] == 26

    talker = stage("follow", first_step_ms=210, prompt_tokens=1214, step_ms=20,
                   context_tokens=300, per_input=2, min_prefill_ms=57)  # fmt: skip
    talker.add_request("a", {"pre": {**windows(speech(2)), "max_tokens": 1}})
    talker.add_item("a", "thinker", {"token_time": 0.0})
    talker.step()  # 326 tokens at 210 / 1214 ms: 56.4 ms, under the floor
    assert talker.step_shares()["a"] == pytest.approx(0.057)


def test_an_audio_only_first_turn_costs_at_least_the_reports_first_packet(clock: Clock) -> None:
    """configs/simulated-qwen3-omni.yaml's stages, a 3 s spoken turn with no image, through to
    the vocoder's first chunk: the compute is at least the Qwen3-Omni report's theoretical first
    packet for audio in, 72 + 88 + 57 + 14 + 3 = 234 ms (it was ~178 before the floors)."""
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())

    def of(name: str) -> Any:
        params = cfg["stages"][name]["params"]
        return SimulatedExecutor(StageContext(name, "cpu", params, {}, ["next"]))

    payload = turn(speech(3))
    payload["messages"][-1]["content"].pop()  # no camera
    pre = of("preprocessing")
    pre.add_request("r", {"client": payload})
    meta = next(e.data for e in pre.step() if e.data)
    meta = {k: v for k, v in meta.items() if not isinstance(v, np.ndarray)} | {"max_tokens": 4}
    enc, thinker, talker, vocoder = (of(n) for n in ("audio_encoder", "thinker", "talker_ar",
                                                     "code2wav"))  # fmt: skip
    for stage in (enc, thinker, talker, vocoder):
        stage.add_request("r", {"pre": meta})
    enc.step()
    token = next(e.data for e in thinker.step() if e.data)
    talker.add_item("r", "thinker", token)
    frames = [e.data for e in talker.step() if e.data]
    talker.add_item("r", "thinker", token)
    frames += [e.data for e in talker.step() if e.data]
    for frame in frames[:2]:
        vocoder.add_item("r", "talker_ar", frame)
    assert [e for e in vocoder.step() if e.data]  # its first chunk: two frames
    assert sum(clock.slept) >= 234, clock.slept
