"""A simulated GPU's time shared by the stage processes that name it (pipeline/sim_device.py)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import time
from pathlib import Path

import pytest

from realtime_omni.pipeline import sim_device
from realtime_omni.pipeline.sim_device import SharedDevice


class FakeTime:
    """sleep advances monotonic: a step's length without waiting for it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_step_takes_its_cost_alone_and_its_share_beside_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeTime()
    monkeypatch.setattr(sim_device, "time", clock)
    gpu, other, third = (SharedDevice(str(tmp_path), "0") for _ in range(3))
    gpu.spend(0.05)
    assert clock.now == pytest.approx(0.05)
    with other.busy():
        assert gpu.stepping() == 1
        gpu.spend(0.05)
        assert clock.now == pytest.approx(0.15)  # half speed beside one other
        with third.busy():
            gpu.spend(0.05)
    assert clock.now == pytest.approx(0.30)  # a third speed beside two
    assert gpu.stepping() == 0
    elsewhere = SharedDevice(str(tmp_path), "1")
    with other.busy():
        elsewhere.spend(0.05)  # another GPU: not shared
    assert clock.now == pytest.approx(0.35)


def test_a_dead_processs_slot_is_freed_by_the_next_to_open_the_device(tmp_path: Path) -> None:
    """A stage killed mid-step leaves its slot stepping; its replacement frees it."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    gpu = SharedDevice(str(tmp_path), "0")
    sim_device._SLOT.pack_into(gpu._map, 5 * sim_device._SLOT.size, gone.pid, 1)
    assert gpu.stepping() == 1
    SharedDevice(str(tmp_path), "0")
    assert gpu.stepping() == 0


def _spend(run_dir: str, cost: float, took: mp.Queue[float]) -> None:
    gpu = SharedDevice(run_dir, "0")
    t0 = time.monotonic()
    gpu.spend(cost)
    took.put(time.monotonic() - t0)


def test_two_processes_stepping_at_once_each_take_about_twice_as_long(tmp_path: Path) -> None:
    """Real processes through the mapped file: each 0.3 s step, run together, takes about
    0.6 s (a lower bound only: a busy machine makes a step slower, never faster)."""
    took: mp.Queue[float] = mp.Queue()
    procs = [mp.Process(target=_spend, args=(str(tmp_path), 0.3, took)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    times = sorted(took.get(timeout=5) for _ in procs)
    assert times[0] >= 0.45, times  # together for most of it: at least 1.5x
