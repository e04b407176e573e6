"""CUDA IPC slots between two processes on one machine; skipped where there is no GPU."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from realtime_omni.pipeline import messages as m  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402
from realtime_omni.pipeline.graph import Edge  # noqa: E402
from realtime_omni.pipeline.relay import Inlet, Outlet  # noqa: E402
from tests.conftest import run, simulated_config  # noqa: E402
from tests.integration.test_pipeline import FAST, all_slots_free, check_complete, until  # noqa: E402

pytestmark = pytest.mark.gpu

SPIN_CYCLES = 200_000_000  # a GPU kernel of about 0.1 s, queued ahead of a read of the slot
REPLY_TIMEOUT_S = 60.0  # the receiver's first reply waits for its CUDA start-up


def _receive(conn: mp.connection.Connection) -> None:
    inlet = Inlet()
    for _ in range(3):
        header, frames = conn.recv()
        msg = m.decode(header)
        payload = inlet.open(msg, frames)
        x = payload["x"]
        conn.send((str(x.device), str(x.dtype), tuple(x.shape), float(x.float().sum().item())))


def _spawn(target) -> tuple[mp.connection.Connection, mp.Process]:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child,))
    proc.start()
    return parent, proc


def _stop(conn: mp.connection.Connection, proc: mp.Process) -> None:
    conn.close()  # a receiver still waiting gets EOFError
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _reply(conn: mp.connection.Connection, proc: mp.Process) -> object:
    """The receiver's next answer; fails instead of hanging if it died."""
    assert conn.poll(REPLY_TIMEOUT_S), f"no reply from the receiver (exit code {proc.exitcode})"
    return conn.recv()


def test_cuda_tensors_cross_processes_through_ipc_slots() -> None:
    edge = Edge("thinker", "talker_ar", "stream", "cuda_ipc", 2, 4 << 20)
    outlet = Outlet(edge, "gpu0#0", 0, os.getpid(), 0, "cuda:0")
    parent, proc = _spawn(_receive)
    try:
        for i in range(3):
            x = torch.full((784, 2048), float(i + 1), dtype=torch.bfloat16, device="cuda:0")
            lease = outlet.acquire("r", "gpu1#0")
            msg, frames = outlet.pack("r", lease, {"x": x}, {})
            assert msg.transport == "cuda_ipc" and frames == []
            parent.send((m.encode(msg), frames))
            device, dtype, shape, total = _reply(parent, proc)  # type: ignore[misc]
            assert (device, dtype, shape) == ("cuda:0", "torch.bfloat16", (784, 2048))
            assert total == pytest.approx(784 * 2048 * (i + 1))
            outlet.pool.release(lease)
    finally:
        _stop(parent, proc)
        outlet.close()
    assert proc.exitcode == 0


def _copy_late(conn: mp.connection.Connection) -> None:
    """Queue a copy of the slot behind a slow kernel, settle, ack; once the sender has refilled
    the slot, report what the copy read."""
    inlet = Inlet()
    header, frames = conn.recv()
    msg = m.decode(header)
    x = inlet.open(msg, frames)["x"]
    torch.cuda._sleep(SPIN_CYCLES)
    kept = x.clone()  # queued: runs after the spin, on this process's stream
    inlet.settle(msg)
    conn.send("ack")
    assert conn.recv() == "refilled"
    conn.send(float(kept.float().mean().item()))


def test_the_ack_waits_for_gpu_work_still_reading_the_slot() -> None:
    edge = Edge("thinker", "talker_ar", "stream", "cuda_ipc", 1, 1 << 20)  # one slot, reused
    outlet = Outlet(edge, "gpu0#0", 0, os.getpid(), 0, "cuda:0")
    parent, proc = _spawn(_copy_late)
    try:
        lease = outlet.acquire("r", "gpu1#0")
        msg, frames = outlet.pack("r", lease, {"x": torch.full((4096,), 1.0, device="cuda:0")}, {})
        parent.send((m.encode(msg), frames))
        assert _reply(parent, proc) == "ack"
        outlet.pool.release(lease)
        lease = outlet.acquire("r", "gpu1#0")
        outlet.pack("r", lease, {"x": torch.full((4096,), 2.0, device="cuda:0")}, {})  # refill
        parent.send("refilled")
        assert _reply(parent, proc) == 1.0  # without the settle, the queued copy reads the refill
    finally:
        _stop(parent, proc)
        outlet.close()
    assert proc.exitcode == 0


def test_without_cuda_ipc_the_edge_stages_through_shared_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from realtime_omni.pipeline import cuda_ipc

    def refuse(*args: object) -> None:
        raise RuntimeError("CUDA error: operation not supported")  # as in some sandboxes

    monkeypatch.setattr(cuda_ipc, "CudaSlots", refuse)
    edge = Edge("thinker", "talker_ar", "stream", "cuda_ipc", 2, 1 << 20)
    outlet = Outlet(edge, f"gpu0-{os.getpid()}#0", 0, os.getpid(), 0, "cuda:0")
    try:
        for value in (1.0, 2.0):  # the second payload takes the same path without trying again
            lease = outlet.acquire("r", "gpu1#0")
            x = torch.full((4, 2048), value, dtype=torch.bfloat16, device="cuda:0")
            msg, frames = outlet.pack("r", lease, {"x": x}, {})
            assert msg.transport == "shm" and outlet.ipc is False
            got = Inlet().open(m.decode(m.encode(msg)), [m.encode(msg), *frames])["x"]
            assert got.shape == (4, 2048) and float(got.astype("float32").mean()) == value
            del got
            outlet.pool.release(lease)
    finally:
        outlet.close()


@pytest.mark.parametrize(("transport", "mixed"), [("shm", False), ("cuda_ipc", True)])
def test_cuda_tensors_off_a_gpu_to_gpu_edge_move_as_numpy(transport: str, mixed: bool) -> None:
    """To a CPU stage (an shm edge), or mixed with numpy arrays in one payload, CUDA tensors
    arrive as numpy arrays of their values."""
    edge = Edge("thinker", "decode", "stream", transport, 2, 1 << 20)
    outlet = Outlet(edge, f"gpu0-{os.getpid()}#0", 0, os.getpid(), 0, "cpu")
    try:
        x = torch.full((4, 2048), 3.0, dtype=torch.bfloat16, device="cuda:0")
        payload = {"x": x, **({"ids": np.arange(3)} if mixed else {})}
        lease = outlet.acquire("r", "cpu#0")
        msg, frames = outlet.pack("r", lease, payload, {})
        assert msg.transport == "shm"
        got = Inlet().open(m.decode(m.encode(msg)), [m.encode(msg), *frames])
        assert got["x"].shape == (4, 2048) and float(got["x"].astype("float32").mean()) == 3.0
        assert not mixed or got["ids"].tolist() == [0, 1, 2]
        del got
        outlet.pool.release(lease)
    finally:
        outlet.close()


def test_the_simulated_graph_moves_tensors_between_its_gpu_stages_by_ipc() -> None:
    """Thinker, talker and code2wav on cuda:0 in three processes: hidden states and codes go as
    CUDA tensors through IPC slots; requests complete, an abort leaves every slot free."""
    data = simulated_config(FAST)
    for stage in ("thinker", "talker_ar", "code2wav"):
        data["stages"][stage]["device"] = "cuda:0"

    async def body() -> None:
        async with Coordinator(parse_config(data)) as coord:
            for src, dst in (("thinker", "talker_ar"), ("talker_ar", "code2wav")):
                assert coord.graph.edge(src, dst).transport == "cuda_ipc"

            async def one(i: int) -> None:
                stream = await coord.submit({"max_tokens": 5 + i % 7}, request_id=f"r{i}")
                check_complete(await stream.collect(), 5 + i % 7)

            await asyncio.gather(*(one(i) for i in range(8)))
            stream = await coord.submit({"max_tokens": 200})
            async for out in stream:
                if out.stage == "code2wav":
                    break
            await coord.abort(stream.request_id)
            await until(lambda: coord.in_flight == 0, "every stage done with every request")
            await all_slots_free(coord)

    run(body(), limit_s=180)
