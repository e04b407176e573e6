"""Outlet/Inlet in one process: frames are passed as a list (one test uses an inproc socket)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zmq

from realtime_omni.errors import PayloadTooLarge, RequestError
from realtime_omni.pipeline import messages
from realtime_omni.pipeline.graph import Edge
from realtime_omni.pipeline.messages import ArrayRef, DataReady, decode, encode
from realtime_omni.pipeline.relay import Inlet, Outlet, copy_payload, payload_nbytes
from realtime_omni.pipeline.shm import SHM_DIR, list_segments, segment_name, unlink_segments

PID = os.getpid()


@pytest.fixture
def process() -> Iterator[str]:
    """A process name of this test's own; its segments are gone afterwards."""
    name = f"t-relay-{uuid.uuid4().hex[:12]}#0"
    yield name
    unlink_segments(segment_name(PID, name, ""))


def edge(transport: str, slots: int = 2, slot_bytes: int = 1 << 16) -> Edge:
    return Edge("a", "b", "once", transport, slots, slot_bytes)


def mine(process: str) -> list[str]:
    prefix = segment_name(PID, process, "")
    return [s for s in list_segments(PID) if s.startswith(prefix)]


def send(outlet: Outlet, payload: dict[str, Any], rid: str = "r1") -> tuple[DataReady, list[Any]]:
    """Pack, then do what the socket would: encode the message, copy the frames."""
    lease = outlet.acquire(rid, "b#0")
    assert lease is not None
    msg, frames = outlet.pack(rid, lease, payload, {"b": 0})
    back = decode(encode(msg))
    assert isinstance(back, DataReady)
    return back, [encode(msg), *(bytearray(f) for f in frames)]


def arrays() -> dict[str, np.ndarray]:
    f32 = np.arange(48, dtype=np.float32).reshape(6, 8)
    bf16 = np.linspace(-4, 4, 30).astype(ml_dtypes.bfloat16).reshape(5, 6)
    return {
        "u8": np.arange(12, dtype=np.uint8).reshape(3, 4),
        "f32_strided": f32[::2, 1::3],  # not contiguous
        "f32_scalar": np.array(2.5, dtype=np.float32),
        "i64": np.array([-(2**62), 0, 2**62], dtype=np.int64),
        "i64_scalar": np.array(-7, dtype=np.int64),
        "bf16_t": bf16.T,  # not contiguous
        "bf16_scalar": np.array(1.5, dtype=ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "subclass": np.arange(5, dtype=np.int16).view(_Sub),  # moves as a plain array
    }


class _Sub(np.ndarray):
    pass


META = {"text": "héllo", "n": 3, "f": 0.5, "flag": True, "raw": b"\x00\x01", "nested": {"k": [1]}}


@pytest.mark.parametrize(
    ("transport", "inline_max"), [("inline", 0), ("inline", 1 << 16), ("shm", 0), ("cuda_ipc", 0)]
)
def test_round_trip(process: str, transport: str, inline_max: int) -> None:
    """inline_max 0: arrays in frames of their own (or the slot); 64 KB: all in the message.
    A cuda_ipc edge given numpy arrays (a stage on the CPU emits them) moves them as shm."""
    out = Outlet(edge(transport), process, 0, PID, inline_max_bytes=inline_max)
    inlet = Inlet()
    sent = arrays()
    assert not sent["f32_strided"].flags.c_contiguous
    msg, frames = send(out, {**META, **sent})
    in_slot = transport in ("shm", "cuda_ipc")
    assert msg.transport == ("shm" if in_slot else transport)
    assert len(frames) == (1 if inline_max or in_slot else 1 + len(sent))
    assert msg.src_process == process and msg.route == {"b": 0}
    assert out.pool.slot(msg.lease) in (0, 1)
    got = inlet.open(msg, frames)
    assert {k: got[k] for k in META} == META
    assert set(got) == set(META) | set(sent)
    for k, a in sent.items():
        b = got[k]
        assert b.dtype == a.dtype, k
        assert b.shape == a.shape, k
        assert np.array_equal(b, a), k
        assert not b.flags.writeable, k
        with pytest.raises(ValueError):
            b[...] = 0
    assert out.pool.free == 1  # the credit stays out until the receiver's ack
    owned = copy_payload(got)
    assert owned["u8"].flags.writeable
    del got, b
    inlet.close()
    out.close()


@pytest.mark.parametrize(("transport", "inline_max"), [("inline", 1 << 16), ("shm", 0)])
def test_cpu_torch_tensors_move_as_numpy(process: str, transport: str, inline_max: int) -> None:
    torch = pytest.importorskip("torch")
    out = Outlet(edge(transport), process, 0, PID, inline_max_bytes=inline_max)
    sent = {
        "bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
        "i64": torch.arange(4),
        "strided": torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, ::2],
    }
    msg, frames = send(out, {**sent, "n": 1})
    got = Inlet().open(msg, frames)
    assert got["n"] == 1
    assert got["bf16"].dtype == ml_dtypes.bfloat16 and got["bf16"].shape == (2, 3)
    assert got["bf16"].astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["i64"].dtype == np.int64 and got["i64"].tolist() == [0, 1, 2, 3]
    assert got["strided"].tolist() == [[0, 2], [4, 6], [8, 10]]
    out.close()


@pytest.mark.parametrize("copy", [True, False])
def test_inline_arrays_arrive_as_read_only_views_of_the_frame(process: str, copy: bool) -> None:
    """Through a real socket, copied out (ipc edges) or zero-copy (tcp edges): a small array
    views the received frame, read-only either way."""
    out = Outlet(edge("tcp"), process, 0, PID, inline_max_bytes=1 << 16)
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        rx.bind("inproc://inline")
        tx.connect("inproc://inline")
        lease = out.acquire("r1", "b#0")
        assert lease is not None
        messages.send(tx, *out.pack("r1", lease, {"x": np.arange(6, dtype=np.int32)}, {}))
        assert zmq.select([rx], [], [], 5)[0]
        got = messages.receive(rx, copy)
        assert got is not None and isinstance(got[0], DataReady)
        x = Inlet().open(*got)["x"]
        assert x.tolist() == [0, 1, 2, 3, 4, 5] and not x.flags.writeable
        assert isinstance(got[0].blob, memoryview)  # decoded in place, not copied
    finally:
        ctx.destroy(linger=0)


def test_a_cuda_ipc_pool_that_cannot_be_mapped_fails_the_request_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda_ipc = pytest.importorskip("realtime_omni.pipeline.cuda_ipc")

    def refuse(handle: bytes) -> None:
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(cuda_ipc, "open_pool", refuse)
    ref = ArrayRef("x", "bfloat16", (2,), -1, 0, 4)
    msg = DataReady("r1", "a", "b", "a#0", 0, {}, [ref], {}, "cuda_ipc", "pool", b"handle")
    with pytest.raises(RequestError) as info:
        Inlet().open(msg, [])
    assert "invalid device context" in str(info.value)
    assert "Fix: add {src: a, dst: b, transport: shm}" in str(info.value)


def test_shm_arrays_are_views_of_the_segment(process: str) -> None:
    out = Outlet(edge("shm", slots=2, slot_bytes=4096), process, 0, PID, inline_max_bytes=0)
    inlet = Inlet()
    msg1, f1 = send(out, {"x": np.full(100, 1, np.float32)}, "r1")
    msg2, f2 = send(out, {"x": np.full(100, 2, np.float32)}, "r2")
    assert len(f1) == len(f2) == 1  # no array frames: the bytes are in the segment
    slots = [out.pool.slot(msg1.lease), out.pool.slot(msg2.lease)]
    assert msg1.segment == msg2.segment and sorted(slots) == [0, 1]
    assert [r.offset for r in msg1.arrays + msg2.arrays] == [s * 4096 for s in slots]
    one, two = inlet.open(msg1, f1), inlet.open(msg2, f2)
    assert (one["x"] == 1).all() and (two["x"] == 2).all()  # slots do not overlap
    del one, two
    inlet.close()
    out.close()


def test_small_payloads_on_shm_edges_ride_inline(process: str) -> None:
    out = Outlet(edge("shm"), process, 0, PID, inline_max_bytes=1024)
    assert out.segment is not None and len(mine(process)) == 1  # mapped when made, not on use
    msg, frames = send(out, {"x": np.zeros(16, np.float32)})
    assert msg.transport == "inline"
    assert len(frames) == 1 and len(msg.blob) == 64  # inside the control message
    assert np.array_equal(Inlet().open(msg, frames)["x"], np.zeros(16, np.float32))
    out.close()
    assert mine(process) == []


def test_a_peer_that_no_longer_shares_memory_gets_shm_payloads_inline(process: str) -> None:
    out = Outlet(edge("shm", slot_bytes=4096), process, 0, PID, inline_max_bytes=0)
    lease = out.acquire("r1", "b#0")
    assert lease is not None
    x = np.arange(2048, dtype=np.float32)  # twice the slot: only the slot limits shm
    msg, frames = out.pack("r1", lease, {"x": x}, {"b": 0}, shared=False)
    assert msg.transport == "inline" and not msg.segment and len(frames) == 1
    got = Inlet().open(decode(encode(msg)), [encode(msg), *(bytearray(f) for f in frames)])
    assert np.array_equal(got["x"], x)
    out.close()


def test_an_edge_whose_slots_fit_inline_maps_no_memory(process: str) -> None:
    out = Outlet(edge("shm", slot_bytes=512), process, 0, PID, inline_max_bytes=1024)
    msg, _ = send(out, {"x": np.zeros(16, np.float32)})
    assert msg.transport == "inline"
    assert out.segment is None and mine(process) == []


def test_payload_without_arrays(process: str) -> None:
    out = Outlet(edge("shm"), process, 0, PID, inline_max_bytes=0)
    msg, frames = send(out, {"text": "only meta"})
    assert (msg.transport, msg.arrays, len(frames)) == ("inline", [], 1)
    assert Inlet().open(msg, frames) == {"text": "only meta"}


def test_payload_too_large_names_edge_and_fix_and_frees_the_slot(process: str) -> None:
    out = Outlet(edge("shm", slots=2, slot_bytes=256), process, 0, PID, inline_max_bytes=0)
    payload = {"x": np.zeros(100, np.float32), "y": np.zeros(3, np.uint8)}
    assert payload_nbytes(payload) == 512 + 3  # y starts at the next 256-byte boundary
    lease = out.acquire("r1", "b#0")
    assert lease is not None
    with pytest.raises(PayloadTooLarge) as info:
        out.pack("r1", lease, payload, {})
    msg = str(info.value)
    assert "a->b" in msg
    assert "256" in msg
    assert "Fix: add {src: a, dst: b, slot_bytes: 515}" in msg
    assert out.pool.free == 2 and out.pool.held("r1") == 0


def test_object_dtype_is_refused_and_frees_the_slot(process: str) -> None:
    out = Outlet(edge("inline"), process, 0, PID, inline_max_bytes=0)
    lease = out.acquire("r1", "b#0")
    assert lease is not None
    with pytest.raises(RequestError, match="'bad' has dtype object"):
        out.pack("r1", lease, {"bad": np.array([object()], dtype=object)}, {})
    assert out.pool.free == 2


def test_close_unlinks_the_segment(process: str) -> None:
    out = Outlet(edge("shm"), process, 3, PID, inline_max_bytes=0)
    msg, _ = send(out, {"x": np.ones(64, np.uint8)})
    assert msg.segment == segment_name(PID, process, 3, "a", "b")
    assert (SHM_DIR / msg.segment).exists()
    assert mine(process) == [msg.segment]
    out.close()
    assert not (SHM_DIR / msg.segment).exists()
    assert mine(process) == []
    out.close()  # twice is harmless


def test_inlet_forget_drops_the_senders_mapping(process: str) -> None:
    out = Outlet(edge("shm"), process, 0, PID, inline_max_bytes=0)
    inlet = Inlet()
    msg, frames = send(out, {"x": np.ones(8, np.float64)})
    inlet.open(msg, frames)
    assert msg.segment in inlet._segments
    inlet.forget(process, PID)
    assert msg.segment not in inlet._segments
    out.close()
