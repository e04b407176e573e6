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
