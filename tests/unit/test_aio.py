"""`aio.run`: the server's loop is uvloop's where installed, asyncio's on request."""

import asyncio
import threading

import pytest

from realtime_omni import aio


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
