"""Moving payloads along one edge: the sender's `Outlet` and the receiver's `Inlet`.

A payload is a dict: numpy arrays (any dtype, bfloat16 via ml_dtypes) move as raw bytes with
their dtype and shape, never pickled; every other value is small metadata carried in the control
message (msgpack: numbers, strings, bytes, lists, dicts). CUDA tensors move on `cuda_ipc` edges;
a torch tensor on the CPU moves as the numpy array of its values (the receiver gets numpy,
bfloat16 as ml_dtypes').

Transports (chosen per edge by `Graph`):
- reference: same process, the dict itself is handed over (the worker does it; no packing);
- inline / tcp: arrays up to `inline_max_bytes` ride inside the control message, larger ones
  as extra ZMQ frames of it;
- shm: arrays are copied into a slot of a segment the sender owns; payloads up to
  `inline_max_bytes` still ride inline;
- cuda_ipc: CUDA tensors are copied into a slot of a GPU pool the sender owns. CUDA tensors on
  any other edge (to a CPU stage, to the client), or mixed with numpy arrays in one payload,
  move as numpy like the rest;
- mooncake: arrays are copied into a slot of memory the sender registered with Mooncake's
  transfer engine, which the receiver reads across machines (`pipeline/mooncake.py`); payloads
  up to `inline_max_bytes` still ride inline.

Every payload takes one credit (a lease) of the edge's `SlotPool`, whatever the transport; the
receiver's `DataAck` gives it back. Arrays the receiver gets from a slot are read-only views, valid
until it acknowledges: an executor copies what it keeps beyond the call that received it (on a
cuda_ipc edge an asynchronous copy will do: `Inlet.settle` runs before the acknowledgement).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np

from realtime_omni.errors import PayloadTooLarge, RequestError
from realtime_omni.pipeline.graph import Edge
from realtime_omni.pipeline.messages import ArrayRef, DataReady
from realtime_omni.pipeline.shm import Segment, check_name, segment_name
from realtime_omni.pipeline.slots import SlotPool

log = logging.getLogger(__name__)

Payload = dict[str, Any]
ALIGN = 256  # array offsets in a slot, and slot strides (CUDA likes 256)
_PLAIN = {int, float, str, bool, bytes, type(None)}


@cache
def dtype_of(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


@cache
def _name(dt: np.dtype) -> str:
    return dt.name  # computed in Python by numpy, ~10 us: worth caching on the hot path


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_cuda(x: Any) -> bool:
    return getattr(x, "is_cuda", False) is True


def split_payload(payload: Payload) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(metadata, arrays, whether any array is a CUDA tensor) of a payload; a torch tensor
    off the GPU is given as a numpy array."""
    meta, arrays, cuda = {}, {}, False
    for k, v in payload.items():
        if type(v) in _PLAIN:  # most metadata: skip the checks below (getattr raising is slow)
            meta[k] = v
        elif isinstance(v, np.ndarray):
            if v.dtype.hasobject:
                raise RequestError(f"payload array {k!r} has dtype object; it cannot be moved")
            arrays[k] = v
        elif (on_cuda := getattr(v, "is_cuda", None)) is not None:  # a torch tensor
            if on_cuda:
                arrays[k] = v
                cuda = True
            else:
                from realtime_omni.pipeline.cuda_ipc import to_numpy

                arrays[k] = to_numpy(v)
        else:
            meta[k] = v
    return meta, arrays, cuda


def _needed(arrays: dict[str, Any]) -> int:
    """Bytes a slot needs for these arrays: each starts aligned, the last is not padded."""
    total = 0
    for a in arrays.values():
        total = _aligned(total) + a.nbytes
    return total


def payload_nbytes(payload: Payload) -> int:
    return _needed(split_payload(payload)[1])


class Outlet:
    """The sending end of one edge in one process: credits, and the memory behind them."""

    def __init__(
        self,
        edge: Edge,
        process: str,
        epoch: int,
        owner_pid: int,
        inline_max_bytes: int,
        dst_device: str = "cpu",
        host: str = "127.0.0.1",
        mooncake_protocol: str = "tcp",
    ) -> None:
        """`host`, `mooncake_protocol`: where this process's Mooncake engine listens, and how
        (a `mooncake` edge)."""
        self.edge = edge
        self.dst_device = dst_device
        self.process = process
        self.pool = SlotPool(edge.slots)
        self.inline_max_bytes = inline_max_bytes
        self.stride = _aligned(edge.slot_bytes)  # so every slot starts aligned
        self._segment_name = segment_name(owner_pid, process, epoch, edge.src, edge.dst)
        self.segment: Segment | None = None
        if edge.transport == "shm" and edge.slot_bytes > inline_max_bytes:
            # Made now, not on first use: mapping (and populating) a pool of big slots takes
            # tens of milliseconds, which a first request, or the gateway's event loop, would pay.
            self.segment = Segment(self._segment_name, edge.slots * self.stride, create=True)
        self.cuda: Any = None  # realtime_omni.pipeline.cuda_ipc.CudaSlots, made on first use
        self.ipc: bool | None = None  # whether CUDA IPC works on this edge, found on first use
        self.mooncake: Any = None  # realtime_omni.pipeline.mooncake.Slots
        if edge.transport == "mooncake" and edge.slot_bytes > inline_max_bytes:
            # Made now, as an shm segment is: a missing engine fails the start, not a request.
            # (With slots no larger than `inline_max_bytes`, every payload rides inline.)
            from realtime_omni.pipeline.mooncake import Slots

            self.mooncake = Slots(host, mooncake_protocol, edge.slots, self.stride)

    def acquire(self, request_id: str, peer: str) -> int | None:
        """A lease on a slot for one payload of `request_id`, or None: none free, or the request
        already has `edge.request_slots` in flight."""
        cap = self.edge.request_slots
        if cap and self.pool.held(request_id) >= cap:
            return None
        return self.pool.acquire(request_id, peer)

    def release(self, lease: int) -> str | None:
        """End `lease` (see `SlotPool.release`)."""
        return self.pool.release(lease)

    def held(self, request_id: str) -> int:
        return self.pool.held(request_id)

    def reclaim(self, peer: str) -> list[str]:
        return self.pool.reclaim(peer)

    def pack(
        self,
        request_id: str,
        lease: int,
        payload: Payload,
        route: dict[str, int],
        shared: bool = True,
    ) -> tuple[DataReady, list[Any]]:
        """The control message and its frames for `payload` in the slot of `lease`. On error
        the lease is released and the error raised. `shared`: the peer still shares this
        machine's memory (false: an shm or CUDA IPC edge sends inline)."""
        try:
            return self._pack(request_id, lease, payload, route, shared)
        except BaseException:
            self.pool.release(lease)
            raise

    def _pack(
        self, request_id: str, lease: int, payload: Payload, route: dict[str, int], shared: bool
    ) -> tuple[DataReady, list[Any]]:
        meta, arrays, cuda = split_payload(payload)
        e = self.edge
        msg = DataReady(request_id, e.src, e.dst, self.process, lease, meta, [], route, "inline")
        if not arrays:
            return msg, []
        total = _needed(arrays)
        # Mooncake's slots are read across machines: `shared` does not matter to them.
        slotted = (shared and e.transport in ("shm", "cuda_ipc")) or e.transport == "mooncake"
        if total > e.slot_bytes and slotted:
            raise PayloadTooLarge(
                f"a payload of {total} bytes on edge {e.key} exceeds its slot of {e.slot_bytes} "
                f"bytes. Fix: add {{src: {e.src}, dst: {e.dst}, slot_bytes: {total}}} (or more) "
                "to the config's edges"
            )
        if cuda and not shared:
            from realtime_omni.pipeline.cuda_ipc import to_numpy

            arrays = {k: to_numpy(v) if _is_cuda(v) else v for k, v in arrays.items()}
        elif cuda:
            arrays = self._to_cuda_slot(msg, self.pool.slot(lease), arrays)
            if not arrays:
                return msg, []
        if slotted and total > self.inline_max_bytes:
            if e.transport == "mooncake":
                self._to_mooncake_slot(msg, self.pool.slot(lease), arrays)
            else:
                self._to_shm_slot(msg, self.pool.slot(lease), arrays)
            return msg, []
        if total <= self.inline_max_bytes:
            # Small: the bytes ride inside the control message itself; one frame is faster.
            offset, parts = 0, []
            for name, a in arrays.items():
                parts.append(a.tobytes())
                msg.arrays.append(ArrayRef(name, _name(a.dtype), a.shape, 0, offset, a.nbytes))
                offset += a.nbytes
            msg.blob = memoryview(parts[0] if len(parts) == 1 else b"".join(parts))
            return msg, []
        frames: list[Any] = []
        for name, a in arrays.items():
            frames.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
            msg.arrays.append(ArrayRef(name, _name(a.dtype), a.shape, len(frames), 0, a.nbytes))
        return msg, frames

    def _to_cuda_slot(self, msg: DataReady, slot: int, arrays: dict[str, Any]) -> dict[str, Any]:
        """Put CUDA tensors in the edge's GPU slot; gives what is left to send otherwise: the
        arrays as numpy where the edge is not GPU to GPU, some arrays are not on a GPU, the GPUs
        cannot reach each other, or CUDA IPC is unavailable."""
        from realtime_omni.pipeline.cuda_ipc import CudaSlots, can_access, to_numpy

        e = self.edge
        if e.transport != "cuda_ipc" or not all(_is_cuda(a) for a in arrays.values()):
            return {k: to_numpy(v) if _is_cuda(v) else v for k, v in arrays.items()}
        first = next(iter(arrays.values()))
        if self.ipc is None:
            self.ipc = can_access(first.device, self.dst_device)
            try:
                if self.ipc:
                    self.cuda = CudaSlots(first.device, e.slots, self.stride, self._segment_name)
            except RuntimeError as err:  # no IPC handles here: some sandboxes and containers
                log.warning("edge %s: no CUDA IPC (%s); staging through shared memory", e.key, err)
                self.ipc = False
        if not self.ipc:
            return {k: to_numpy(v) for k, v in arrays.items()}
        msg.transport, msg.segment, msg.handle = "cuda_ipc", self.cuda.pool_id, self.cuda.handle
        msg.arrays = self.cuda.write(slot, arrays)
        return {}

    def _to_shm_slot(self, msg: DataReady, slot: int, arrays: dict[str, Any]) -> None:
        if self.segment is None:
            self.segment = Segment(self._segment_name, self.edge.slots * self.stride, create=True)
        msg.transport, msg.segment = "shm", self.segment.name
        for name, a, offset in _write_slot(self.segment.bytes, slot * self.stride, arrays):
            msg.arrays.append(ArrayRef(name, _name(a.dtype), a.shape, -1, offset, a.nbytes))

    def _to_mooncake_slot(self, msg: DataReady, slot: int, arrays: dict[str, Any]) -> None:
        slots = self.mooncake  # made with the outlet: a payload here outgrew inline_max_bytes
        msg.transport, msg.segment = "mooncake", slots.engine.session
        for name, a, offset in _write_slot(slots.buf, slot * self.stride, arrays):
            # `offset`: the array's address in the sender's registered memory
            ref = ArrayRef(name, _name(a.dtype), a.shape, -1, slots.base + offset, a.nbytes)
            msg.arrays.append(ref)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None
        if self.mooncake is not None:
            self.mooncake.close()
            self.mooncake = None
        self.cuda = self.ipc = None


def _write_slot(
    buf: np.ndarray, offset: int, arrays: dict[str, np.ndarray]
) -> Iterator[tuple[str, np.ndarray, int]]:
    """Copy `arrays` into the bytes `buf` from `offset` on, each at an `ALIGN` boundary;
    gives (name, array, its offset in `buf`) for each."""
    for name, a in arrays.items():
        raw = buf[offset : offset + a.nbytes]
        if a.flags.c_contiguous:  # as bytes: numpy copies ml_dtypes' bfloat16 slowly
            np.copyto(raw, a.reshape(-1).view(np.uint8))
        else:
            np.copyto(raw.view(a.dtype).reshape(a.shape), a)
        yield name, a, offset
        offset += _aligned(a.nbytes)


class Inlet:
    """The receiving end of every edge into one process: maps senders' segments on first use."""

    def __init__(
        self,
        max_segments: int = 1024,
        host: str = "127.0.0.1",
        mooncake_protocol: str = "tcp",
        mooncake: bool = False,
    ) -> None:
        """`mooncake`: an edge into this process goes through Mooncake: start the engine now."""
        # Bounded: one entry per (sender incarnation, edge); `forget` drops a dead sender's.
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self._cuda: OrderedDict[str, Any] = OrderedDict()
        self.max_segments = max_segments
        self.host, self.mooncake_protocol = host, mooncake_protocol
        self.mooncake: Any = None  # realtime_omni.pipeline.mooncake.Reader, made on first use
        if mooncake:
            from realtime_omni.pipeline.mooncake import Reader

            self.mooncake = Reader(host, mooncake_protocol).start()

    def open(self, msg: DataReady, frames: list[Any]) -> Payload:
        """The payload of `msg`; arrays are read-only and valid until the message is acked."""
        payload: Payload = msg.meta  # decoded for this message alone: no copy needed
        if msg.transport == "cuda_ipc":
            pool = self._cuda.get(msg.segment)
            if pool is None:
                from realtime_omni.pipeline.cuda_ipc import open_pool

                try:
                    opened = open_pool(msg.handle)
                except RuntimeError as err:
                    raise RequestError(
                        f"cannot map the CUDA IPC pool of edge {msg.src}->{msg.dst}: {err}. Fix: "
                        f"add {{src: {msg.src}, dst: {msg.dst}, transport: shm}} to the config's "
                        "edges"
                    ) from err
                pool = self._cache(self._cuda, msg.segment, opened)
            for ref in msg.arrays:
                payload[ref.name] = pool.view(ref)
            return payload
        if msg.transport == "mooncake":
            if self.mooncake is None:
                from realtime_omni.pipeline.mooncake import Reader

                self.mooncake = Reader(self.host, self.mooncake_protocol)
            spans = [(ref.offset, ref.nbytes) for ref in msg.arrays]
            for ref, raw in zip(msg.arrays, self.mooncake.read(msg.segment, spans), strict=True):
                payload[ref.name] = raw.view(dtype_of(ref.dtype)).reshape(ref.shape)
            return payload
        if msg.transport == "shm":
            seg = self._segments.get(msg.segment)
            if seg is None:
                check_name(msg.segment, msg.src, msg.dst)
                seg = self._cache(self._segments, msg.segment, Segment(msg.segment))
            for ref in msg.arrays:
                raw = seg.bytes[ref.offset : ref.offset + ref.nbytes]
                a = raw.view(dtype_of(ref.dtype)).reshape(ref.shape)
                a.flags.writeable = False
                payload[ref.name] = a
            return payload
        for ref in msg.arrays:
            dt = dtype_of(ref.dtype)
            if ref.frame == 0:  # in the blob, a read-only view of the received frame
                a = np.frombuffer(msg.blob, dt, ref.nbytes // dt.itemsize, ref.offset)
            else:
                buf = frames[ref.frame]
                a = np.frombuffer(getattr(buf, "buffer", buf), dt, ref.nbytes // dt.itemsize)
                a.flags.writeable = False  # a zero-copy frame
            payload[ref.name] = a if len(ref.shape) == 1 else a.reshape(ref.shape)
        return payload

    def settle(self, msg: DataReady) -> None:
        """Call before acknowledging `msg`: for a CUDA IPC slot, waits until the GPU work this
        process queued so far (which may still read the slot) has run."""
        pool = self._cuda.get(msg.segment) if msg.transport == "cuda_ipc" else None
        if pool is not None:
            pool.settle()

    def _cache(self, table: OrderedDict[str, Any], key: str, value: Any) -> Any:
        table[key] = value
        if len(table) > self.max_segments:
            _, old = table.popitem(last=False)
            if isinstance(old, Segment):
                old.close()
        return value

    def forget(self, process: str, owner_pid: int) -> None:
        """Drop the mappings of segments made by `process` (it died or restarted)."""
        prefix = segment_name(owner_pid, process, "")
        for table in (self._segments, self._cuda):
            for name in [n for n in table if n.startswith(prefix)]:
                old = table.pop(name)
                if isinstance(old, Segment):
                    old.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self._cuda.clear()


def copy_payload(payload: Payload) -> Payload:
    """A payload whose arrays the caller owns (writable copies of slot views)."""
    return {
        k: (np.array(v) if isinstance(v, np.ndarray) else v.clone() if _is_cuda(v) else v)
        for k, v in payload.items()
    }
