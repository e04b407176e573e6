"""CUDA IPC slot pools: GPU-to-GPU payloads between processes on one machine.

The one module of `pipeline/` that imports torch, and only when a payload holds torch tensors
(the relay imports it lazily), so deployments that move numpy arrays never load torch here.

The sender allocates one buffer of `slots * slot_bytes` on its GPU and shares its IPC handle
once, as plain msgpack fields (`PoolHandle`: sizes, offsets and the driver's handle bytes;
nothing received is ever unpickled, so a forged handle is at worst refused); each payload is a
device-to-device copy into its slot, then a stream synchronisation, then the control message.
The receiver maps the buffer once and views the slot; it copies what it keeps (to its own
device) before it acknowledges. The two processes' CUDA streams are not ordered with each
other, so before the acknowledgement the receiver waits for the GPU work it queued (`settle`):
a copy still queued would otherwise read a slot the sender is already filling again.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from realtime_omni.pipeline.messages import ArrayRef
from realtime_omni.pipeline.relay import ALIGN


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


class PoolHandle(msgspec.Struct, array_like=True):
    """What `reduce_tensor` gives for a CUDA uint8 buffer, minus the classes and the rebuild
    function that pickle would carry (they are always the same here)."""

    size: int
    device: int
    handle: bytes  # the CUDA IPC memory handle
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes
    ref_offset: int
    event: bytes | None
    event_sync: bool


def export_handle(buffer: torch.Tensor) -> bytes:
    rebuild, a = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor or a[0] is not torch.Tensor or a[5] != torch.uint8:
        raise RuntimeError(f"unexpected CUDA IPC reduction of {buffer.dtype} on {buffer.device}")
    if tuple(a[1]) != (buffer.numel(),) or tuple(a[2]) != (1,) or a[3] != 0:
        raise RuntimeError("a pool buffer must be a whole 1-D uint8 tensor")
    fields = PoolHandle(buffer.numel(), a[6], a[7], a[8], a[9], a[11], a[12], a[13], a[14])
    return msgspec.msgpack.encode(fields)


def import_handle(raw: bytes) -> tuple[Any, ...]:
    """The arguments of `rebuild_cuda_tensor` for a handle made by `export_handle`;
    `msgspec.ValidationError` (a ValueError) if it is anything else."""
    h = msgspec.msgpack.decode(raw, type=PoolHandle)
    storage_cls = type(torch.empty(0, dtype=torch.uint8)._typed_storage())
    return (
        torch.Tensor, torch.Size([h.size]), (1,), 0, storage_cls, torch.uint8, h.device,
        h.handle, h.storage_bytes, h.storage_offset, False, h.ref_handle, h.ref_offset,
        h.event, h.event_sync,
    )  # fmt: skip


class CudaSlots:
    def __init__(self, device: torch.device, slots: int, slot_bytes: int, pool_id: str) -> None:
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.buffer = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.pool_id = pool_id
        self.handle = export_handle(self.buffer)

    def write(self, slot: int, arrays: dict[str, Any]) -> list[ArrayRef]:
        refs = []
        offset = slot * self.slot_bytes
        with torch.cuda.device(self.device):
            for name, t in arrays.items():
                n = t.numel() * t.element_size()
                dst = self.buffer[offset : offset + n].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=True)
                dtype = str(t.dtype).removeprefix("torch.")
                refs.append(ArrayRef(name, dtype, tuple(t.shape), -1, offset, n))
                offset += (n + ALIGN - 1) // ALIGN * ALIGN
            torch.cuda.current_stream().synchronize()
        return refs


class _OpenPool:
    def __init__(self, handle: bytes) -> None:
        self.buffer: torch.Tensor = rebuild_cuda_tensor(*import_handle(handle))

    def view(self, ref: ArrayRef) -> torch.Tensor:
        raw = self.buffer[ref.offset : ref.offset + ref.nbytes]
        return raw.view(_torch_dtype(ref.dtype)).view(ref.shape)

    def settle(self) -> None:
        """Wait for this process's queued GPU work that may read the pool: on the pool's device
        (where a copy out of it runs) and on the current one (a kernel reading it over peer
        access)."""
        torch.cuda.synchronize(self.buffer.device)
        if torch.cuda.current_device() != self.buffer.device.index:
            torch.cuda.synchronize()


def open_pool(handle: bytes) -> _OpenPool:
    return _OpenPool(handle)


def missing(device: str) -> str | None:
    """Why torch cannot use `device` (a "cuda:N") on this machine, or None if it can."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.device(device).index or 0
    return None if index < count else f"torch sees {count} CUDA device(s) here"


def can_access(src: torch.device, dst: str) -> bool:
    """Whether CUDA IPC works between two devices of this machine (else use shared memory)."""
    a, b = torch.device(src).index or 0, torch.device(dst).index or 0
    return a == b or torch.cuda.can_device_access_peer(a, b)


def from_numpy(a: Any, device: str | torch.device) -> torch.Tensor:
    """A numpy array as a tensor on `device` (a copy, except on the CPU where it shares the
    memory), bfloat16 (ml_dtypes') included."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view("int16")).to(device).view(torch.bfloat16)
    return torch.from_numpy(a).to(device)


def to_numpy(t: torch.Tensor) -> Any:
    """The values of a tensor as a numpy array on the CPU, bfloat16 included (as
    ml_dtypes.bfloat16); it shares memory with a tensor that is contiguous on the CPU already."""
    import ml_dtypes

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
