"""`aio.run`: the server's loop is uvloop's where installed, asyncio's on request."""

import asyncio
import threading
from unittest import mock

import pytest

from realtime_omni import aio
from realtime_omni.aio import ReadPace


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_and_asyncio_on_request() -> None:
    pytest.importorskip("uvloop")  # a dependency on Linux
    assert aio.DEFAULT_LOOP == "uvloop"
    assert aio.run(loop_module()).startswith("uvloop")
    assert aio.run(loop_module(), "asyncio").startswith("asyncio")


def test_the_default_executor_threads_are_named_as_on_asyncio() -> None:
    async def name() -> str:
        return await asyncio.to_thread(lambda: threading.current_thread().name)

    for loop in aio.LOOPS:
        assert aio.run(name(), loop).startswith("asyncio_"), loop


def test_an_unknown_loop_is_refused_by_name() -> None:
    coro = loop_module()
    with pytest.raises(ValueError, match="'trio': one of asyncio, uvloop"):
        aio.run(coro, "trio")
    coro.close()


def test_reads_past_the_burst_wait_for_the_rate() -> None:
    """A client sending past its byte rate is not read until it is back under: 10 MB at 2 MB/s
    beyond a 4 MB burst waits 3 s in all."""
    now = [0.0]
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    async def body() -> None:
        pace = ReadPace(2e6, 4e6, clock=lambda: now[0])
        for _ in range(10):
            await pace.took(1_000_000)

    with mock.patch("realtime_omni.aio.asyncio.sleep", sleep):
        asyncio.run(body())
    assert sum(slept) == pytest.approx(3.0)
    assert len(slept) == 6  # none within the burst, then one a message
