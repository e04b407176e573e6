"""The per-session playout queue: synthesised audio waiting to leave, at the transport's rate.

The transport's clock paces it: a WebRTC track reads one 20 ms frame per 20 ms, the WebSocket
sender reads what real time allows. The queue keeps no clock of its own; it knows what was
played (read) of each response item, for truncation, and the `token_time` of the chunk each
sample came from, so the first sample of a chunk leaving can be timed against its thinker token.
No I/O, no asyncio.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from realtime_omni.errors import OmniError


class PlayoutFull(OmniError):
    """A write would take the queue past its `max_samples`."""


@dataclass
class ChunkStart:
    """The first sample of a written chunk left the queue."""

    item_id: str
    token_time: float  # time.monotonic() of the thinker token the chunk's first frame came from
    queue_was_empty: bool  # nothing of this item was waiting when it was written
    offset: int  # where in the read's output the sample lies


@dataclass
class Read:
    """What one read took out of the queue."""

    pcm: np.ndarray  # float32
    items: list[tuple[str, int, int]] = field(default_factory=list)  # (item_id, offset, samples)
    chunk_starts: list[ChunkStart] = field(default_factory=list)


@dataclass
class _Chunk:
    item_id: str
    pcm: np.ndarray
    token_time: float | None
    queue_was_empty: bool
    pos: int = 0  # samples already read


class Playout:
    """A FIFO of audio chunks at `rate_hz`, bounded by `max_samples` queued."""

    def __init__(self, rate_hz: int, max_samples: int | None = None) -> None:
        self.rate_hz = rate_hz
        self.max_samples = max_samples if max_samples is not None else 30 * rate_hz
        self._chunks: deque[_Chunk] = deque()
        self.queued = 0  # samples waiting
        self.played: dict[str, int] = {}  # item_id -> samples read so far
        self.written: dict[str, int] = {}  # item_id -> samples written so far
        self.paused = False  # reads give silence (or nothing) and take nothing from the queue

    def write(self, item_id: str, pcm: np.ndarray, token_time: float | None = None) -> None:
        pcm = np.asarray(pcm, np.float32).reshape(-1)
        if not len(pcm):
            return
        if self.queued + len(pcm) > self.max_samples:
            raise PlayoutFull(
                f"playout queue holds {self.queued} samples; {len(pcm)} more exceed its limit of "
                f"{self.max_samples}"
            )
        empty = self.queued_of(item_id) == 0
        self._chunks.append(_Chunk(item_id, pcm, token_time, empty))
        self.queued += len(pcm)
        self.written[item_id] = self.written.get(item_id, 0) + len(pcm)
        self.played.setdefault(item_id, 0)

    def read(self, n: int, pad: bool = True) -> Read:
        """Take up to `n` samples; with `pad` the result has exactly `n`, silence after the end
        of what was queued."""
        parts: list[np.ndarray] = []
        out = Read(np.zeros(0, np.float32))
        if self.paused:
            out.pcm = np.zeros(n if pad else 0, np.float32)
            return out
        got = 0
        while got < n and self._chunks:
            c = self._chunks[0]
            take = min(n - got, len(c.pcm) - c.pos)
            if c.pos == 0 and c.token_time is not None:
                out.chunk_starts.append(ChunkStart(c.item_id, c.token_time, c.queue_was_empty, got))
            parts.append(c.pcm[c.pos : c.pos + take])
            if out.items and out.items[-1][0] == c.item_id:
                item, off, cnt = out.items[-1]
                out.items[-1] = (item, off, cnt + take)
            else:
                out.items.append((c.item_id, got, take))
            c.pos += take
            got += take
            self.played[c.item_id] += take
            if c.pos == len(c.pcm):
                self._chunks.popleft()
        self.queued -= got
        if pad and got < n:
            parts.append(np.zeros(n - got, np.float32))
        out.pcm = np.concatenate(parts) if parts else np.zeros(n if pad else 0, np.float32)
        return out

    def unread(self, item_id: str, pcm: np.ndarray) -> None:
        """Put back read samples that never reached the listener (a transport's downstream
        buffer dropped them on a pause): they are read again next, and no longer count as
        played."""
        pcm = np.asarray(pcm, np.float32).reshape(-1)
        if not len(pcm) or item_id not in self.played:
            return
        self._chunks.appendleft(_Chunk(item_id, pcm, None, False))
        self.queued += len(pcm)
        self.played[item_id] = max(0, self.played[item_id] - len(pcm))

    def clear(self, item_id: str | None = None) -> int:
        """Drop what is queued (of one item, or all); the next read starts with silence or the
        next item. Returns the samples dropped."""
        keep = deque(c for c in self._chunks if item_id is not None and c.item_id != item_id)
        dropped = self.queued - sum(len(c.pcm) - c.pos for c in keep)
        self._chunks = keep
        self.queued -= dropped
        return dropped

    def queued_of(self, item_id: str) -> int:
        return sum(len(c.pcm) - c.pos for c in self._chunks if c.item_id == item_id)

    def played_ms(self, item_id: str) -> int:
        return self.played.get(item_id, 0) * 1000 // self.rate_hz

    def forget(self, item_id: str) -> None:
        """Drop the accounting of an item nobody will ask about again."""
        self.clear(item_id)
        self.played.pop(item_id, None)
        self.written.pop(item_id, None)

    @property
    def queued_ms(self) -> float:
        return self.queued * 1000 / self.rate_hz
