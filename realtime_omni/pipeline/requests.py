"""The coordinator's requests: each one's output stream, the table of those in flight with their
replica routes and session affinity, and the bookkeeping of their aborts. No sockets: the
coordinator sends what this decides (`Abort`s to the processes `begin_abort` names) and feeds
it what arrives (`StreamEnd`, `StageDone`, `AbortAck`, a death).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from realtime_omni.pipeline.graph import Graph, group_of
from realtime_omni.pipeline.relay import Payload

log = logging.getLogger(__name__)
Route = dict[str, int]  # process group -> replica index, fixed per request
_SESSION_ROUTES = 4096  # sessions whose replicas are remembered (least recently used go)
_END = object()


class Output(NamedTuple):
    stage: str
    data: Payload


class RequestStream:
    """The terminal outputs of one request, as an async iterator of `Output`.

    Outputs of one terminal stage come in order. The iterator ends when every terminal stage
    closed its stream, and raises the request's error if it failed or was aborted. An output's
    credit goes back to its stage when the consumer takes it, so a consumer that stops reading
    stalls the pipeline for this edge instead of growing memory. A consumer that stops for good
    calls `close` (an output left unread would hold its credit even after the request ended).

    `compute_s` (stage -> seconds) adds up what the request's steps cost each stage, as each
    stage reports it (with its `StageDone`, or its `AbortAck` for an aborted request). It is
    whole once `settled` is set, when the request left every stage: a moment after the
    iterator ended (the last reports trail the outputs), or when `Coordinator.abort` returns.
    A stage that was stepping the request when the abort came reports that step's part right
    after the step (`Spent`): at most one step later.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        # Bounded by the credits of the terminal edges: each queued output holds one.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False
        self.compute_s: dict[str, float] = {}
        self.settled = asyncio.Event()

    def _spent(self, stage: str, seconds: float) -> None:
        if seconds:
            self.compute_s[stage] = self.compute_s.get(stage, 0.0) + seconds

    def _put(self, item: tuple[str, Payload, Callable[[], None]]) -> None:
        if not self.closed:
            self._queue.put_nowait(item)

    def _finish(self, error: BaseException | None = None) -> None:
        if not self.closed:
            self._queue.put_nowait(error if error is not None else _END)
            self.closed = True

    def close(self) -> None:
        """The consumer is done: unread outputs give their credits back now, later ones on
        arrival, and iterating ends. Safe to call more than once."""
        self._finish()
        self._drain()

    def _drain(self) -> None:
        """Give back the credits of outputs nobody will read."""
        keep = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, tuple):
                item[2]()
            else:
                keep.append(item)  # the end or the error stays for the reader
        for item in keep:
            self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Output:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        stage, data, ack = item
        ack()
        return Output(stage, data)

    async def collect(self) -> dict[str, list[Payload]]:
        out: dict[str, list[Payload]] = {}
        async for o in self:
            out.setdefault(o.stage, []).append(o.data)
        return out


@dataclass
class Request:
    rid: str
    route: Route
    stream: RequestStream
    done: set[str] = field(default_factory=set)  # stages finished with it
    ended: set[str] = field(default_factory=set)  # terminal stages whose stream closed
    abort_waiting: set[str] | None = None  # stages yet to ack an abort in progress
    abort_done: asyncio.Future[None] | None = None
    answered: bool = False  # an output reached the coordinator
    timer: asyncio.TimerHandle | None = None  # the first output's deadline (`Coordinator`)


class RequestTable:
    """The requests in flight (a request leaves once every stage is done with it, or its abort
    was acknowledged or expired). `on_forget` is called each time one leaves: a slot for a
    waiting `submit`. Runs in the coordinator's loop."""

    def __init__(self, graph: Graph, on_forget: Callable[[], None]) -> None:
        self.graph = graph
        self.on_forget = on_forget
        self.requests: dict[str, Request] = {}
        # The streams their callers still hold, ended requests' too: an abort of one that ended
        # everywhere still gives back what its caller left unread (see `Coordinator.abort`).
        self.streams: weakref.WeakValueDictionary[str, RequestStream] = (
            weakref.WeakValueDictionary()
        )
        self.active: dict[str, int] = {}  # process -> requests routed to it
        # session id -> {group: (replica, its epoch)} of the session's last turn, newest last
        self.session_routes: OrderedDict[str, dict[str, tuple[int, int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, rid: str) -> bool:
        return rid in self.requests

    def __getitem__(self, rid: str) -> Request:
        return self.requests[rid]

    def get(self, rid: str) -> Request | None:
        return self.requests.get(rid)

    def add(self, rid: str, route: Route) -> Request:
        req = Request(rid, route, RequestStream(rid))
        self.requests[rid] = req
        self.streams[rid] = req.stream
        for p in self.processes(route):
            self.active[p] = self.active.get(p, 0) + 1
        return req

    def forget(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        req.stream.settled.set()
        if req.timer is not None:
            req.timer.cancel()
        for p in self.processes(req.route):
            self.active[p] = self.active.get(p, 1) - 1
        self.on_forget()

    # ---- routes ------------------------------------------------------------------------

    def pick_route(self, session: Any, down: set[str], epochs: dict[str, int]) -> Route:
        """Per replicated group, the replica a request runs on: the one that served the
        session's last turn while it is alive and the same incarnation (it keeps the session's
        KV cache), else the least busy one that is up."""
        kept = self.session_routes.get(session, {}) if isinstance(session, str) else {}
        route = {}
        for g, grp in self.graph.groups.items():
            if grp.replicas > 1:
                if g in kept:
                    i, epoch = kept[g]
                    name = f"{g}#{i}"
                    if name not in down and epochs.get(name) == epoch:
                        route[g] = i
                        continue
                names = [n for n in grp.process_names() if n not in down]
                best = min(names or grp.process_names(), key=lambda n: self.active.get(n, 0))
                route[g] = int(best.rsplit("#", 1)[1])
        if isinstance(session, str) and route:
            self.session_routes[session] = {g: (i, epochs[f"{g}#{i}"]) for g, i in route.items()}
            self.session_routes.move_to_end(session)
            while len(self.session_routes) > _SESSION_ROUTES:
                self.session_routes.popitem(last=False)
        return route

    def processes(self, route: Route) -> list[str]:
        """The stage processes a request on `route` runs through, one per group."""
        return [f"{g}#{route.get(g, 0)}" for g in self.graph.groups]

    def process_of(self, stage: str, route: Route) -> str:
        g = self.graph.process_of[stage]
        return f"{g}#{route.get(g, 0)}"

    # ---- progress ----------------------------------------------------------------------

    def stream_ended(self, rid: str, stage: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.ended.add(stage)
            self._maybe_complete(req)

    def stage_done(self, rid: str, stage: str, compute_s: float = 0.0) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.stream._spent(stage, compute_s)
            req.done.add(stage)
            self._maybe_complete(req)

    def spent(self, rid: str, stage: str, compute_s: float) -> None:
        """More compute of a request's (see `RequestStream.compute_s`), even one that left."""
        stream = self.streams.get(rid)
        if stream is not None:
            stream._spent(stage, compute_s)

    def _maybe_complete(self, req: Request) -> None:
        if req.abort_done is None and req.ended >= set(self.graph.terminals):
            req.stream._finish()
            if req.done >= set(self.graph.cfg.stages):
                self.forget(req.rid)

    # ---- aborts ------------------------------------------------------------------------

    def begin_abort(self, req: Request, down: set[str]) -> list[str]:
        """Start the abort of `req`: gives the live processes to send `Abort` to, each of whose
        stages must acknowledge (`abort_acked`). Call `check_abort` after sending."""
        req.stream._drain()  # unread outputs hold credits the stages wait for before acking
        req.abort_done = asyncio.get_running_loop().create_future()
        req.abort_waiting = set()
        live = [p for p in self.processes(req.route) if p not in down]
        for p in live:
            req.abort_waiting.update(self.graph.groups[group_of(p)].stages)
        return live

    def abort_acked(self, rid: str, stage: str, compute_s: float = 0.0) -> None:
        self.spent(rid, stage, compute_s)
        req = self.requests.get(rid)
        if req is not None and req.abort_waiting is not None:
            req.abort_waiting.discard(stage)
            self.check_abort(req)

    def check_abort(self, req: Request) -> None:
        if req.abort_waiting is not None and not req.abort_waiting:
            if req.abort_done is not None and not req.abort_done.done():
                req.abort_done.set_result(None)
            req.stream._drain()
            self.forget(req.rid)

    def abort_expired(self, req: Request) -> None:
        if self.requests.get(req.rid) is req and req.abort_waiting:
            log.error(
                "abort of %s not acknowledged by %s; forgetting it",
                req.rid,
                sorted(req.abort_waiting),
                extra={"request_id": req.rid},
            )
            self.forget(req.rid)

    def died(self, process: str) -> list[Request]:
        """`process` died: its stages owe no more abort acks; gives the requests it fails (on
        it, and still needing one of its stages)."""
        stages = self.graph.groups[group_of(process)].stages
        failed = []
        for req in list(self.requests.values()):
            if process not in self.processes(req.route):
                continue  # on another replica: its stages there still owe their acks
            if req.abort_waiting is not None:
                req.abort_waiting.difference_update(stages)
                self.check_abort(req)
            elif not set(stages) <= req.done:
                failed.append(req)
        return failed
