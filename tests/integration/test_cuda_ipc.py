"""CUDA IPC slots between two processes on one machine; skipped where there is no GPU."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from realtime_omni.pipeline import messages as m  # noqa: E402
from realtime_omni.pipeline.graph import Edge  # noqa: E402
from realtime_omni.pipeline.relay import Inlet, Outlet  # noqa: E402


def _receive(conn: mp.connection.Connection) -> None:
    inlet = Inlet()
    for _ in range(3):
        header, frames = conn.recv()
        msg = m.decode(header)
        payload = inlet.open(msg, frames)
        x = payload["x"]
        conn.send((str(x.device), str(x.dtype), tuple(x.shape), float(x.float().sum().item())))


def test_cuda_tensors_cross_processes_through_ipc_slots() -> None:
    edge = Edge("thinker", "talker_ar", "stream", "cuda_ipc", 2, 1 << 20)
    outlet = Outlet(edge, "gpu0#0", 0, os.getpid(), 0, "cuda:0")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(child,))
    proc.start()
    try:
        for i in range(3):
            x = torch.full((784, 2048), float(i + 1), dtype=torch.bfloat16, device="cuda:0")
            slot = outlet.acquire("r", "gpu1#0")
            msg, frames = outlet.pack("r", slot, {"x": x}, {})
            assert msg.transport == "cuda_ipc" and frames == []
            parent.send((m.encode(msg), frames))
            device, dtype, shape, total = parent.recv()
            assert (device, dtype, shape) == ("cuda:0", "torch.bfloat16", (784, 2048))
            assert total == pytest.approx(784 * 2048 * (i + 1))
            outlet.pool.release(slot)
    finally:
        proc.join(timeout=30)
        outlet.close()
    assert proc.exitcode == 0
