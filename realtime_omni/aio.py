"""The event loop the server runs on, and `asyncio.wait_for` that keeps a cancel.

`run` starts a loop: asyncio's own, or uvloop's (libuv, in C) on request (`serve --loop
uvloop`). The gateway's loop carries every call's media (each WebRTC call sends and receives 50
packets a second through aiortc), and uvloop's cheaper callbacks and socket calls show there:
with 16 calls on two cores, 4-9 % of output frames left late against 17-20 % on asyncio's loop
(`benchmarks/latency.py`). It is not the default yet: with it, a WebSocket client's 8 MB
message stalled a WebRTC call's frames past 150 ms in 3 of 7 runs of
`tests/e2e/test_webrtc.py::test_a_client_at_the_protocol_limits_does_not_hold_up_another_call`
(0 of 4 on asyncio's loop); the cause is not found.

`asyncio.wait_for` that keeps a cancel:

On Python 3.11, a task cancelled while `wait_for` waits, in the same tick as what it awaits
becomes ready, gets that result instead of the `CancelledError`: the cancel is lost (fixed in
3.12, gh-86296). A loop that awaits that way in every turn then outlives the call that cancelled
it. `asyncio.timeout` counts cancels and has no such window; these wrap it."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("asyncio", "uvloop")


def run(main: Coroutine[Any, Any, T], loop: str = "asyncio") -> T:
    """`asyncio.run(main)` on asyncio's own loop or on uvloop's."""
    if loop not in LOOPS:
        raise ValueError(f"event loop {loop!r}: one of {', '.join(LOOPS)}")
    if loop == "asyncio":
        return asyncio.run(main)
    import uvloop  # a dependency on Linux; elsewhere this fails with its own ImportError

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
