"""Shared test helpers. Every timeout scales with RTO_TEST_TIMEOUT_FACTOR for slow machines."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_FACTOR = float(os.environ.get("RTO_TEST_TIMEOUT_FACTOR", "1"))


def timeout(seconds: float) -> float:
    return seconds * TIMEOUT_FACTOR


async def until(condition: Callable[[], bool], what: str, within_s: float = 10.0) -> None:
    """Wait for `condition` to hold, polling every 10 ms, failing after `within_s` (scaled):
    for a state a test waits for, never a fixed sleep."""
    deadline = time.monotonic() + timeout(within_s)
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.01)


async def freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until it has stopped. A stop is not immediate: the kernel stops a
    process when the thread it picked runs again, and on a busy machine its other threads can
    run on (handle a message, answer it) meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    await until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, f"{pid} stopped")


def run(coro: Coroutine[Any, Any, Any], limit_s: float = 60) -> Any:
    """Run an async test body with an overall limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout(limit_s)))


def simulated_config(time_scale: float = 1.0, **runtime: Any) -> dict[str, Any]:
    """configs/simulated-qwen3-omni.yaml as a dict, step times multiplied by `time_scale`."""
    data = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    data = copy.deepcopy(data)
    for stage in data["stages"].values():
        for key in list(stage["params"]):
            if key.endswith("_ms"):
                stage["params"][key] *= time_scale
    data.setdefault("runtime", {}).update(runtime)
    return data


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (best effort: nothing should race us for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int) -> int:
    """A base port with n free ports after it, for configs with TCP inboxes (`runtime.base_port`).
    Taken below Linux's ephemeral range (32768 up): there no connection's own port (Ray's, the
    other pytest worker's servers') can take one of the block between this check and the
    stages' binds, which once failed a Ray test with "Address already in use". Each pytest-xdist
    worker draws from its own part of 20000-32000."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 20000 + (index % 4) * 3000
    for _ in range(200):
        base = random.randrange(low, low + 3000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")
