"""One GPU's time shared by the simulated stages that stand for stages placed on it.

Stages in separate processes on one GPU do not run at once: without NVIDIA's Multi-Process
Service, the GPU runs one process's context at a time and time-slices between them ("Without MPS,
when processes share the GPU their scheduling resources must be swapped on and off the GPU",
docs.nvidia.com/deploy/mps, "When to Use MPS"). So while k stages step together on a device each
advances at 1/k of its speed: processor sharing, the fluid limit of round-robin slices, which
leaves out the switches' own cost (kinder than the GPU by that much, no more). A simulated step of
`cost` seconds therefore takes `cost` while it runs alone and up to k x `cost` beside k - 1 others.

Which stages step now lives in a small file in the run's folder (the ipc folder, private to one
run of the pipeline), mapped by every stage process that names the device: a slot per process
(its pid and whether it is stepping), taken under an advisory lock; a process that takes a slot
frees those of dead processes (a stage killed mid-step), and a stage reads the slots without the
lock between slices.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SLICE_S = 0.002  # how often a sharing step looks at the count again: a CUDA time slice's order
SLOTS = 64  # processes on one simulated device at most
_SLOT = struct.Struct("ii")  # pid, stepping


class SharedDevice:
    """The simulated GPU `name` of the run whose folder is `run_dir`."""

    def __init__(self, run_dir: str, name: str) -> None:
        path = Path(run_dir) / f"sim-gpu-{name}"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(self._fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(self._fd, SLOTS * _SLOT.size)
            self._at = self._take_slot()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _take_slot(self) -> int:
        """A free slot, freeing those of dead processes on the way."""
        free = None
        for i in range(SLOTS):
            pid, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid and not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, 0, 0)
                pid = 0
            if not pid and free is None:
                free = i
        if free is None:
            raise RuntimeError(f"more than {SLOTS} processes share one simulated GPU")
        _SLOT.pack_into(self._map, free * _SLOT.size, os.getpid(), 0)
        return free * _SLOT.size

    def stepping(self) -> int:
        """Stages stepping on the device now."""
        return sum(_SLOT.unpack_from(self._map, i * _SLOT.size)[1] for i in range(SLOTS))

    @contextmanager
    def busy(self) -> Iterator[None]:
        """This process steps on the device meanwhile."""
        _SLOT.pack_into(self._map, self._at, os.getpid(), 1)
        try:
            yield
        finally:
            _SLOT.pack_into(self._map, self._at, os.getpid(), 0)

    def spend(self, cost: float) -> None:
        """Take `cost` seconds of the device's time: as long as that alone, longer beside others."""
        if cost <= 0:
            return
        with self.busy():
            left, last = cost, time.monotonic()
            while left > 1e-6:
                sharing = max(1, self.stepping())
                time.sleep(min(left * sharing, SLICE_S))
                now = time.monotonic()
                left -= (now - last) / sharing
                last = now


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True
