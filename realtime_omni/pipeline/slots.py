"""Credit accounting for one edge: a fixed set of slots, each lent for one payload at a time.

A plain class with no I/O. The sender acquires a slot per payload it sends and the receiver's
acknowledgement releases it; with no free slot the sender waits (backpressure), so what one edge
holds in flight is bounded by `n` whatever the consumer does.

Each lending is a lease: a number naming the slot (`slot(lease)`) and that one lending of it. An
acknowledgement names its lease, so a late one, for a slot reclaimed from a dead peer and lent
again since, cannot free the slot under its new holder.

Free slots are reused last-returned first: that slot's memory is the likeliest still in the CPU
cache, which makes copying a big payload into it faster (`benchmarks/transport.py`, shm rows).
"""

from __future__ import annotations


class SlotPool:
    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {n}")
        self.n = n
        self._free = list(range(n - 1, -1, -1))  # a stack; slot 0 on top
        self._lent: dict[int, tuple[str, str]] = {}  # lease -> (request_id, peer process)
        self._per_request: dict[str, int] = {}  # a plain dict: Counter's misses call Python
        self._leases = 0  # made so far

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: str, peer: str) -> int | None:
        """A lease on a free slot, lent to `peer` for `request_id`; None when all are out."""
        if not self._free:
            return None
        lease = self._leases * self.n + self._free.pop()
        self._leases += 1
        self._lent[lease] = (request_id, peer)
        self._per_request[request_id] = self._per_request.get(request_id, 0) + 1
        return lease

    def slot(self, lease: int) -> int:
        """Which slot `lease` lends (0 to n - 1)."""
        return lease % self.n

    def release(self, lease: int) -> str | None:
        """End `lease`; gives the request it was for, None if it is not current (a late or
        duplicate acknowledgement, e.g. after the peer was reclaimed)."""
        owner = self._lent.pop(lease, None)
        if owner is None:
            return None
        self._free.append(self.slot(lease))
        rid = owner[0]
        if (left := self._per_request[rid] - 1) > 0:
            self._per_request[rid] = left
        else:
            del self._per_request[rid]
        return rid

    def held(self, request_id: str) -> int:
        """Slots currently lent for `request_id`."""
        return self._per_request.get(request_id, 0)

    def reclaim(self, peer: str) -> list[str]:
        """End every lease of `peer` (it died); gives the requests they belonged to."""
        leases = [lease for lease, (_, p) in self._lent.items() if p == peer]
        return [rid for lease in leases if (rid := self.release(lease)) is not None]
