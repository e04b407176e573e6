"""Every control-plane message of the runtime, as msgspec structs.

A message travels as one ZMQ multipart message: frame 0 is the msgpack-encoded struct, and the
frames after it are raw array buffers for large payloads sent inline (`ArrayRef.frame` points
at them); small arrays ride in `DataReady.blob` (frame 0).

Addresses: stages are named by the config; the caller side (the coordinator) is the pseudo
stage `CLIENT`. A process is named by its config name plus replica index, e.g. `gpu0#0`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from realtime_omni.errors import OmniError

CLIENT = "client"


class _Message(msgspec.Struct, tag=True, array_like=True):
    """Encoded as msgpack arrays (field order matters, names don't travel), tagged by class."""


class ArrayRef(msgspec.Struct, array_like=True):
    """Where one array of a payload lives and how to view it.

    `frame` >= 1 is an inline ZMQ frame; 0 is `DataReady.blob` at `offset`; -1 is `offset` in
    the slot named by the enclosing `DataReady` (shared memory or CUDA IPC; on a Mooncake edge,
    `offset` is the array's address in the sender's registered memory).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    frame: int = -1
    offset: int = 0
    nbytes: int = 0


class DataReady(_Message):
    """A payload on edge `src -> dst` for one request. The receiver answers `DataAck` once
    it no longer needs the bytes (the slot, if any, then returns to the sender's pool)."""

    request_id: str
    src: str
    dst: str
    src_process: str
    lease: int  # the credit it holds: see `SlotPool.acquire`
    meta: dict[str, Any]
    arrays: list[ArrayRef]
    route: dict[str, int]  # process group -> replica index, fixed per request
    transport: str  # "inline" | "shm" | "cuda_ipc" | "mooncake"
    segment: str = ""  # shm segment name, CUDA IPC pool id, or Mooncake session (host:port)
    handle: bytes = b""  # CUDA IPC pool handle, read once per pool by the receiver
    # Small arrays' bytes, back to back. Decoded as a view into the received frame (no copy);
    # a sender may set bytes.
    blob: memoryview = memoryview(b"")


class DataAck(_Message):
    """Returns `lease` of edge `src -> dst` to the sender (`src` is the sending stage)."""

    src: str
    dst: str
    lease: int


class StreamEnd(_Message):
    """No more items for `request_id` on edge `src -> dst`."""

    request_id: str
    src: str
    dst: str
    route: dict[str, int]


class Abort(_Message):
    request_id: str


class AbortAck(_Message):
    """Sent by a stage once it dropped the request and every slot it lent for it came back;
    `compute_s`: the seconds of its steps the request used there (`pipeline/meter.py`)."""

    request_id: str
    stage: str
    process: str
    compute_s: float = 0.0


class StageDone(_Message):
    """The stage finished with the request; a death of the stage no longer concerns it.
    `compute_s`: the seconds of its steps the request used there (`pipeline/meter.py`)."""

    request_id: str
    stage: str
    process: str
    compute_s: float = 0.0


class Spent(_Message):
    """Seconds of a step a stage spent on a request that was aborted there during the step
    (its `AbortAck` had already gone): the rest of what the request cost the stage."""

    request_id: str
    stage: str
    compute_s: float


class StageError(_Message):
    """A per-request failure inside a stage (the stage itself lives on)."""

    request_id: str
    stage: str
    message: str


class Ready(_Message):
    process: str
    epoch: int
    pid: int


class Heartbeat(_Message):
    process: str
    epoch: int


class PeerDown(_Message):
    """`process` died: reclaim every slot lent to it, forget what it lent you."""

    process: str


class PeerUp(_Message):
    """`process` is back as incarnation `epoch`; answer with `PeerUpAck`. `address`: where its
    inbox is now, when it came back on another node than before."""

    process: str
    epoch: int
    address: str | None = None


class PeerUpAck(_Message):
    process: str  # who acknowledges
    peer: str


class StatsRequest(_Message):
    token: int


class Stats(_Message):
    """A process's bookkeeping, for tests and health pages."""

    token: int
    process: str
    free_slots: dict[str, int]  # "src->dst" -> free credits
    total_slots: dict[str, int]
    active_requests: dict[str, int]  # stage -> requests holding state
    segments: list[str]
    steps: dict[str, list[tuple[float, float]]]  # stage -> recent (start monotonic s, seconds)
    gc_frozen: int = 0  # objects kept out of the cyclic collector's passes (made before start)
    batches: dict[str, list[int]] = msgspec.field(default_factory=dict)  # per step in `steps`:
    # the requests it emitted for (what a step served)
    # Per step in `steps`, the CPU seconds of the thread that ran it (with one intra-op thread,
    # the step's own): less than its duration by the time the process waited for a core.
    step_cpu: dict[str, list[float]] = msgspec.field(default_factory=dict)
    # stage -> its KV pool: (blocks in use, blocks in all, kept sessions evicted since start)
    kv: dict[str, tuple[int, int, int, int]] = msgspec.field(default_factory=dict)
    # "src->dst" -> messages waiting: received, not yet taken by the stage (`queued_in`), and
    # emitted, not yet sent for want of credit (`queued_out`)
    queued_in: dict[str, int] = msgspec.field(default_factory=dict)
    queued_out: dict[str, int] = msgspec.field(default_factory=dict)
    # stage -> seconds its steps took since the process started (`pipeline/meter.py`)
    busy_s: dict[str, float] = msgspec.field(default_factory=dict)


class Shutdown(_Message):
    pass


Message = (
    DataReady
    | DataAck
    | StreamEnd
    | Abort
    | AbortAck
    | StageDone
    | Spent
    | StageError
    | Ready
    | Heartbeat
    | PeerDown
    | PeerUp
    | PeerUpAck
    | StatsRequest
    | Stats
    | Shutdown
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def send(sock: Any, msg: Message, frames: Sequence[Any] = ()) -> None:
    """`msg` on a ZMQ socket, then its array frames zero-copy. A lone message is copied: for a
    few kilobytes that is cheaper than ZMQ's zero-copy bookkeeping."""
    if frames:
        sock.send_multipart([encode(msg), *frames], copy=False)
    else:
        sock.send(encode(msg))


def decode(frame: bytes | memoryview) -> Message:
    return _decoder.decode(frame)


class Malformed(OmniError):
    """A message that does not decode, or whose frames are not the ones it announces. Its
    frames were all taken off the socket: the caller logs it and goes on."""


def receive(sock: Any, copy: bool = True) -> tuple[Message, list[Any]] | None:
    """The next message waiting on a ZMQ socket, with all its frames (bytes, or with
    `copy=False` zmq Frames viewed in place), or None when none waits. Never blocks, and
    raises `Malformed` (after discarding the rest of that message) for a message that does
    not decode or announces other frames than it has: one bad sender cannot block the reader.

    How many frames follow frame 0 is read from the message itself (one per `ArrayRef` in a
    frame of its own) and checked against the socket's RCVMORE; ZMQ delivers a multipart
    message whole, so its frames are there at once."""
    try:
        first = sock.recv(zmq.NOBLOCK, copy=copy)
    except zmq.Again:
        return None
    try:
        msg = decode(first if copy else first.buffer.toreadonly())  # arrays view it read-only
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        _discard_rest(sock)
        raise Malformed(f"undecodable message: {e}") from None
    frames = [first]
    if type(msg) is DataReady:
        for ref in msg.arrays:
            if ref.frame > 0:
                if not sock.getsockopt(zmq.RCVMORE):  # else recv takes the next message's
                    raise Malformed(f"{msg.src}->{msg.dst}: fewer frames than announced")
                frames.append(sock.recv(zmq.NOBLOCK, copy=copy))
    if sock.getsockopt(zmq.RCVMORE):
        _discard_rest(sock)
        raise Malformed(f"{type(msg).__name__}: more frames than announced")
    return msg, frames


def _discard_rest(sock: Any) -> None:
    while sock.getsockopt(zmq.RCVMORE):
        sock.recv(zmq.NOBLOCK)
