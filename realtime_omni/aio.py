"""`asyncio.wait_for` that keeps a cancel.

On Python 3.11, a task cancelled while `wait_for` waits, in the same tick as what it awaits
becomes ready, gets that result instead of the `CancelledError`: the cancel is lost (fixed in
3.12, gh-86296). A loop that awaits that way in every turn then outlives the call that cancelled
it. `asyncio.timeout` counts cancels and has no such window; these wrap it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


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
