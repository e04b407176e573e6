"""Shared-memory segments: create, attach, list, unlink, and cleaning what dead owners left."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import psutil
import pytest

from realtime_omni.pipeline.shm import (
    SHM_DIR,
    Segment,
    clean_stale_segments,
    list_segments,
    segment_name,
    unlink_segments,
)

PID = os.getpid()


@pytest.fixture
def tag() -> Iterator[str]:
    """A name part of this test's own; every segment made with it is gone afterwards."""
    t = f"t-shm-{uuid.uuid4().hex[:12]}"
    yield t
    for name in list_segments():
        if t in name:
            (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process now
    if psutil.pid_exists(proc.pid):
        pytest.skip("the pid of the finished process was reused at once")
    return proc.pid


def test_create_attach_unlink(tag: str) -> None:
    name = segment_name(PID, tag, 0)
    seg = Segment(name, 4096, create=True)
    assert seg.path == SHM_DIR / name and seg.path.exists()
    assert seg.size == 4096 and len(seg.buf) == 4096
    seg.buf[:5] = b"hello"
    other = Segment(name)
    assert other.size == 4096
    assert bytes(other.buf[:5]) == b"hello"
    other.buf[5:6] = b"!"
    assert bytes(seg.buf[:6]) == b"hello!"  # one memory, two mappings
    other.close()
    seg.close()
    seg.unlink()
    assert not seg.path.exists()
    seg.unlink()  # twice is harmless


def test_create_refuses_an_existing_name(tag: str) -> None:
    seg = Segment(segment_name(PID, tag), 64, create=True)
    with pytest.raises(FileExistsError):
        Segment(seg.name, 64, create=True)
    assert seg.path.exists()  # the failed create did not remove the first one
    seg.close()
    seg.unlink()


def test_attach_to_a_missing_segment(tag: str) -> None:
    with pytest.raises(FileNotFoundError):
        Segment(segment_name(PID, tag, "missing"))


def test_close_with_a_live_view_does_not_raise(tag: str) -> None:
    seg = Segment(segment_name(PID, tag), 64, create=True)
    view = seg.buf[:8]
    seg.close()
    view[0] = 1  # the mapping lives on while a view does
    assert view[0] == 1
    view.release()
    seg.unlink()


def test_segment_name_is_safe_and_starts_with_the_owner() -> None:
    name = segment_name(123, "gpu0#1", 2, "a", "b")
    assert name == "rto_123_gpu0-1.2.a.b"
    assert segment_name(123, "x/../y z") == "rto_123_x-..-y-z"


def test_segment_names_of_two_edges_differ() -> None:
    assert segment_name(1, "p#0", 0, "x", "y_z") != segment_name(1, "p#0", 0, "x_y", "z")


def test_list_segments(tag: str, dead_pid: int) -> None:
    a = Segment(segment_name(PID, tag, "a"), 64, create=True)
    b = Segment(segment_name(dead_pid, tag, "b"), 64, create=True)
    assert a.name in list_segments(PID)
    assert b.name not in list_segments(PID)
    assert b.name in list_segments(dead_pid)
    assert {a.name, b.name} <= set(list_segments())
    assert list_segments() == sorted(list_segments())
    for s in (a, b):
        s.close()
        s.unlink()
    assert a.name not in list_segments()


def test_clean_stale_segments_by_the_owners_lock_not_its_pid(tag: str, dead_pid: int) -> None:
    """A segment is stale when its owner's lock file is there and nobody holds it (the owner
    died). A held lock keeps segments whatever the pid says: the owner may live in another PID
    namespace sharing /dev/shm, where before its segments were deleted under it. A segment with
    no lock at all is left alone."""
    from realtime_omni.pipeline.shm import OWNER, SHM_DIR, OwnerLock

    other_ns, no_lock = dead_pid + 1, dead_pid + 2  # pids this namespace does not have
    stale = Segment(segment_name(dead_pid, tag, "stale"), 64, create=True)
    foreign = Segment(segment_name(other_ns, tag, "live"), 64, create=True)
    orphan = Segment(segment_name(no_lock, tag, "orphan"), 64, create=True)
    (SHM_DIR / f"{OWNER}{dead_pid}").touch()  # what a killed owner leaves: the file, no lock
    held = OwnerLock(other_ns)  # as if held by a live owner elsewhere
    for seg in (stale, foreign, orphan):
        seg.close()
    try:
        removed = clean_stale_segments()
        assert stale.name in removed and not stale.path.exists()
        assert not (SHM_DIR / f"{OWNER}{dead_pid}").exists()
        assert foreign.path.exists() and orphan.path.exists()
        assert foreign.name not in removed and orphan.name not in removed
    finally:
        held.release()
        for seg in (foreign, orphan):
            seg.unlink()


def test_unlink_segments_by_prefix(tag: str) -> None:
    prefix = segment_name(PID, tag, "")
    inside = [Segment(segment_name(PID, tag, i), 64, create=True) for i in range(2)]
    outside = Segment(segment_name(PID, f"{tag}x", 0), 64, create=True)
    unlink_segments(prefix)
    assert not any(s.path.exists() for s in inside)
    assert outside.path.exists()
    for s in [*inside, outside]:
        s.close()
    outside.unlink()


def test_coordinators_of_one_process_share_its_owner_lock() -> None:
    from realtime_omni.pipeline.shm import OWNER, SHM_DIR, OwnerLock

    a, b = OwnerLock(PID), OwnerLock(PID)  # two coordinators in one test process
    a.release()
    assert (SHM_DIR / f"{OWNER}{PID}").exists()  # b still holds it
    b.release()
    b.release()  # twice is harmless
    assert not (SHM_DIR / f"{OWNER}{PID}").exists()
