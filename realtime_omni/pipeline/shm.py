"""Shared-memory segments in /dev/shm, named so a later start can find and remove what a killed
server left behind.

Segments are plain files in /dev/shm opened with os.open and mmap (not
multiprocessing.shared_memory, whose resource tracker unlinks segments it merely attached to).
Names: `rto_<owner pid>_<tag>`, where the owner is the coordinator's process; a segment whose owner
no longer runs is stale.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from pathlib import Path

import numpy as np
import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "rto_"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def segment_name(owner_pid: int, *parts: object) -> str:
    """`rto_<owner>_<part>.<part>...`; stage and process names never hold a dot, so a name
    ending in a dot is a prefix of exactly that process's segments."""
    return PREFIX + f"{owner_pid}_" + ".".join(_SAFE.sub("-", str(p)) for p in parts)


_NAME = re.compile(r"rto_\d+_[A-Za-z0-9_.-]+")


def check_name(name: str, src: str, dst: str) -> None:
    """ValueError unless `name` is a segment name of `segment_name`'s form for edge `src ->
    dst`: a name from the wire is a file name under /dev/shm, and must not reach elsewhere."""
    tail = "." + ".".join(_SAFE.sub("-", p) for p in (src, dst))
    if not _NAME.fullmatch(name) or not name.endswith(tail):
        raise ValueError(f"{name!r} is not a shared-memory segment of edge {src}->{dst}")


class Segment:
    """One mapped segment. The creator unlinks it; every holder closes its mapping."""

    def __init__(self, name: str, size: int = 0, create: bool = False) -> None:
        self.name = name
        self.path = SHM_DIR / name
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            # MAP_POPULATE faults every page in now, not on the first payload.
            self.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            if create:
                self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.size = size
        self.buf = memoryview(self.mmap)
        self.bytes = np.frombuffer(self.buf, np.uint8)  # slicing this beats a new frombuffer

    def close(self) -> None:
        """Drop this mapping. Arrays still viewing it keep it alive until they go."""
        # With arrays still viewing it, both refuse; the mapping then goes with the last view.
        self.bytes = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            self.buf.release()
            self.mmap.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def list_segments(owner_pid: int | None = None) -> list[str]:
    start = PREFIX if owner_pid is None else f"{PREFIX}{owner_pid}_"
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(start))
    except FileNotFoundError:
        return []


def clean_stale_segments() -> list[str]:
    """Unlink every segment whose owner process is gone; gives their names."""
    removed = []
    for name in list_segments():
        pid = name[len(PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            (SHM_DIR / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def unlink_segments(prefix: str) -> None:
    for name in list_segments():
        if name.startswith(prefix):
            (SHM_DIR / name).unlink(missing_ok=True)
