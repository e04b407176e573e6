"""RTP packets back in order, with as little waiting as the network allows. No I/O, no clock.

    r = Reorder(wait_packets=2)
    for item in r.push(packet.sequence_number, packet):   # in sequence order
        ...                                               # a packet, or Lost(n) where n are missing
    r.flush()                                             # the sender went quiet: stop waiting

A packet in sequence leaves at once. One after a gap is held until the missing ones arrive or
`wait_packets` packets after the gap have (then the gap is `Lost` and what was held leaves at
once, in order); a packet older than what already left (a duplicate, or one that came after its
gap was given up) is dropped and counted in `late`. A jump of `MAX_JUMP` or more, either way,
is a new stream (a sender that restarted its sequence numbers): what was held leaves, and the
new packet starts afresh, with no `Lost` for the jump.

This replaces, for the server's own input, aiortc's audio jitter buffer, which hands a frame on
only once four more follow it (80 ms for every frame of Opus), and after a loss waits until 16
later packets arrived, drops the four frames before the gap and keeps 15 frames queued from then
on. A server's VAD needs each frame once, in order, and as soon as it can have it; a listener's
even playout is its own business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

SEQ_MOD = 1 << 16
MAX_JUMP = 3000  # ~60 s of 20 ms packets: further, either way, and the stream started anew


@dataclass(frozen=True)
class Lost:
    """`packets` consecutive packets that never came (or came too late)."""

    packets: int


class Reorder(Generic[T]):
    """Items keyed by RTP sequence number, out in order. Holds at most `wait_packets - 1`."""

    def __init__(self, wait_packets: int = 2) -> None:
        if wait_packets < 1:
            raise ValueError(f"wait_packets = {wait_packets}: at least 1 (1: never wait)")
        self.wait_packets = wait_packets
        self.next: int | None = None  # the sequence number due next
        self.held: dict[int, T] = {}  # after a gap, by sequence number
        self.lost = 0  # packets given up
        self.late = 0  # packets dropped: duplicates, or after their gap was given up

    @property
    def holding(self) -> bool:
        return bool(self.held)

    def push(self, seq: int, item: T) -> list[T | Lost]:
        """`item`, numbered `seq`, in; what may leave now, in order."""
        if self.next is None:
            self.next = seq
        ahead = (seq - self.next) % SEQ_MOD
        if ahead >= SEQ_MOD - MAX_JUMP:  # behind what already left
            self.late += 1
            return []
        out: list[T | Lost] = []
        if ahead >= MAX_JUMP:  # a new stream: what was held leaves, the jump is not a loss
            out = self.flush()
            self.next = seq
        elif seq in self.held:
            self.late += 1
            return []
        self.held[seq] = item
        out += self._release()
        while len(self.held) >= self.wait_packets:
            out += self._skip_gap()
        return out

    def flush(self) -> list[T | Lost]:
        """Stop waiting: every gap before a held packet is given up and the held packets
        leave, in order."""
        out: list[T | Lost] = []
        while self.held:
            out += self._skip_gap()
        return out

    def _skip_gap(self) -> list[T | Lost]:
        """Give up the gap before the first held packet; it and those that follow it leave."""
        assert self.next is not None
        due = self.next
        gap = min((s - due) % SEQ_MOD for s in self.held)
        self.lost += gap
        self.next = (due + gap) % SEQ_MOD
        return [Lost(gap), *self._release()]

    def _release(self) -> list[T | Lost]:
        out: list[T | Lost] = []
        while self.next in self.held:
            out.append(self.held.pop(self.next))
            self.next = (self.next + 1) % SEQ_MOD
        return out
