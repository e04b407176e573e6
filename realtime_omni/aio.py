"""The event loop the server runs on, and `asyncio.wait_for` that keeps a cancel.

`run` starts a loop: uvloop's (libuv, in C) where it is installed, asyncio's otherwise. The
gateway's loop carries every call's media (each WebRTC call sends and receives 50 packets a
second through aiortc), and uvloop's cheaper callbacks and socket calls show there: with 16
calls on two cores, 4-9 % of output frames left late against 17-20 % on asyncio's loop
(`benchmarks/latency.py`).

`asyncio.wait_for` that keeps a cancel:

On Python 3.11, a task cancelled while `wait_for` waits, in the same tick as what it awaits
becomes ready, gets that result instead of the `CancelledError`: the cancel is lost (fixed in
3.12, gh-86296). A loop that awaits that way in every turn then outlives the call that cancelled
it. `asyncio.timeout` counts cancels and has no such window; these wrap it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("auto", "uvloop", "asyncio")


def run(main: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """`asyncio.run(main)` on uvloop's loop (`auto` where it is installed, or `uvloop`) or on
    asyncio's own (`asyncio`, or `auto` without uvloop)."""
    if loop not in LOOPS:
        raise ValueError(f"event loop {loop!r}: one of {', '.join(LOOPS)}")
    if loop == "asyncio" or (loop == "auto" and importlib.util.find_spec("uvloop") is None):
        return asyncio.run(main)
    import uvloop  # a missing one, asked for by name, fails here with its own ImportError

    return uvloop.run(_named_pool(main))


async def _named_pool(main: Coroutine[Any, Any, T]) -> T:
    """`main` with a default executor whose threads are named as asyncio's loop names them
    (`asyncio_N`; uvloop's are `ThreadPoolExecutor-...`), which the server's stats tell apart
    from the threads a call must give back."""
    pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="asyncio")
    asyncio.get_running_loop().set_default_executor(pool)
    return await main


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`await aw`, or TimeoutError after `timeout_s` (None: no limit), as `wait_for` would."""
    async with asyncio.timeout(timeout_s):
        return await aw


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether `event` was set within `timeout_s`."""
    try:
        await within(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
