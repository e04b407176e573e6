"""Payloads across machines through Mooncake's transfer engine (the `mooncake` extra).

An edge with `transport: mooncake` keeps the control message on the ZMQ channel of every other
edge; only a payload's arrays move another way. The sender copies them into a slot of a buffer
it registered with its engine and names, in the message, its engine's session (`host:port`) and
each array's address there; the receiver reads them into a registered buffer of its own with one
batched read (TCP, or RDMA where the fabric has it: `runtime.mooncake_protocol`), copies them out
and acknowledges, which gives the slot back, as on an shm edge.

Engines meet peer to peer (Mooncake's `P2PHANDSHAKE`): no etcd or metadata server to run. Unlike
the CurveZMQ control plane, Mooncake's data path is not authenticated: anyone who reaches an
engine's port can read the slots it registered. Use it on a cluster's private network only.
"""

from __future__ import annotations

import os
import threading
from itertools import accumulate

import numpy as np

from realtime_omni.errors import ConfigError, RequestError

_engines: dict[tuple[str, str], Engine] = {}
_lock = threading.Lock()


def available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


class Engine:
    """This process's transfer engine on one address, and the buffers it registered."""

    def __init__(self, host: str, protocol: str) -> None:
        # Its glog's info and warnings (a line per connection) off unless asked for.
        os.environ.setdefault("GLOG_minloglevel", "2")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ConfigError(
                f"an edge has transport mooncake, but Mooncake's transfer engine does not load "
                f"here ({e}). Fix: pip install 'realtime-omni[mooncake]' (and the system's "
                "libibverbs1 and libnuma1), or use tcp"
            ) from e
        self.te = TransferEngine()
        if self.te.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise ConfigError(
                f"Mooncake's transfer engine did not start on {host} over {protocol}. Fix: "
                "check runtime.bind_host (or the host's address) and runtime.mooncake_protocol"
            )
        self.session = f"{host}:{self.te.get_rpc_port()}"
        self.lock = threading.Lock()  # one transfer at a time: the worker's threads share it
        self._buffers: list[np.ndarray] = []  # registered: kept alive until released

    @classmethod
    def of(cls, host: str, protocol: str) -> Engine:
        """The process's engine for `host` (made on first use; one per process)."""
        with _lock:
            engine = _engines.get((host, protocol))
            if engine is None:
                engine = _engines[(host, protocol)] = cls(host, protocol)
            return engine

    def buffer(self, nbytes: int) -> np.ndarray:
        """A registered buffer of `nbytes` (uint8), 4 KB aligned."""
        raw = np.zeros(nbytes + 4096, np.uint8)
        start = -raw.ctypes.data % 4096
        buf = raw[start : start + nbytes]
        if self.te.register_memory(buf.ctypes.data, nbytes) != 0:
            raise RuntimeError(f"Mooncake could not register {nbytes} bytes")
        self._buffers.append(buf)
        return buf

    def release(self, buf: np.ndarray) -> None:
        self.te.unregister_memory(buf.ctypes.data)
        self._buffers = [b for b in self._buffers if b is not buf]


class Slots:
    """The sending side of one edge: `slots` slots of `stride` bytes in registered memory,
    `buf`, which starts at address `base` (the `Outlet` writes them, as an shm segment's)."""

    def __init__(self, host: str, protocol: str, slots: int, stride: int) -> None:
        self.engine = Engine.of(host, protocol)
        self.buf = self.engine.buffer(slots * stride)
        self.base = self.buf.ctypes.data

    def close(self) -> None:
        self.engine.release(self.buf)


class Reader:
    """The receiving side, for every mooncake edge into one process: one scratch buffer that
    grows to the largest payload read."""

    def __init__(self, host: str, protocol: str) -> None:
        self.host, self.protocol = host, protocol
        self.engine: Engine | None = None
        self.scratch: np.ndarray | None = None

    def start(self) -> Reader:
        if self.engine is None:
            self.engine = Engine.of(self.host, self.protocol)
        return self

    def read(self, session: str, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """The bytes at each (address, nbytes) of the engine `session`, as arrays it owns."""
        self.start()
        assert self.engine is not None
        lengths = [n for _, n in spans]
        *offsets, total = accumulate(lengths, initial=0)  # back to back: they are copied out
        with self.engine.lock:
            if self.scratch is None or len(self.scratch) < total:
                if self.scratch is not None:
                    self.engine.release(self.scratch)
                self.scratch = self.engine.buffer(max(total, 1 << 20))
            local = self.scratch.ctypes.data
            rc = self.engine.te.batch_transfer_sync_read(
                session, [local + o for o in offsets], [a for a, _ in spans], lengths
            )
            if rc != 0:
                raise RequestError(f"Mooncake read from {session} failed (code {rc})")
            return [self.scratch[o : o + n].copy() for o, n in zip(offsets, lengths, strict=True)]
