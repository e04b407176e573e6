"""Credit accounting for one edge: a fixed set of slots, each lent for one payload at a time.

A plain class with no I/O. The sender acquires a slot per payload it sends and the receiver's
acknowledgement releases it; with no free slot the sender waits (backpressure), so what one edge
holds in flight is bounded by `n` whatever the consumer does.
"""

from __future__ import annotations

from collections import Counter, deque


class SlotPool:
    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {n}")
        self.n = n
        self._free: deque[int] = deque(range(n))
        self._lent: dict[int, tuple[str, str]] = {}  # slot -> (request_id, peer process)
        self._per_request: Counter[str] = Counter()

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: str, peer: str) -> int | None:
        """A free slot lent to `peer` for `request_id`, or None when all are out."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._lent[slot] = (request_id, peer)
        self._per_request[request_id] += 1
        return slot

    def release(self, slot: int) -> str | None:
        """Return `slot`; gives the request it was lent for, None if it was not lent (a late or
        duplicate acknowledgement, e.g. after the peer was reclaimed)."""
        owner = self._lent.pop(slot, None)
        if owner is None:
            return None
        self._free.append(slot)
        rid = owner[0]
        self._per_request[rid] -= 1
        if not self._per_request[rid]:
            del self._per_request[rid]
        return rid

    def held(self, request_id: str) -> int:
        """Slots currently lent for `request_id`."""
        return self._per_request.get(request_id, 0)

    def reclaim(self, peer: str) -> list[str]:
        """Take back every slot lent to `peer` (it died); gives the requests they belonged to."""
        slots = [s for s, (_, p) in self._lent.items() if p == peer]
        return [rid for s in slots if (rid := self.release(s)) is not None]
