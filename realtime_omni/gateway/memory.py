"""Giving freed memory back to the system.

A heavy client (a 6 MB append, a large image) is decoded in the event loop's worker threads, and
glibc's allocator serves each thread from an arena of its own. What such a call frees stays in
those arenas: the process keeps its high-water mark (measured by `benchmarks/soak_gateway.py`:
RSS 379 → 514 MB after 90 s of heavy callers, none left). `malloc_trim(0)` returns the free
pages of every arena. It is run when a session ends, at most once per `interval_s`, in a worker
thread (it walks the heaps under their locks). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger(__name__)


def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self._last = 0.0
        self._pending: asyncio.Task[None] | None = None
        self.trims = 0

    def soon(self) -> None:
        """Trim within `interval_s` (once, however many sessions end meanwhile)."""
        if self._trim is None or self._pending is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test closing a session by hand)
            return
        self._pending = loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            await asyncio.sleep(max(0.0, self._last + self.interval_s - time.monotonic()))
            if self._trim is not None:
                await asyncio.to_thread(self._trim, 0)
            self._last = time.monotonic()
            self.trims += 1
        except Exception:
            log.exception("malloc_trim failed")
        finally:
            self._pending = None
