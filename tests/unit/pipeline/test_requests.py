"""The coordinator's request table with no sockets: replica routes and session affinity, a
request's completion, and abort bookkeeping through acks and deaths."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.graph import Graph
from realtime_omni.pipeline.requests import RequestTable


def table() -> tuple[RequestTable, list[int]]:
    """Entry `a` (one process) streams to `b` (two replicas, terminal)."""
    cfg = parse_config(
        {
            "name": "t",
            "entry": "a",
            "stages": {
                "a": {"executor": "simulated", "stream_to": ["b"]},
                "b": {"executor": "simulated", "terminal": True, "replicas": 2},
            },
        }
    )
    forgotten: list[int] = []
    return RequestTable(Graph(cfg), lambda: forgotten.append(1)), forgotten


EPOCHS = {"a#0": 0, "b#0": 0, "b#1": 0}


def test_a_request_goes_to_the_least_busy_replica_that_is_up() -> None:
    t, _ = table()
    first = t.pick_route(None, set(), EPOCHS)
    t.add("r1", first)
    second = t.pick_route(None, set(), EPOCHS)
    assert {first["b"], second["b"]} == {0, 1}
    assert t.pick_route(None, {"b#0"}, EPOCHS) == {"b": 1}  # b#0 is down: passed over
    assert t.processes({"b": 1}) == ["a#0", "b#1"]


def test_a_sessions_turns_stay_on_its_replica_while_it_is_the_same_incarnation() -> None:
    t, _ = table()
    route = t.pick_route("s", set(), EPOCHS)
    for i in range(3):  # make its replica the busier one
        t.add(f"busy{i}", route)
    assert t.pick_route("s", set(), EPOCHS) == route
    restarted = {**EPOCHS, f"b#{route['b']}": 1}  # its KV cache is gone with the old one
    assert t.pick_route("s", set(), restarted) != route


def test_a_request_leaves_once_every_terminal_stream_ended_and_every_stage_is_done() -> None:
    async def body() -> None:
        t, forgotten = table()
        req = t.add("r", {"b": 0})
        t.stream_ended("r", "b")
        assert req.stream.closed and "r" in t  # `a` has not said it is done
        t.stage_done("r", "a")
        t.stage_done("r", "b")
        assert "r" not in t and forgotten == [1]
        assert t.active == {"a#0": 0, "b#0": 0}
        assert await req.stream.collect() == {}

    asyncio.run(body())


def test_an_abort_waits_for_every_live_stage_and_a_death_stands_in_for_its_acks() -> None:
    async def body() -> Any:
        t, forgotten = table()
        req = t.add("r", {"b": 1})
        assert t.begin_abort(req, down={"a#0"}) == ["b#1"]  # nothing to tell a dead process
        assert req.abort_waiting == {"b"}
        t.abort_acked("r", "b")
        assert req.abort_done is not None and req.abort_done.done() and "r" not in t

        other = t.add("o", {"b": 0})
        t.begin_abort(other, down=set())
        assert other.abort_waiting == {"a", "b"}
        t.abort_acked("o", "a")
        assert t.died("b#1") == []  # on the other replica: b#0 still owes its ack
        assert t.died("b#0") == [] and "o" not in t  # the dead one's ack is not awaited
        return forgotten

    assert asyncio.run(body()) == [1, 1]


def test_a_death_fails_the_requests_that_still_need_the_dead_stage() -> None:
    t, _ = table()
    on_dead, elsewhere, finished_there = (
        t.add(r, {"b": i}) for r, i in (("x", 0), ("y", 1), ("z", 0))
    )
    t.stage_done("z", "b")
    assert t.died("b#0") == [on_dead]
    assert elsewhere.rid in t and finished_there.rid in t


def test_a_streams_compute_adds_up_what_each_stage_reported() -> None:
    async def body() -> None:
        t, _ = table()
        req = t.add("r", {"b": 0})
        t.stream_ended("r", "b")
        t.stage_done("r", "b", 0.25)
        assert not req.stream.settled.is_set()  # `a` has not reported
        t.stage_done("r", "a", 0.5)
        assert req.stream.settled.is_set() and req.stream.compute_s == {"a": 0.5, "b": 0.25}

        aborted = t.add("x", {"b": 1})
        t.begin_abort(aborted, down=set())
        t.abort_acked("x", "a", 0.1)
        t.abort_acked("x", "b")  # b never stepped it
        assert aborted.stream.settled.is_set() and "x" not in t
        t.spent("x", "a", 0.2)  # a step that was running when the abort came
        assert aborted.stream.compute_s == {"a": pytest.approx(0.3)}

    asyncio.run(body())
