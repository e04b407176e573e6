"""The event loop the server runs on, and `asyncio.wait_for` that keeps a cancel.

`run` starts a loop: uvloop's (libuv, in C) where it is installed (a dependency on Linux), else
asyncio's own; `serve --loop asyncio` asks for asyncio's. The gateway's loop carries every
call's media (each WebRTC call sends and receives 50 packets a second through aiortc), and
uvloop's cheaper callbacks and socket calls show there: with 16 calls on two cores
(`benchmarks/latency.py --configs tiny --turns 1 --sessions 16`), 1.9-6.0 % of output frames
left late on uvloop (median 2.5 %) against 2.3-5.5 % on asyncio's loop (median 4.7 %), four
runs each, interleaved. It was on request only while a WebSocket client's 8 MB message
stalled a WebRTC call's frames past 150 ms on it (`tests/e2e/test_webrtc.py`'s protocol-limits
test, 3 of 7 runs); that was permessage-deflate inflating the message on the loop, on either
loop, and with compression declined the test passed 5 of 5 on uvloop.

`asyncio.wait_for` that keeps a cancel:

On Python 3.11, a task cancelled while `wait_for` waits, in the same tick as what it awaits
becomes ready, gets that result instead of the `CancelledError`: the cancel is lost (fixed in
3.12, gh-86296). A loop that awaits that way in every turn then outlives the call that cancelled
it. `asyncio.timeout` counts cancels and has no such window; these wrap it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("asyncio", "uvloop")
DEFAULT_LOOP = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def run(main: Coroutine[Any, Any, T], loop: str = DEFAULT_LOOP) -> T:
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


class ReadPace:
    """A connection's reads held to `rate` bytes a second beyond a `burst`: after each message,
    `await pace.took(n)` sleeps while the bucket is below zero, so the connection is not read
    meanwhile and TCP holds its sender back (a client that streams megabytes of JSON a second
    would otherwise take the event loop from every call's audio)."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level, self.last = burst, clock()

    async def took(self, n: int) -> None:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.last) * self.rate) - n
        self.last = now
        if self.level < 0:
            await asyncio.sleep(-self.level / self.rate)
