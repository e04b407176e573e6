"""The supervisor's readiness wait, with fake processes that misbehave on purpose: one that is
slow to load, one that exits and says why only afterwards, one that never comes up."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any

import pytest

from realtime_omni.errors import StartupError
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.graph import Graph
from realtime_omni.pipeline.supervisor import Supervisor


class FakeProcess:
    """Alive until `exit(code)`; its pid is ours, so a pidfd on it never signals."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Host:
    def __init__(self) -> None:
        self.down: set[str] = set()

    def send(self, process: str, msg: m.Message) -> None:
        pass

    def moved(self, process: str) -> None:
        pass

    def on_death(self, process: str) -> None:
        pass

    def peer_up(self, process: str) -> Awaitable[None]:
        return asyncio.sleep(0)

    def wake(self) -> None:
        pass


def supervisor() -> Supervisor:
    cfg = parse_config(
        {"name": "t", "entry": "a", "stages": {"a": {"executor": "simulated", "terminal": True}}}
    )
    return Supervisor(cfg, Graph(cfg), os.getpid(), Host())


async def waiting(sup: Supervisor, timeout_s: float = 5.0) -> asyncio.Task[Any]:
    sup.loop = asyncio.get_running_loop()
    sup.ready["a#0"] = sup.loop.create_future()
    sup.procs["a#0"] = FakeProcess()  # type: ignore[assignment]
    task = asyncio.ensure_future(sup.wait_ready(["a#0"], timeout_s))
    await asyncio.sleep(0.05)
    assert not task.done()
    return task


def test_the_wait_ends_on_the_ready_without_polling() -> None:
    async def body() -> None:
        sup = supervisor()
        task = await waiting(sup)
        assert not sup.on_ready("a#0", 0)  # a local process: no peer-up round to run
        await asyncio.wait_for(task, 0.5)

    asyncio.run(body())


def test_a_process_that_exits_is_named_with_the_error_it_sent_just_after() -> None:
    async def body() -> None:
        sup = supervisor()
        task = await waiting(sup)
        proc = sup.procs["a#0"]
        assert isinstance(proc, FakeProcess)
        proc.returncode = 1
        sup._notify()  # as its pidfd would
        await asyncio.sleep(0.1)  # its StageError is still on its way
        sup.on_startup_error("a", "FileNotFoundError: no weights for a")
        with pytest.raises(StartupError, match=r"a#0 \(a\) failed to start: FileNotFoundError"):
            await asyncio.wait_for(task, 1.0)

    asyncio.run(body())


def test_a_process_that_never_comes_up_is_named_at_the_timeout() -> None:
    async def body() -> None:
        sup = supervisor()
        task = await waiting(sup, timeout_s=0.2)
        with pytest.raises(StartupError, match=r"not ready after 0 s: a#0 \(a\)"):
            await asyncio.wait_for(task, 1.0)

    asyncio.run(body())
