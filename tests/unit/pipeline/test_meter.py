"""ComputeMeter: a step's seconds split among the requests it served, taken once."""

from __future__ import annotations

import pytest

from realtime_omni.pipeline.meter import ComputeMeter


def test_a_step_is_split_by_its_shares_and_each_part_is_taken_once() -> None:
    meter = ComputeMeter()
    meter.charge("thinker", 0.3, {"a": 1.0, "b": 2.0})
    meter.charge("thinker", 0.1, {"a": 1.0})
    meter.charge("talker", 0.05, {"a": 0.0})  # no weight: busy time, charged to nobody
    assert meter.take("thinker", "a") == pytest.approx(0.2)
    assert meter.take("thinker", "a") == 0.0
    assert meter.take("thinker", "b") == pytest.approx(0.2)
    assert meter.take("talker", "a") == 0.0
    assert meter.busy_s == pytest.approx({"thinker": 0.4, "talker": 0.05})
    assert meter.spent == {}
