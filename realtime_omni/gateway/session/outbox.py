"""A session's server events on their way out: to its transport, in order, and a copy to every
listener (a call's sideband connections).

    out = Outbox()
    out.send([{"type": "response.created", ...}])   # in order, never blocks
    event = await out.next()                          # the transport's reader
    q = out.subscribe(); ...; out.unsubscribe(q)      # a listener's copy of what follows
"""

from __future__ import annotations

import asyncio
from typing import Any

Event = dict[str, Any]


class Outbox:
    def __init__(self) -> None:
        # Unbounded: events are made only as fast as client events arrive and a lead-limited
        # response streams; a transport that stops reading is closed by its own send timeout.
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._listeners: list[asyncio.Queue[Event | None]] = []

    def send(self, events: list[Event]) -> None:
        """Server events, in order, to the transport and every listener."""
        for event in events:
            self._events.put_nowait(event)
            for q in list(self._listeners):
                if q.full():  # a listener that stopped reading: dropped, its reader sees None
                    self._listeners.remove(q)
                    q.get_nowait()
                    q.put_nowait(None)
                else:
                    q.put_nowait(event)

    def subscribe(self, limit: int = 10000) -> asyncio.Queue[Event | None]:
        """A copy of every event from now on, until `unsubscribe`; None in it: the listener
        fell `limit` events behind and was dropped."""
        q: asyncio.Queue[Event | None] = asyncio.Queue(limit)
        self._listeners.append(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event | None]) -> None:
        if q in self._listeners:
            self._listeners.remove(q)

    async def next(self) -> Event:
        return await self._events.get()

    def pending(self) -> list[Event]:
        """The events not yet taken, taken now."""
        out = []
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out
