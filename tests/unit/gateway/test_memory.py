"""The gateway gives freed heap back to the system (`gateway/memory.py`)."""

from __future__ import annotations

import subprocess
import sys

# Worker threads allocate 100 KB blocks (each thread's glibc arena) with small ones that live on
# between them, as a decoded append and the session's bookkeeping do, then free the blocks: the
# freed memory sits between live chunks, so no heap top shrinks and RSS keeps it.
CHURN = """
import asyncio, threading, psutil
from realtime_omni.gateway.memory import HeapTrimmer

pin = []
def churn():
    blocks = []
    for i in range(1000):
        blocks.append(b"x" * (100 << 10))
        pin.append(bytes(600 + i % 7))
    del blocks

threads = [threading.Thread(target=churn) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
rss = lambda: psutil.Process().memory_info().rss / 2**20

async def main():
    trimmer = HeapTrimmer(interval_s=0.2)
    before = rss()
    for _ in range(5):  # sessions ending together: one trim
        trimmer.soon()
    await asyncio.sleep(0.5)
    print(round(before), round(rss()), trimmer.trims)

asyncio.run(main())
"""


def test_freed_heap_goes_back_to_the_system_once_per_burst_of_session_ends() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHURN], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    before, after, trims = (int(x) for x in out)
    assert before > 150  # the churn held ~200 MB
    assert after < before / 2
    assert trims == 1
