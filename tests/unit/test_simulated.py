"""SimulatedExecutor: what it refuses at load."""

from __future__ import annotations

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
