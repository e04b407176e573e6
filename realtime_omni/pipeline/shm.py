"""Shared-memory segments in /dev/shm, named so a later start can find and remove what a killed
server left behind.

Segments are plain files in /dev/shm opened with os.open and mmap (not
multiprocessing.shared_memory, whose resource tracker unlinks segments it merely attached to).
Names: `rto_<owner pid>_<tag>`, where the owner is the coordinator's process. A live owner holds
an exclusive `flock` on `rto-owner_<pid>` (`OwnerLock`) for its lifetime, and a segment is stale
only when that lock can be taken: a pid alone says nothing across PID namespaces (containers
sharing /dev/shm with `ipc: host` see other pids), and segments without a lock, or that this user
may not remove, are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
from pathlib import Path

import numpy as np

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


OWNER = "rto-owner_"  # + pid: the lock file a live owner holds


class OwnerLock:
    """Held by a coordinator while it runs: its segments are not stale (see the module doc).
    The kernel drops the lock when the process dies, however it dies. Several coordinators of
    one process (tests, benchmarks) share the process's lock: the last to release it drops it."""

    _held: dict[int, tuple[int, int]] = {}  # pid -> (fd, holders), in this process

    def __init__(self, owner_pid: int) -> None:
        self.pid = owner_pid
        self.path = SHM_DIR / f"{OWNER}{owner_pid}"
        fd, holders = self._held.get(owner_pid, (-1, 0))
        if fd < 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._held[owner_pid] = (fd, holders + 1)
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        fd, holders = self._held.pop(self.pid)
        if holders > 1:
            self._held[self.pid] = (fd, holders - 1)
            return
        self.path.unlink(missing_ok=True)
        os.close(fd)


def _owner_gone(pid: str) -> bool:
    """Whether the owner `pid` is known to be gone: its lock file exists and nobody holds it."""
    try:
        fd = os.open(SHM_DIR / f"{OWNER}{pid}", os.O_RDWR)
    except OSError:
        return False  # no lock: another version's or another user's segment; leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held: the owner is alive, whatever its pid means here
    finally:
        os.close(fd)


def clean_stale_segments() -> list[str]:
    """Unlink every segment (and lock file) of owners known to be gone; gives their names."""
    removed = []
    gone: dict[str, bool] = {}
    for name in list_segments():
        pid = name[len(PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and gone.setdefault(pid, _owner_gone(pid)):
            with contextlib.suppress(OSError):  # another user's: not ours to remove
                (SHM_DIR / name).unlink(missing_ok=True)
                removed.append(name)
    with contextlib.suppress(FileNotFoundError):  # lock files whose segments went already
        for p in SHM_DIR.iterdir():
            pid = p.name[len(OWNER) :]
            if p.name.startswith(OWNER) and pid.isdigit() and pid not in gone:
                gone[pid] = _owner_gone(pid)
    for pid, dead in gone.items():
        if dead:
            with contextlib.suppress(OSError):
                (SHM_DIR / f"{OWNER}{pid}").unlink(missing_ok=True)
    return removed


def unlink_segments(prefix: str) -> None:
    for name in list_segments():
        if name.startswith(prefix):
            (SHM_DIR / name).unlink(missing_ok=True)
