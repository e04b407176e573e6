"""What the stages of one process emit and take in, and where it goes: the per-request outbox,
the credits, the deliveries waiting for their stage and the abort bookkeeping. No sockets, no
threads, no clock.

A stage process (`worker.py`) drives it from its loop with a `Link` that sends over ZMQ; the
in-process test harness (`tests/models/inproc.py`) drives the same router with a `Link` that
keeps what reaches the client, and credits without limit. Call order per loop turn: feed what
arrived (`receive_data`, `receive_end`, `acked`, `abort`, `peer_down`), then `work(step)`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from realtime_omni.errors import OmniError, RequestError
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline.executor import Emit
from realtime_omni.pipeline.graph import Edge, Graph
from realtime_omni.pipeline.stage import Payload, Release, Stage

Route = dict[str, int]  # process group -> replica index, fixed per request
StepFn = Callable[[Stage], list[Emit]]


@dataclass
class Out:
    """One output of a stage, waiting in its request's outbox."""

    kind: Literal["data", "end", "done"]
    request_id: str
    edge: Edge | None = None
    payload: Payload | None = None


@dataclass
class In:
    """Something for a stage to take in: a payload (still in its slot or frame) or an end."""

    kind: Literal["data", "end"]
    request_id: str
    src: str
    once: bool = False
    msg: m.DataReady | None = None  # a remote payload, opened when delivered
    frames: list[Any] | None = None
    payload: Payload | None = None  # a local payload, by reference
    release: Release | None = None  # acknowledges the payload upstream


class Credits(Protocol):
    """The credits of one output edge (`relay.Outlet`: a `SlotPool` behind a per-request cap)."""

    def acquire(self, request_id: str, peer: str) -> int | None: ...

    def release(self, lease: int) -> str | None: ...

    def held(self, request_id: str) -> int: ...

    def reclaim(self, peer: str) -> list[str]: ...


class Unmetered:
    """Credits without limit: every output goes at once, and none is ever held."""

    def __init__(self) -> None:
        self._leases = 0

    def acquire(self, request_id: str, peer: str) -> int | None:
        self._leases += 1
        return self._leases

    def release(self, lease: int) -> str | None:
        return None

    def held(self, request_id: str) -> int:
        return 0

    def reclaim(self, peer: str) -> list[str]:
        return []


class Link(Protocol):
    """The router's way out of its process. `send_data` raises (an `OmniError`, a `TypeError`,
    a `ValueError`, a msgspec error) when nothing was sent; the router then fails the request."""

    def send_data(
        self, edge: Edge, peer: str, request_id: str, lease: int, payload: Payload, route: Route
    ) -> None: ...

    def send_end(self, edge: Edge, peer: str, request_id: str, route: Route) -> None: ...

    def open_payload(self, msg: m.DataReady, frames: list[Any]) -> Payload:
        """A remote payload's contents, valid until its release."""
        ...

    def stage_done(self, stage: str, request_id: str) -> None: ...

    def stage_error(self, stage: str, request_id: str, message: str) -> None: ...

    def abort_acked(self, stage: str, request_id: str) -> None:
        """Every credit `stage` held for an aborted request is back."""
        ...


class Router:
    """Routing for `stages` (the stages of one process, by name, in stepping order). An edge in
    `local` hands payloads to its destination's `In` queue by reference; any other goes out
    through `link`. `credits` holds every output edge's credits, by `(src, dst)`."""

    def __init__(
        self,
        graph: Graph,
        stages: dict[str, Stage],
        credits: Mapping[tuple[str, str], Credits],
        link: Link,
        local: Callable[[Edge], bool] = lambda e: e.transport == "reference",
    ) -> None:
        self.graph = graph
        self.stages = stages
        self.credits = credits
        self.link = link
        self.local = local
        self.down: set[str] = set()  # peer processes known dead
        # What a stage emitted and could not send yet for want of credit, per request. A request
        # with pending outputs is held: its executor makes nothing more for it and its inputs
        # wait (see `work`), so each queue is bounded by one step's emits.
        self.outbox: dict[str, dict[str, deque[Out]]] = {n: {} for n in stages}
        # Deliveries waiting for their stage. A held request takes nothing in, so its inputs
        # stay unacknowledged and its senders upstream run out of credit for it: backpressure.
        # Bounded by the credits of the stage's input edges.
        self.inbound: dict[str, deque[In]] = {n: deque() for n in stages}
        self.held: dict[str, set[str]] = {n: set() for n in stages}  # as last told each stage
        self.routes: dict[str, Route] = {}
        self.abort_waits: set[tuple[str, str]] = set()  # (stage, rid) waiting for slots back

    def process_of(self, stage: str, route: Route) -> str:
        if stage == m.CLIENT:
            return m.CLIENT
        g = self.graph.process_of[stage]
        return f"{g}#{route.get(g, 0)}"

    # ---- in ----------------------------------------------------------------------------

    def receive_data(self, msg: m.DataReady, frames: list[Any], release: Release) -> None:
        """A payload from another process; `release` acknowledges it to its sender."""
        if msg.request_id in self.stages[msg.dst].closed:
            release()
            return
        self.routes.setdefault(msg.request_id, msg.route)
        once = self.graph.edge(msg.src, msg.dst).kind == "once"
        self.inbound[msg.dst].append(
            In("data", msg.request_id, msg.src, once, msg=msg, frames=frames, release=release)
        )

    def receive_end(self, rid: str, src: str, dst: str, route: Route) -> None:
        if self.graph.edge(src, dst).kind != "stream":  # KeyError: not an edge of ours
            raise ValueError(f"{src}->{dst} is not a streaming edge")
        if rid not in self.stages[dst].closed:
            self.routes.setdefault(rid, route)
            self.inbound[dst].append(In("end", rid, src))

    def acked(self, src: str, dst: str, lease: int) -> None:
        """The receiver of edge `src -> dst` is done with the payload of `lease`."""
        rid = self.credits[(src, dst)].release(lease)
        if rid is not None:
            self._check_abort_wait(src, rid)

    # ---- work --------------------------------------------------------------------------

    def work(self, step: StepFn) -> bool:
        """Flush, deliver and step every stage (`step` runs one executor step and gives what
        it emitted). A request whose outputs wait for credit is held in its stage; an executor
        that cannot hold requests (no `hold` method) is not stepped at all while any of its
        requests waits, and takes nothing in. Whether anything happened or is left to do."""
        busy = False
        for name, stage in self.stages.items():
            self.flush(name)
            held = set(self.outbox[name])
            if stage.can_hold and held != self.held[name]:
                stage.set_held(held)  # on a change only: a hold set by hand stays till then
                self.held[name] = held
            busy |= self.deliver(name, held)
            if (stage.can_hold or not held) and stage.executor.has_work():
                busy = True
                for emit in step(stage):
                    self.route(name, emit)
                self.flush(name)
            self.report_failures(stage)
        return busy or any(self.deliverable(n) for n in self.stages)

    def deliverable(self, name: str) -> bool:
        held = self.outbox[name]
        if not held:
            return bool(self.inbound[name])
        return self.stages[name].can_hold and any(
            i.request_id not in held for i in self.inbound[name]
        )

    def deliver(self, name: str, held: set[str]) -> bool:
        stage, box = self.stages[name], self.inbound[name]
        if not box or (held and not stage.can_hold):
            return False
        waiting: deque[In] = deque()
        delivered = False
        while box:
            item = box.popleft()
            if item.request_id in held:
                waiting.append(item)  # stays unacknowledged until the request flows again
                continue
            delivered = True
            if item.kind == "end":
                stage.on_end(item.request_id, item.src)
                continue
            release = item.release or _nothing
            payload = item.payload
            if item.msg is not None:
                try:
                    payload = self.link.open_payload(item.msg, item.frames or [])
                except (OSError, ValueError, RequestError) as e:
                    release()
                    why = str(e)
                    if isinstance(e, FileNotFoundError):  # only a writer's death unlinks its slots
                        why = "its process died before it was read"
                    stage.fail(item.request_id, f"cannot read payload from {item.src}: {why}")
                    continue
            stage.on_data(item.request_id, item.src, payload or {}, release, item.once)
            self.report_failures(stage)
        box.extend(waiting)
        return delivered

    def report_failures(self, stage: Stage) -> None:
        while stage.failures:
            rid, message = stage.failures.pop(0)
            self.drop(rid)
            self.link.stage_error(stage.name, rid, message)

    # ---- out ---------------------------------------------------------------------------

    def route(self, stage: str, emit: Emit) -> None:
        box = self.outbox[stage].setdefault(emit.request_id, deque())
        if emit.data is not None:
            for e in self.graph.out_edges[stage]:
                if emit.to is None or emit.to == e.dst:
                    box.append(Out("data", emit.request_id, e, emit.data))
        if emit.done:
            for e in self.graph.out_edges[stage]:
                if e.kind == "stream":
                    box.append(Out("end", emit.request_id, e))
            box.append(Out("done", emit.request_id))

    def flush(self, stage: str) -> None:
        """Send what credits allow, each request's outputs in order."""
        boxes = self.outbox[stage]
        for rid in list(boxes):
            box = boxes.get(rid)
            if box is not None:
                self._flush_request(stage, box)
                if not box:
                    boxes.pop(rid, None)

    def _flush_request(self, stage: str, box: deque[Out]) -> None:
        """Send one request's outputs until one finds no credit (it then waits for an ack)."""
        while box:
            out = box[0]
            rid = out.request_id
            route = self.routes.get(rid, {})
            if out.kind == "done":
                self.stages[stage].finish(rid)
                self.link.stage_done(stage, rid)
                self._forget_route(rid)
            elif out.kind == "end":
                e = out.edge
                assert e is not None
                if self.local(e):
                    self.inbound[e.dst].append(In("end", rid, e.src))
                else:
                    self.link.send_end(e, self.process_of(e.dst, route), rid, route)
            else:
                e = out.edge
                assert e is not None and out.payload is not None
                credits = self.credits[(e.src, e.dst)]
                peer = self.process_of(e.dst, route)
                if peer in self.down:  # the coordinator fails every request that needed it
                    box.popleft()
                    continue
                lease = credits.acquire(rid, peer)
                if lease is None:
                    return  # backpressure: wait for an ack
                if self.local(e):
                    release = self._local_release(e, lease)
                    once = e.kind == "once"
                    item = In("data", rid, e.src, once, payload=out.payload, release=release)
                    self.inbound[e.dst].append(item)
                else:
                    try:
                        self.link.send_data(e, peer, rid, lease, out.payload, route)
                    except (OmniError, TypeError, ValueError, msgspec.MsgspecError) as err:
                        # Nothing was sent (msgpack refused the metadata, say): the credit is
                        # still ours, and must come back or the edge runs dry.
                        credits.release(lease)
                        box.popleft()
                        self.stages[stage].fail(rid, str(err))
                        self.drop(rid)
                        continue
            box.popleft()

    def _local_release(self, e: Edge, lease: int) -> Release:
        def release() -> None:
            self.acked(e.src, e.dst, lease)

        return release

    # ---- abort -------------------------------------------------------------------------

    def abort(self, rid: str) -> None:
        """Drop the request everywhere here; each stage's `abort_acked` follows once the
        credits it lent for it are back."""
        self.drop(rid)
        for name, stage in self.stages.items():
            stage.abort(rid)
            stage.failures = [f for f in stage.failures if f[0] != rid]
            self.abort_waits.add((name, rid))
            self._check_abort_wait(name, rid)
        # Payloads already handed to local stages are released by their abort above.
        self._forget_route(rid)

    def drop(self, rid: str) -> None:
        """Forget the request's waiting outputs, and release its waiting inputs."""
        for boxes in self.outbox.values():
            boxes.pop(rid, None)
        for box in self.inbound.values():
            for item in [i for i in box if i.request_id == rid]:
                box.remove(item)
                if item.release is not None:
                    item.release()

    def _check_abort_wait(self, stage: str, rid: str) -> None:
        if (stage, rid) not in self.abort_waits:
            return
        if any(c.held(rid) for (src, _), c in self.credits.items() if src == stage):
            return
        self.abort_waits.discard((stage, rid))
        self.link.abort_acked(stage, rid)

    def _forget_route(self, rid: str) -> None:
        if not any(s.holds(rid) for s in self.stages.values()):
            self.routes.pop(rid, None)

    def peer_down(self, process: str) -> None:
        """`process` died: nothing more goes to it, and the credits it held come back."""
        self.down.add(process)
        for (src, _), credits in self.credits.items():
            for rid in credits.reclaim(process):
                self._check_abort_wait(src, rid)

    def peer_up(self, process: str) -> None:
        self.down.discard(process)

    # ---- stats -------------------------------------------------------------------------

    def queued_in(self) -> dict[str, int]:
        """Per input edge, deliveries waiting for their stage."""
        counts: dict[str, int] = {}
        for stage, box in self.inbound.items():
            for item in box:
                key = f"{item.src}->{stage}"
                counts[key] = counts.get(key, 0) + 1
        return counts

    def queued_out(self) -> dict[str, int]:
        """Per output edge, outputs waiting for credit."""
        counts = {e.key: 0 for n in self.stages for e in self.graph.out_edges[n]}
        for boxes in self.outbox.values():
            for box in boxes.values():
                for out in box:
                    if out.edge is not None:
                        counts[out.edge.key] = counts.get(out.edge.key, 0) + 1
        return counts


def _nothing() -> None:
    """The release of a payload nobody acknowledges (one the caller handed in)."""
