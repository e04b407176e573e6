"""SimulatedExecutor: what it refuses at load."""

from __future__ import annotations

from typing import Any

import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.executor import StageContext
from realtime_omni.pipeline.simulated import SimulatedExecutor


def test_a_device_torch_cannot_see_is_refused_at_load() -> None:
    pytest.importorskip("torch")
    ctx = StageContext("thinker", "cuda:99", {"role": "generate"}, {})
    with pytest.raises(ConfigError) as info:
        SimulatedExecutor(ctx)
    assert "stages.thinker.device = 'cuda:99'" in str(info.value)
    assert "CUDA device(s) here. Fix: place the stage on cpu" in str(info.value)


def test_an_unknown_role_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"stages\.a\.params\.role = 'sing': unknown"):
        SimulatedExecutor(StageContext("a", "cpu", {"role": "sing"}, {}))


class Clock:
    """Stands in for time.sleep: records what each step would cost."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.slept.append(round(seconds * 1000, 6))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr("realtime_omni.pipeline.simulated.time.sleep", c)
    return c


def executor(role: str, max_batch: int = 32, budget: int = 512, **params: object) -> Any:
    ctx = StageContext(
        "s", "cpu", {"role": role, **params}, {}, ["next"], max_batch=max_batch,
        max_prefill_tokens_per_step=budget,
    )  # fmt: skip
    return SimulatedExecutor(ctx)


def test_a_decode_step_costs_base_plus_per_request(clock: Clock) -> None:
    ex = executor("generate", first_step_ms=10, prompt_tokens=100, step_ms=14, per_request_ms=0.5)
    for i in range(4):
        ex.add_request(f"r{i}", {"a": {"max_tokens": 3}})
    ex.step()  # four prefills of 100 tokens in one 512-token budget: 4 x 10 ms, no decode yet
    assert clock.slept == [40]
    emits = ex.step()
    assert clock.slept[-1] == 14 + 4 * 0.5
    assert sorted(e.request_id for e in emits) == ["r0", "r1", "r2", "r3"]


def test_a_long_prefill_runs_in_chunks_beside_the_decode_rows(clock: Clock) -> None:
    ex = executor("generate", budget=100, first_step_ms=90, prompt_tokens=300, step_ms=10)
    ex.add_request("old", {"a": {"max_tokens": 9}})
    ex.step()
    ex.step()  # old: its prefill is 3 chunks of 100 tokens
    ex.step()
    assert clock.slept == [30, 30, 30]
    ex.add_request("new", {"a": {"max_tokens": 9}})
    got = [{e.request_id for e in ex.step()} for _ in range(3)]
    # Every step decodes `old` (10 ms) beside one 30 ms chunk of new's prefill: no 90 ms stall.
    assert clock.slept[3:] == [40, 40, 40]
    assert got == [{"old"}, {"old"}, {"old", "new"}]


def test_max_batch_bounds_a_step_and_one_means_one_request_per_step(clock: Clock) -> None:
    ex = executor("follow", max_batch=1, first_step_ms=5, step_ms=14, per_request_ms=1)
    for rid in ("a", "b"):
        ex.add_request(rid, {})
        ex.add_item(rid, "up", {"token_time": 0.0})
        ex.add_item(rid, "up", {"token_time": 0.0})
    assert [e.request_id for e in ex.step()] == ["a"]
    assert [e.request_id for e in ex.step()] == ["a"]
    assert clock.slept == [5, 15]
    batched = executor("follow", first_step_ms=5, step_ms=14, per_request_ms=1)
    for rid in ("a", "b"):
        batched.add_request(rid, {})
        batched.add_item(rid, "up", {"token_time": 0.0})
        batched.add_item(rid, "up", {"token_time": 0.0})
    batched.step()
    batched.step()
    assert clock.slept[2:] == [10, 16]  # two prefills, then one step for both


def test_a_chunk_step_costs_every_item_in_it(clock: Clock) -> None:
    ex = executor("chunk", base_ms=2, step_ms=0.5, first_chunk=1, chunk=4)
    for rid in ("a", "b"):
        ex.add_request(rid, {})
        for _ in range(5):
            ex.add_item(rid, "up", {"token_time": 0.0})
    ex.step()  # first chunks: 1 item each
    ex.step()  # then 4 each
    assert clock.slept == [2 + 2 * 0.5, 2 + 8 * 0.5]


def test_a_speaking_chunk_stage_plays_its_speech_in_order_for_each_request(
    clock: Clock, tmp_path: Any
) -> None:
    import wave

    import numpy as np

    voice = (np.sin(np.arange(24000) / 7.0) * 16000).astype(np.int16)  # a second at 24 kHz
    path = tmp_path / "voice.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(voice.tobytes())
    ctx = StageContext(
        "code2wav", "cpu",
        {"role": "chunk", "first_chunk": 1, "chunk": 2, "speech_wav": str(path),
         "outputs": {"client": {"pcm": ["float32", ["n", 1920]]}}},
        {}, ["client"],
    )  # fmt: skip
    ex = SimulatedExecutor(ctx)
    for rid in ("a", "b"):
        ex.add_request(rid, {})
        for _ in range(3):
            ex.add_item(rid, "up", {"token_time": 0.0})
    got: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    for _ in range(2):
        for e in ex.step():
            if e.data is not None:
                got[e.request_id].append(np.asarray(e.data["pcm"]).reshape(-1))
    for pcm in got.values():  # 3 frames: 5,760 samples, the speech looped from its start
        x = np.concatenate(pcm)
        assert len(x) == 3 * 1920
        assert np.allclose(x, np.resize(voice, len(x)) / 32768, atol=1e-6)


def test_speech_text_without_espeak_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr("pathlib.Path.is_file", lambda self: False)
    ctx = StageContext("code2wav", "cpu", {"role": "chunk", "speech_text": "hello"}, {})
    with pytest.raises(ConfigError, match="needs espeak-ng"):
        SimulatedExecutor(ctx)


def test_a_decode_row_costs_the_context_it_reads(clock: Clock) -> None:
    ex = executor("generate", budget=1000, first_step_ms=10, prompt_tokens=1000, step_ms=10,
                  per_context_token_ms=0.01)  # fmt: skip
    ex.add_request("r", {"a": {"max_tokens": 3}})
    ex.step()  # the prefill gives token 0
    ex.step()  # token 1 reads the prompt and token 0: 1,001 tokens
    ex.step()
    assert clock.slept == [10, 20.01, 20.02]


def test_a_follower_that_needs_input_k_for_output_k_waits_for_it_until_the_input_ends(
    clock: Clock,
) -> None:
    ex = executor("follow", first_step_ms=5, step_ms=10, per_input=2, output_needs_input=True)
    ex.add_request("a", {})
    ex.add_item("a", "up", {"token_time": 0.0})
    made = [len(ex.step())]  # output 0 needs input 0
    assert not ex.has_work()  # output 1 needs input 1: two outputs an input only once it ends
    ex.add_item("a", "up", {"token_time": 0.0})
    made.append(len(ex.step()))
    assert not ex.has_work()
    ex.end_stream("a", "up")
    while ex.has_work():
        made.append(len(ex.step()))
    assert sum(made) == 4 + 1  # 2 inputs x 2 outputs, and the request's done


def test_a_chunk_step_costs_its_longest_chunk_beside_its_items(clock: Clock) -> None:
    ex = executor("chunk", longest_ms=2.4, step_ms=0.7, first_chunk=2, chunk=4)
    for rid, n in (("a", 2), ("b", 6)):
        ex.add_request(rid, {})
        for _ in range(n):
            ex.add_item(rid, "up", {"token_time": 0.0})
    ex.step()  # first chunks: 2 items each
    ex.step()  # b's next 4
    assert clock.slept == [round(2.4 * 2 + 0.7 * 4, 6), round(2.4 * 4 + 0.7 * 4, 6)]
