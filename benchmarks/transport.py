"""One hop, process to process: one-way latency of each payload transport, next to its baselines.

Every transport row uses the runtime's own classes: an `Edge`, an `Outlet` in this process (the
sender), an `Inlet` in a spawned receiver, real ZMQ PUSH/PULL sockets. The sender writes every
byte of the payload (as the stage step that made it would, just before it is sent), then stamps
CLOCK_MONOTONIC (system-wide on Linux) into the payload metadata just before `acquire`/`pack`;
the receiver stamps it once `Inlet.open` returned and it read the payload's last byte (checking
it is this hop's), then acks, and the sender waits for that ack before the next payload, so every
hop is measured unloaded.

Everything is measured `--rounds` times over (whole passes, so a burst of noise on a shared
machine hits one round, not one row); the figures are medians over rounds.

    python benchmarks/transport.py [--iters N] [--warmup N] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import ml_dtypes
import numpy as np
import zmq

from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline import mooncake
from realtime_omni.pipeline.config import RuntimeConfig
from realtime_omni.pipeline.graph import Edge
from realtime_omni.pipeline.relay import Inlet, Outlet, Payload
from realtime_omni.pipeline.shm import list_segments, segment_name, unlink_segments

# A token id, a few codes, a 4 KB vector, 130 and 784 rows of bf16 hidden states (width 2048).
SIZES_BYTES = (8, 160, 4096, 532_480, 3_211_264)
WIDTH = 2048
SMALL_MAX_BYTES = 4096  # up to here: uint8 arrays and SMALL_ITERS; above: bf16 rows, BIG_ITERS
SMALL_ITERS, BIG_ITERS = 500, 200
MEMCPY_REPS_PER_ITER = 5  # memcpy is cheap: more repetitions for a steadier median
IDLE_S = 0.001  # before each copy of the `memcpy_after_idle` baseline
START_TIMEOUT_S = 60.0  # a spawned receiver imports numpy, zmq and the runtime first
ACK_TIMEOUT_MS = 10_000
TARGET_SMALL_BYTES, TARGET_SMALL_P50_US = 4096, 100.0  # DESIGN.md, "Budgets"
TARGET_BIG_BYTES, TARGET_BIG_SLACK_US = 3_211_264, 200.0  # p50 <= 2 x memcpy + 0.2 ms

Latencies = dict[int, list[int]]  # payload bytes -> one-way latencies in ns


def make_array(nbytes: int, cuda: bool = False) -> Any:
    """uint8 for the small payloads, (rows, 2048) bfloat16 for the big ones."""
    a = np.full(nbytes, 7, np.uint8)
    if nbytes > SMALL_MAX_BYTES:
        a = a.view(ml_dtypes.bfloat16).reshape(-1, WIDTH)
    if not cuda:
        return a
    import torch

    t = torch.from_numpy(a.view(np.uint8)).to("cuda")
    return t.view(torch.bfloat16).view(a.shape) if nbytes > SMALL_MAX_BYTES else t


def produce(a: Any, i: int) -> int:
    """Write every byte of `a`, as the stage step that made a payload would, just before it is
    sent (so it is in the cache, as a fresh output is); gives the byte written."""
    value = i % 251 + 1
    flat = a.reshape(-1)
    if isinstance(a, np.ndarray):
        flat.view(np.uint8).fill(value)
    else:  # a CUDA tensor
        import torch

        flat.view(torch.uint8).fill_(value)
        torch.cuda.synchronize()
    return value


def last_byte(a: Any) -> int:
    """Read the last byte, so a lazy mapping or an unfinished copy cannot look fast (and the
    receiver can check it got this hop's payload)."""
    if isinstance(a, np.ndarray):  # item(-1): the last element, whatever the shape
        return a.item(-1) if a.dtype == np.uint8 else a.view(np.uint8).item(-1)
    import torch

    return int(a.reshape(-1).view(torch.uint8)[-1].item())


def iters_for(nbytes: int, override: int | None) -> int:
    return override or (SMALL_ITERS if nbytes <= SMALL_MAX_BYTES else BIG_ITERS)


def cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    return None if torch.cuda.is_available() else "torch.cuda.is_available() is False"


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind `sock`; a bare tcp:// host gets a free port. Gives the bound address."""
    if endpoint.startswith("tcp://") and endpoint.count(":") == 1:
        return f"{endpoint}:{sock.bind_to_random_port(endpoint)}"
    sock.bind(endpoint)
    return endpoint


# ---- receivers (spawned processes: the parent owns every cleanup, so they ignore Ctrl-C) ----


def curve(sock: zmq.Socket, secret: bytes | None, server: bool) -> None:
    """CurveZMQ on `sock` as the runtime sets it between hosts (`pipeline/sockets.py`)."""
    if secret is None:
        return
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        public = zmq.curve_public(secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def arrivals(
    inbox_at: str, ack_to: str, conn: Connection, parent_pid: int, secret: bytes | None = None
) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A receiver's sockets: binds its inbox (telling the parent where) and connects its acks,
    then yields (inbox, acks) whenever a message waits. It waits as the worker does, on a
    standing poller, and ends once the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, acks = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    acks.setsockopt(zmq.LINGER, 0)
    curve(inbox, secret, server=True)
    curve(acks, secret, server=False)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    try:
        conn.send(bind(inbox, inbox_at))
        acks.connect(ack_to)
        while os.getppid() == parent_pid:  # not orphaned
            if poller.poll(1000):
                yield inbox, acks
    finally:
        ctx.destroy(linger=0)


def zmq_receiver(
    inbox_at: str,
    ack_to: str,
    conn: Connection,
    parent_pid: int,
    copy: bool,
    secret: bytes | None = None,
) -> None:
    """Answer every DataReady with a DataAck, recording its latency; send them on `stop`.
    Receives as the worker does: non-blocking, frames copied on ipc, zero-copy on tcp."""
    inlet = Inlet()
    lat: Latencies = {}
    try:
        with contextlib.closing(arrivals(inbox_at, ack_to, conn, parent_pid, secret)) as waits:
            for inbox, acks in waits:
                received = m.receive(inbox, copy)
                assert received is not None and isinstance(received[0], m.DataReady)
                msg, frames = received
                payload = inlet.open(msg, frames)
                if payload.get("stop"):
                    conn.send(lat)
                    return
                got = last_byte(payload["x"])
                t1 = time.monotonic_ns()
                assert got == payload["value"], f"hop carried byte {got}, not {payload['value']}"
                if not payload["warm"]:
                    lat.setdefault(payload["nbytes"], []).append(t1 - payload["t_ns"])
                ack = m.encode(m.DataAck(msg.src, msg.dst, msg.lease))
                # Drop the slot's views (the payload is msg.meta) before the ack lends it again.
                del payload, frames, received, msg
                acks.send(ack)
    finally:
        inlet.close()


def bare_receiver(inbox_at: str, ack_to: str, conn: Connection, parent_pid: int) -> None:
    """The zmq_ipc_bare baseline's far end: one frame of 8 bytes of send time, the warm-up
    flag, the byte written, then the payload."""
    lat: Latencies = {}
    with contextlib.closing(arrivals(inbox_at, ack_to, conn, parent_pid)) as waits:
        for inbox, acks in waits:
            frame = inbox.recv(zmq.NOBLOCK)
            t1 = time.monotonic_ns()
            if len(frame) == 8:  # no payload: stop
                conn.send(lat)
                return
            t0, warm, value = int.from_bytes(frame[:8], "little"), frame[8], frame[9]
            assert frame[-1] == value, f"hop carried byte {frame[-1]}, not {value}"
            if not warm:
                lat.setdefault(len(frame) - 10, []).append(t1 - t0)
            acks.send(b"a")


def queue_receiver(q: Any, conn: Connection, parent_pid: int) -> None:
    """The mp_queue_pickle baseline's far end: (nbytes, warm, value, t_ns, array) items, None
    to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lat: Latencies = {}
    while os.getppid() == parent_pid:  # not orphaned
        try:
            item = q.get(timeout=1.0)
        except queue.Empty:
            continue
        if item is None:
            conn.send(lat)
            return
        nbytes, warm, value, t0, x = item
        got = last_byte(x)
        t1 = time.monotonic_ns()
        assert got == value, f"hop carried byte {got}, not {value}"
        if not warm:
            lat.setdefault(nbytes, []).append(t1 - t0)
        conn.send(None)


# ---- senders (this process) ----


def wait(conn: Connection, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"no {what} from the receiver within {timeout_s} s")
    return conn.recv()


def run_reference(sizes: list[int], iters: int | None, warmup: int) -> Latencies:
    """Two stages in one process: the payload dict is handed over as the worker does, through
    a deque, with a credit of the edge's pool held until the receiver is done."""
    outlet = Outlet(Edge("a", "b", "stream", "reference", 2, max(sizes)), "p", 0, os.getpid(), 0)
    inbound: deque[Payload] = deque()
    lat: Latencies = {}
    for nbytes in sizes:
        x = make_array(nbytes)
        for i in range(warmup + iters_for(nbytes, iters)):
            payload: Payload = {"x": x, "nbytes": nbytes, "value": produce(x, i)}
            payload["t_ns"] = time.monotonic_ns()
            lease = outlet.acquire("bench", "p")
            assert lease is not None
            inbound.append(payload)
            got = inbound.popleft()
            assert last_byte(got["x"]) == got["value"]
            t1 = time.monotonic_ns()
            if i >= warmup:
                lat.setdefault(nbytes, []).append(t1 - got["t_ns"])
            outlet.pool.release(lease)
    return lat


def run_zmq(
    transport: str, sizes: list[int], iters: int | None, warmup: int, tmp: str
) -> Latencies:
    """One receiver process for every size of `transport`; payloads go one at a time.
    `tcp_curve`: TCP with CurveZMQ, as between hosts (or Ray nodes); `mooncake`: the control
    messages so, the arrays of a payload over `inline_max_bytes` read through Mooncake's
    transfer engine (its TCP protocol)."""
    cuda = transport == "cuda_ipc"
    secret = zmq.curve_keypair()[1] if transport in ("tcp_curve", "mooncake") else None
    edge_transport = "mooncake" if transport == "mooncake" else transport
    transport = "tcp" if secret is not None else transport  # the control messages' channel
    where = "tcp://127.0.0.1" if transport == "tcp" else f"ipc://{tmp}/{transport}"
    inline_max = 0 if transport == "shm" else RuntimeConfig().inline_max_bytes  # shm: always a slot
    edge = Edge("sender", "receiver", "stream", edge_transport, 2, max(sizes))
    outlet = Outlet(edge, "sender", 0, os.getpid(), inline_max, "cuda:0" if cuda else "cpu")
    ctx = zmq.Context()
    acks, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    curve(acks, secret, server=True)
    curve(out, secret, server=False)
    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    ack_at = bind(acks, where if transport == "tcp" else f"{where}-ack.sock")
    inbox_at = where if transport == "tcp" else f"{where}-in.sock"
    proc = spawn.Process(
        target=zmq_receiver,
        args=(inbox_at, ack_at, child_conn, os.getpid(), transport != "tcp", secret),
        daemon=True,
    )

    def send(payload: Payload) -> None:
        payload["t_ns"] = time.monotonic_ns()
        lease = outlet.acquire("bench", "receiver")
        assert lease is not None, "the previous payload's slot was not acked"
        msg, frames = outlet.pack("bench", lease, payload, {})
        m.send(out, msg, frames)

    try:
        proc.start()
        out.connect(wait(conn, START_TIMEOUT_S, "inbox address"))
        for nbytes in sizes:
            x = make_array(nbytes, cuda)
            for i in range(warmup + iters_for(nbytes, iters)):
                send({"x": x, "nbytes": nbytes, "warm": i < warmup, "value": produce(x, i)})
                if not acks.poll(ACK_TIMEOUT_MS):
                    raise RuntimeError(f"{transport}: no DataAck within {ACK_TIMEOUT_MS} ms")
                ack = m.decode(acks.recv())
                assert isinstance(ack, m.DataAck)
                outlet.pool.release(ack.lease)
        send({"stop": True})
        return wait(conn, ACK_TIMEOUT_MS / 1000, "latencies")
    finally:
        proc.terminate()  # SIGTERM: a receiver ignores only SIGINT
        proc.join()
        outlet.close()
        ctx.destroy(linger=0)


def run_bare(sizes: list[int], iters: int | None, warmup: int, tmp: str) -> Latencies:
    """The floor under the ipc rows: raw bytes, one frame, PUSH/PULL over ipc://, no runtime."""
    ctx = zmq.Context()
    acks, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 0)
    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    ack_at = bind(acks, f"ipc://{tmp}/bare-ack.sock")
    proc = spawn.Process(
        target=bare_receiver,
        args=(f"ipc://{tmp}/bare-in.sock", ack_at, child_conn, os.getpid()),
        daemon=True,
    )
    try:
        proc.start()
        out.connect(wait(conn, START_TIMEOUT_S, "inbox address"))
        for nbytes in sizes:
            body = bytearray(10 + nbytes)  # 8 bytes of send time, warm, value, the payload
            x = np.frombuffer(body, np.uint8, nbytes, 10)
            for i in range(warmup + iters_for(nbytes, iters)):
                body[9] = produce(x, i)
                body[:9] = time.monotonic_ns().to_bytes(8, "little") + bytes([i < warmup])
                out.send(body)
                if not acks.poll(ACK_TIMEOUT_MS):
                    raise RuntimeError(f"zmq_ipc_bare: no ack within {ACK_TIMEOUT_MS} ms")
                acks.recv()
        out.send(b"\0" * 8)
        return wait(conn, ACK_TIMEOUT_MS / 1000, "latencies")
    finally:
        proc.terminate()
        proc.join()
        ctx.destroy(linger=0)


def run_queue(sizes: list[int], iters: int | None, warmup: int) -> Latencies:
    """The same arrays through a multiprocessing.Queue: pickled, piped, unpickled."""
    spawn = mp.get_context("spawn")
    q = spawn.Queue(maxsize=1)
    conn, child_conn = spawn.Pipe()
    proc = spawn.Process(target=queue_receiver, args=(q, child_conn, os.getpid()), daemon=True)
    try:
        proc.start()
        for nbytes in sizes:
            x = make_array(nbytes)
            for i in range(warmup + iters_for(nbytes, iters)):
                value = produce(x, i)
                q.put((nbytes, i < warmup, value, time.monotonic_ns(), x))
                wait(conn, START_TIMEOUT_S if i == 0 else ACK_TIMEOUT_MS / 1000, "ack")
        q.put(None)
        return wait(conn, ACK_TIMEOUT_MS / 1000, "latencies")
    finally:
        proc.terminate()
        proc.join()
        q.cancel_join_thread()  # the reader is gone: an unsent item must not block our exit
        q.close()


def memcpy_p50_us(nbytes: int, reps: int, warmup: int, idle_s: float = 0.0) -> float:
    """np.copyto into a preallocated array; with `idle_s`, each copy follows that much sleep,
    as a hop's copy follows a wait for the previous acknowledgement."""
    src = make_array(nbytes)
    dst = np.empty_like(src)
    ns = []
    for _ in range(warmup + reps):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        ns.append(time.perf_counter_ns() - t0)
    return pct_us(ns[warmup:], 50)


# ---- report ----


# What the runtime sends each budgeted size with between two processes of one machine: 4 KB
# inline in the control message (it is under `inline_max_bytes`), 3,136 KB in a slot. The other
# rows force a transport the runtime would not pick for that size, for comparison.
TARGET_ROWS = {TARGET_SMALL_BYTES: ("inline",), TARGET_BIG_BYTES: ("shm", "cuda_ipc")}


def verdict(transport: str, nbytes: int, p50_us: float, memcpy_us: dict[int, float]) -> str:
    """Against DESIGN.md, "Budgets"; empty for the rows it names no target for."""
    if transport not in TARGET_ROWS.get(nbytes, ()):
        return ""
    if nbytes == TARGET_SMALL_BYTES:
        target, rule = TARGET_SMALL_P50_US, f"{TARGET_SMALL_P50_US:.0f}"
    else:
        target = 2 * memcpy_us[nbytes] + TARGET_BIG_SLACK_US
        rule = f"2 x memcpy + {TARGET_BIG_SLACK_US:.0f} = {target:.0f}"
    return f"{'ok' if p50_us <= target else 'OVER'} (p50 <= {rule} us)"


def pct_us(ns: list[int], q: float) -> float:
    return float(np.percentile(ns, q)) / 1000


def measure_round(
    transports: list[str], sizes: list[int], iters: int | None, warmup: int
) -> tuple[dict[str, Latencies], dict[str, dict[int, float]]]:
    """One pass over every transport and baseline: (hop latencies by transport, baseline p50s
    by name)."""
    baselines = {
        "memcpy": {
            n: memcpy_p50_us(n, MEMCPY_REPS_PER_ITER * iters_for(n, iters), warmup) for n in sizes
        },
        "memcpy_after_idle": {n: memcpy_p50_us(n, iters_for(n, iters), 10, IDLE_S) for n in sizes},
    }
    results: dict[str, Latencies] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rto-bench-") as tmp:
            for t in transports:
                print(f"  measuring {t} ...", file=sys.stderr, flush=True)
                if t == "reference":
                    results[t] = run_reference(sizes, iters, warmup)
                else:
                    results[t] = run_zmq(t, sizes, iters, warmup, tmp)
            print("  measuring zmq_ipc_bare ...", file=sys.stderr, flush=True)
            bare = run_bare(sizes, iters, warmup, tmp)
        print("  measuring mp_queue_pickle ...", file=sys.stderr, flush=True)
        queue_lat = run_queue(sizes, iters, warmup)
    finally:
        unlink_segments(segment_name(os.getpid()))  # what an interrupted Outlet.close left
    assert not list_segments(os.getpid())
    baselines["mp_queue_pickle"] = {n: pct_us(queue_lat[n], 50) for n in sizes}
    baselines["zmq_ipc_bare"] = {n: pct_us(bare[n], 50) for n in sizes}
    return results, baselines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, help=f"measured hops per size ({SMALL_ITERS}/{BIG_ITERS})")
    ap.add_argument("--warmup", type=int, default=50, help="unmeasured hops per size first")
    ap.add_argument("--rounds", type=int, default=3, help="whole passes; figures are medians")
    ap.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    args = ap.parse_args()
    sizes = list(SIZES_BYTES)
    transports = ["reference", "inline", "shm", "tcp", "tcp_curve", "mooncake", "cuda_ipc"]
    if (skip := cuda_skip_reason()) is not None:
        transports.remove("cuda_ipc")
    if not mooncake.available():
        transports.remove("mooncake")

    passes = []
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
        passes.append(measure_round(transports, sizes, args.iters, args.warmup))

    def median(values: list[float]) -> float:
        return float(np.median(values))

    # Per transport and size: the median over rounds of each round's p50 (and p99), and the
    # rounds' p50s themselves, to show the spread.
    p50s = {(t, n): [pct_us(res[t][n], 50) for res, _ in passes] for t in transports for n in sizes}
    rows = [
        {
            "transport": t,
            "payload_bytes": n,
            "p50_us": median(p50s[t, n]),
            "p99_us": median([pct_us(res[t][n], 99) for res, _ in passes]),
        }
        for t in transports
        for n in sizes
    ]
    base = {
        name: {n: median([b[name][n] for _, b in passes]) for n in sizes} for name in passes[0][1]
    }
    baselines = [
        {"name": name, "payload_bytes": n, "p50_us": us}
        for name, by_size in base.items()
        for n, us in by_size.items()
    ]

    memcpy_us, idle_us = base["memcpy"], base["memcpy_after_idle"]
    queue_us, bare_us = base["mp_queue_pickle"], base["zmq_ipc_bare"]
    head = ("transport", "bytes", "p50 us", "p99 us", "memcpy", "idle+cp", "mp.Queue", "zmq bare")
    print("{:<10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  verdict; p50 by round".format(*head))
    for r in rows:
        t, n = r["transport"], r["payload_bytes"]
        spread = " / ".join(f"{us:.0f}" for us in p50s[t, n]) if args.rounds > 1 else ""
        notes = "; ".join(x for x in (verdict(t, n, r["p50_us"], memcpy_us), spread) if x)
        print(
            f"{t:<10} {n:>9} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
            f"{memcpy_us[n]:>9.1f} {idle_us[n]:>9.1f} {queue_us[n]:>9.1f} {bare_us[n]:>9.1f}  "
            + notes
        )
    print(
        f"Medians over {args.rounds} round(s). Baselines, p50 us: memcpy, the same bytes copied in"
    )
    print("one process back to back (the verdicts use this one); idle+cp, the same copy after")
    print(
        f"{IDLE_S * 1e3:g} ms asleep, as a hop's copy comes after waiting for an ack; mp.Queue, the"
    )
    print("array pickled through a multiprocessing.Queue; zmq bare, raw bytes in one ZMQ frame")
    print("over ipc:// with no runtime code (the floor under the ipc rows). Verdicts only on the")
    print("rows the runtime uses for that size between processes: 4 KB inline, 3,136 KB in a slot.")
    print("The rows between machines (here over loopback): tcp_curve, and mooncake, whose control")
    print("messages go as tcp_curve's and whose payloads over 16 KB Mooncake's engine reads.")
    if skip is not None:
        print(f"cuda_ipc: skipped ({skip})")
    if "mooncake" not in transports:
        print("mooncake: skipped (the mooncake extra is not installed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "baselines": baselines}, f, indent=2)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the finally blocks above already cleaned up
        sys.exit(130)
