"""The router with no sockets: by-reference hand-over, credits and backpressure, abort acks, a
dead peer, and a link that fails to send."""

from __future__ import annotations

from typing import Any

from realtime_omni.errors import ExecutorError
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.executor import Emit, HoldsRequests
from realtime_omni.pipeline.graph import Edge, Graph
from realtime_omni.pipeline.messages import CLIENT, DataReady
from realtime_omni.pipeline.router import Route, Router
from realtime_omni.pipeline.slots import SlotPool
from realtime_omni.pipeline.stage import Payload, Stage


class Counting(HoldsRequests):
    """Emits `n` for each running request per step; `done` with its `frames`-th."""

    def __init__(self, frames: int = 3) -> None:
        self.frames = frames
        self.reqs: dict[str, int] = {}
        self.items: list[tuple[str, Payload]] = []

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        self.reqs[request_id] = 0

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        self.items.append((request_id, item))

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.running())

    def step(self) -> list[Emit]:
        out = []
        for rid in list(self.running()):
            self.reqs[rid] += 1
            done = self.reqs[rid] == self.frames
            out.append(Emit(rid, {"n": self.reqs[rid]}, done=done))
            if done:
                del self.reqs[rid]
        return out

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)


class Link:
    """Records what leaves; `fail_sends` makes every send to the client raise."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Payload]] = []
        self.events: list[tuple[str, str, str]] = []
        self.fail_sends = False

    def send_data(
        self, edge: Edge, peer: str, request_id: str, lease: int, payload: Payload, route: Route
    ) -> None:
        if self.fail_sends:
            raise TypeError("msgpack refused the metadata")
        self.sent.append((peer, request_id, payload))

    def send_end(self, edge: Edge, peer: str, request_id: str, route: Route) -> None:
        self.events.append(("end", edge.key, request_id))

    def open_payload(self, msg: DataReady, frames: list[Any]) -> Payload:
        raise AssertionError("no remote payload here")

    def stage_done(self, stage: str, request_id: str) -> None:
        self.events.append(("done", stage, request_id))

    def stage_error(self, stage: str, request_id: str, message: str) -> None:
        self.events.append(("error", stage, message))

    def abort_acked(self, stage: str, request_id: str) -> None:
        self.events.append(("abort_ack", stage, request_id))


def setup(client_slots: int = 8, frames: int = 3) -> tuple[Router, Link, dict[str, SlotPool]]:
    """Stage `a` streams to `b` in one process; `b` streams to the client, `client_slots`
    credits, all of which one request may take."""
    cfg = parse_config(
        {
            "name": "t",
            "entry": "a",
            "stages": {
                "a": {"executor": "simulated", "stream_to": ["b"], "process": "p", "max_batch": 1},
                "b": {"executor": "simulated", "process": "p", "terminal": True, "max_batch": 1},
            },
            "edges": [
                {"src": "b", "dst": CLIENT, "slots": client_slots, "request_slots": client_slots}
            ],
        }
    )
    graph = Graph(cfg)
    stages = {
        "a": Stage("a", Counting(frames), graph.wait_for["a"]),
        "b": Stage("b", Counting(frames=10**6), graph.wait_for["b"]),
    }
    pools = {e.key: SlotPool(e.slots) for e in graph.edges if e.src != CLIENT}
    link = Link()
    credits = {(e.src, e.dst): pools[e.key] for e in graph.edges if e.src != CLIENT}
    return Router(graph, stages, credits, link), link, pools


def start(router: Router, rid: str) -> None:
    router.stages["a"].on_data(rid, CLIENT, {}, lambda: None, once=True)


def test_a_local_edge_hands_payloads_over_by_reference_and_the_request_finishes() -> None:
    router, link, pools = setup()
    start(router, "r")
    while router.work(Stage.step):
        pass
    b = router.stages["b"].executor
    assert isinstance(b, Counting)
    assert [i for _, i in b.items] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert ("done", "a", "r") in link.events
    assert pools["a->b"].free == pools["a->b"].n  # every local credit came back
    assert [p for _, _, p in link.sent][:3] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert {peer for peer, _, _ in link.sent} == {CLIENT}


def test_a_request_without_credit_is_held_and_flows_again_on_an_ack() -> None:
    router, link, _pools = setup(client_slots=2)
    start(router, "r")
    for _ in range(10):
        router.work(Stage.step)
    assert len(link.sent) == 2  # the edge's two credits, then nothing more
    assert router.stages["b"].held == {"r"}
    assert router.queued_out()["b->client"] == 1  # one step's output waits, no more
    router.acked("b", CLIENT, 0)  # the first lease comes back
    router.work(Stage.step)
    assert len(link.sent) == 3  # the waiting one went, and the next step's waits again
    router.work(Stage.step)
    assert len(link.sent) == 3
    assert router.stages["b"].held == {"r"}


def test_an_abort_is_acknowledged_only_once_the_credits_lent_for_it_are_back() -> None:
    router, link, _pools = setup(client_slots=2)
    start(router, "r")
    for _ in range(4):
        router.work(Stage.step)
    router.abort("r")
    acks = [e for e in link.events if e[0] == "abort_ack"]
    assert acks == [("abort_ack", "a", "r")]  # b still lends two slots to the client
    assert router.outbox["b"] == {}
    router.acked("b", CLIENT, 0)
    assert ("abort_ack", "b", "r") not in link.events
    router.acked("b", CLIENT, 3)  # the second lease: 1 x 2 slots + slot 1
    assert ("abort_ack", "b", "r") in link.events


def test_a_dead_peer_gives_its_credits_back_and_gets_nothing_more() -> None:
    router, link, pools = setup(client_slots=2)
    start(router, "r")
    for _ in range(4):
        router.work(Stage.step)
    router.abort("r")
    router.peer_down(CLIENT)  # the acks will never come
    assert ("abort_ack", "b", "r") in link.events
    assert pools["b->client"].free == 2


def test_a_send_that_fails_fails_its_request_and_keeps_the_credit() -> None:
    router, link, pools = setup()
    link.fail_sends = True
    start(router, "r")
    for _ in range(3):
        router.work(Stage.step)
    errors = [e for e in link.events if e[0] == "error"]
    assert errors == [("error", "b", "msgpack refused the metadata")]
    assert pools["b->client"].free == pools["b->client"].n
    assert not router.stages["b"].holds("r")


class Misbehaving(Counting):
    """As `Counting`, but a request named in `stall` never makes another output (it stays
    running: `has_work` says yes), and one named in `fail_at` fails at that step."""

    def __init__(self, stall: tuple[str, ...] = (), fail_at: tuple[str, int] | None = None) -> None:
        super().__init__(frames=4)
        self.stall = set(stall)
        self.fail_at = dict([fail_at] if fail_at else [])

    def step(self) -> list[Emit]:
        for rid, n in self.fail_at.items():
            if self.reqs.get(rid) == n - 1:
                del self.reqs[rid]
                raise ExecutorError(rid, f"{rid} failed at step {n}")
        stalled = {rid: self.reqs.pop(rid) for rid in self.stall if rid in self.reqs}
        try:
            return super().step()
        finally:
            self.reqs.update(stalled)


def misbehaving(executor: Misbehaving) -> tuple[Router, Link]:
    router, link, _ = setup()
    router.stages["a"].executor = executor
    for rid in ("good", "bad"):
        start(router, rid)
    for _ in range(12):
        router.work(Stage.step)
    return router, link


def test_a_request_that_fails_mid_stream_is_reported_and_the_other_finishes() -> None:
    router, link = misbehaving(Misbehaving(fail_at=("bad", 2)))
    errors = [e for e in link.events if e[0] == "error"]
    assert len(errors) == 1 and errors[0][:2] == ("error", "a")
    assert errors[0][2].startswith("ExecutorError: bad failed at step 2")
    assert ("done", "a", "good") in link.events
    assert ("done", "a", "bad") not in link.events
    b = router.stages["b"].executor
    assert isinstance(b, Counting)
    assert [i["n"] for rid, i in b.items if rid == "bad"] == [1]
    assert [i["n"] for rid, i in b.items if rid == "good"] == [1, 2, 3, 4]


def test_a_stalled_request_holds_up_no_other_and_is_not_held_for_credit() -> None:
    router, link = misbehaving(Misbehaving(stall=("bad",)))
    assert ("done", "a", "good") in link.events
    b = router.stages["b"].executor
    assert isinstance(b, Counting)
    assert not [rid for rid, _ in b.items if rid == "bad"]
    assert router.stages["a"].holds("bad") and router.stages["a"].held == set()
    router.abort("bad")  # it made nothing, so it holds no credit: acknowledged at once
    assert {e for e in link.events if e[0] == "abort_ack"} == {
        ("abort_ack", "a", "bad"),
        ("abort_ack", "b", "bad"),
    }


def test_a_receiver_that_never_acknowledges_keeps_the_abort_waiting() -> None:
    router, link, _ = setup(client_slots=2)
    start(router, "r")
    for _ in range(4):
        router.work(Stage.step)
    router.abort("r")
    for _ in range(50):  # the client never acks: nothing the router does makes one up
        router.work(Stage.step)
    assert ("abort_ack", "b", "r") not in link.events
    assert router.abort_waits == {("b", "r")}
