"""Fixtures for the model tests: the tiny and real-width checkpoints (built once per machine,
cached under `.cache/`) and one pipeline of real stage processes shared by a module's tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from realtime_omni.pipeline.config import parse_config
from tests.conftest import ROOT, timeout

SEED = 0


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny

    return ensure_tiny(SEED)


@pytest.fixture(scope="session")
def real_width_dir() -> Path:
    """The real-width model (real_width.py), built once per machine (~25 s, 5.2 GB)."""
    from realtime_omni.models.qwen3_omni.real_width import ensure_real_width

    return ensure_real_width(SEED)


def tiny_config(**params: dict[str, Any]) -> dict[str, Any]:
    """configs/tiny.yaml as a dict, stage params updated from `params`."""
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    for stage, extra in params.items():
        data["stages"][stage].setdefault("params", {}).update(extra)
    return data


class LoopThread:
    """An event loop in a thread, so a Coordinator keeps its heartbeats while a test computes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], limit_s: float = 120) -> Any:
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout(limit_s)), self.loop)
        return fut.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture(scope="module")
def pipeline(tiny_dir: Path) -> Iterator[tuple[LoopThread, Any]]:
    from realtime_omni.pipeline.coordinator import Coordinator

    lt = LoopThread()
    coord = Coordinator(parse_config(tiny_config()))
    lt.run(coord.start(), limit_s=180)
    try:
        yield lt, coord
    finally:
        lt.run(coord.close())
        lt.close()
