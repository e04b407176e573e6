"""Stage bookkeeping with a fake executor: fan-in, buffering, release, abort, failures."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from realtime_omni.errors import ExecutorError
from realtime_omni.pipeline.executor import Emit, HoldsRequests
from realtime_omni.pipeline.stage import Stage


class Boom(Exception):
    pass


class FakeExecutor:
    """Records every call in `log` (shared with the releases); raises where told to."""

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.active: list[str] = []
        self.fail: dict[str, BaseException] = {}  # method name -> exception to raise
        self.fail_rid: str | None = None  # raise only for this request, if set

    def _enter(self, name: str, rid: str | None, *rest: Any) -> None:
        self.log.append((name, rid, *rest))
        exc = self.fail.get(name)
        if exc is not None and (self.fail_rid is None or rid == self.fail_rid):
            raise exc

    def add_request(self, request_id: str, inputs: dict[str, Any]) -> None:
        self._enter("add_request", request_id, inputs)
        self.active.append(request_id)

    def add_item(self, request_id: str, src: str, item: dict[str, Any]) -> None:
        self._enter("add_item", request_id, src, item)

    def end_stream(self, request_id: str, src: str) -> None:
        self._enter("end_stream", request_id, src)

    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[Emit]:
        self._enter("step", None)
        return [Emit(rid, {"step": True}) for rid in self.active]

    def abort(self, request_id: str) -> None:
        if request_id in self.active:
            self.active.remove(request_id)
        self._enter("abort", request_id)


class Releases:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.count: Counter[str] = Counter()

    def __call__(self, tag: str):  # type: ignore[no-untyped-def]
        def release() -> None:
            self.count[tag] += 1
            self.log.append(("release", tag))

        return release

    def assert_each_once(self, *tags: str) -> None:
        assert {t: self.count[t] for t in tags} == dict.fromkeys(tags, 1)
        assert set(self.count) == set(tags)


@pytest.fixture
def log() -> list[tuple[Any, ...]]:
    return []


@pytest.fixture
def ex(log: list[tuple[Any, ...]]) -> FakeExecutor:
    return FakeExecutor(log)


@pytest.fixture
def rel(log: list[tuple[Any, ...]]) -> Releases:
    return Releases(log)


def calls(log: list[tuple[Any, ...]], *names: str) -> list[tuple[Any, ...]]:
    return [c for c in log if c[0] in names]


def start(stage: Stage, rel: Releases, rid: str = "r1", src: str = "a") -> None:
    stage.on_data(rid, src, {"x": rid}, rel(f"{rid}-start"), once=True)


def test_fan_in_waits_for_every_source(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a", "b"))
    stage.on_data("r1", "a", {"from": "a"}, rel("a"), once=True)
    assert calls(log, "add_request") == []
    assert rel.count == {}  # held until the request starts
    assert stage.holds("r1") and stage.active == 1
    stage.on_data("r1", "b", {"from": "b"}, rel("b"), once=True)
    assert log[0] == ("add_request", "r1", {"a": {"from": "a"}, "b": {"from": "b"}})
    assert log[1:] == [("release", "a"), ("release", "b")]  # released after the call
    assert stage.started == {"r1"} and stage.pending == {}


def test_fan_in_is_per_request(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a", "b"))
    stage.on_data("r1", "a", {}, rel("1a"), once=True)
    stage.on_data("r2", "b", {}, rel("2b"), once=True)
    assert calls(log, "add_request") == []
    stage.on_data("r2", "a", {}, rel("2a"), once=True)
    assert [c[1] for c in calls(log, "add_request")] == ["r2"]
    assert stage.pending.keys() == {"r1"}


def test_early_stream_items_are_buffered_in_order(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    for i in range(3):
        stage.on_data("r1", "s", {"i": i}, rel(f"item{i}"), once=False)
    stage.on_end("r1", "s")
    assert [c for c in log if c[0] != "release"] == []
    start(stage, rel)
    assert log == [
        ("add_request", "r1", {"a": {"x": "r1"}}),
        ("release", "r1-start"),
        ("add_item", "r1", "s", {"i": 0}),
        ("release", "item0"),
        ("add_item", "r1", "s", {"i": 1}),
        ("release", "item1"),
        ("add_item", "r1", "s", {"i": 2}),
        ("release", "item2"),
        ("end_stream", "r1", "s"),
    ]


def test_once_input_outside_wait_for_follows_as_an_item(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    stage.on_data("r1", "extra", {"e": 1}, rel("extra"), once=True)
    start(stage, rel)
    assert calls(log, "add_request", "add_item") == [
        ("add_request", "r1", {"a": {"x": "r1"}}),
        ("add_item", "r1", "extra", {"e": 1}),
    ]
    rel.assert_each_once("extra", "r1-start")


def test_items_after_start_go_straight_to_the_executor(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel)
    log.clear()
    stage.on_data("r1", "s", {"i": 9}, rel("late-item"), once=False)
    stage.on_end("r1", "s")
    assert log == [
        ("add_item", "r1", "s", {"i": 9}),
        ("release", "late-item"),
        ("end_stream", "r1", "s"),
    ]


def test_empty_wait_for_starts_on_the_first_payload(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ())
    stage.on_data("r1", "s", {"i": 0}, rel("i0"), once=False)
    assert calls(log, "add_request", "add_item") == [
        ("add_request", "r1", {}),
        ("add_item", "r1", "s", {"i": 0}),
    ]
    rel.assert_each_once("i0")


def test_step_returns_the_executors_emits(ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel, "r1")
    start(stage, rel, "r2")
    assert [e.request_id for e in stage.step()] == ["r1", "r2"]
    stage.finish("r1")
    assert stage.started == {"r2"}
    assert not stage.holds("r1")


def test_abort_pending_releases_everything(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a", "b"))
    stage.on_data("r1", "a", {}, rel("a"), once=True)
    stage.on_data("r1", "s", {}, rel("item"), once=False)
    stage.on_end("r1", "s")
    stage.abort("r1")
    rel.assert_each_once("a", "item")
    assert calls(log, "add_request", "add_item", "end_stream") == []
    assert not stage.holds("r1") and stage.active == 0
    assert stage.failures == []


def test_abort_started_releases_and_calls_executor_abort(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel)
    stage.abort("r1")
    assert calls(log, "abort") == [("abort", "r1")]
    rel.assert_each_once("r1-start")
    assert not stage.holds("r1") and ex.active == []
    stage.abort("r1")  # twice is harmless
    assert calls(log, "abort") == [("abort", "r1")]


@pytest.mark.parametrize("close", ["finish", "abort"])
def test_late_data_is_released_and_dropped(
    log: list, ex: FakeExecutor, rel: Releases, close: str
) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel)
    getattr(stage, close)("r1")
    log.clear()
    stage.on_data("r1", "s", {"late": 1}, rel("late-item"), once=False)
    stage.on_data("r1", "a", {"late": 2}, rel("late-once"), once=True)
    stage.on_end("r1", "s")
    assert log == [("release", "late-item"), ("release", "late-once")]
    assert not stage.holds("r1") and stage.pending == {}


def test_closed_requests_are_bounded(ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a",))
    stage.MAX_CLOSED = 2
    for rid in ("r1", "r2", "r3"):
        stage.abort(rid)
    assert list(stage.closed) == ["r2", "r3"]


def test_add_item_error_fails_only_that_request(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel, "r1")
    start(stage, rel, "r2")
    ex.fail["add_item"], ex.fail_rid = Boom("bad item"), "r1"
    stage.on_data("r1", "s", {}, rel("bad"), once=False)
    stage.on_data("r2", "s", {}, rel("good"), once=False)
    assert len(stage.failures) == 1
    rid, message = stage.failures[0]
    assert rid == "r1"
    assert message == "Boom: bad item"  # where it was raised goes to the log alone
    assert calls(log, "abort") == [("abort", "r1")]
    assert stage.started == {"r2"}
    rel.assert_each_once("r1-start", "r2-start", "bad", "good")
    stage.on_data("r1", "s", {}, rel("after"), once=False)  # closed now: dropped
    assert rel.count["after"] == 1
    assert len(calls(log, "add_item")) == 2


def test_add_request_error_releases_the_buffered_payloads(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    stage.on_data("r1", "s", {}, rel("item0"), once=False)
    stage.on_data("r1", "s", {}, rel("item1"), once=False)
    stage.on_end("r1", "s")
    ex.fail["add_request"] = Boom("bad request")
    start(stage, rel)
    assert [r for r, _ in stage.failures] == ["r1"]
    assert "Boom: bad request" in stage.failures[0][1]
    assert calls(log, "add_item", "end_stream") == []  # nothing more after the failure
    assert calls(log, "abort") == [("abort", "r1")]
    rel.assert_each_once("r1-start", "item0", "item1")
    assert not stage.holds("r1")


def test_error_in_a_buffered_item_stops_the_rest(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    for i in range(3):
        stage.on_data("r1", "s", {"i": i}, rel(f"item{i}"), once=False)
    ex.fail["add_item"] = Boom("second")
    start(stage, rel)
    assert len(calls(log, "add_item")) == 1
    assert [r for r, _ in stage.failures] == ["r1"]
    rel.assert_each_once("r1-start", "item0", "item1", "item2")


def test_end_stream_error_fails_the_request(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel)
    ex.fail["end_stream"] = Boom("end")
    stage.on_end("r1", "s")
    assert [r for r, _ in stage.failures] == ["r1"]
    assert not stage.holds("r1")


def test_step_error_without_request_id_fails_every_started_request(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a", "b"))
    start(stage, rel, "r1")
    stage.on_data("r1", "b", {}, rel("r1-b"), once=True)
    start(stage, rel, "r2")
    stage.on_data("r2", "b", {}, rel("r2-b"), once=True)
    stage.on_data("r3", "a", {}, rel("r3-a"), once=True)  # pending: not hit by the step
    ex.fail["step"] = Boom("engine")
    assert stage.step() == []
    assert sorted(r for r, _ in stage.failures) == ["r1", "r2"]
    assert all("Boom: engine" in msg for _, msg in stage.failures)
    assert sorted(c[1] for c in calls(log, "abort")) == ["r1", "r2"]
    assert stage.started == set() and stage.pending.keys() == {"r3"}


def test_a_failure_tells_the_caller_what_went_wrong_and_the_log_where(
    ex: FakeExecutor, rel: Releases, caplog: pytest.LogCaptureFixture
) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel, "r1")
    ex.fail["step"] = Boom("engine")
    with caplog.at_level("WARNING"):
        stage.step()
    assert stage.failures == [("r1", "Boom: engine")]  # no path or line of the server's files
    assert "test_stage.py" in caplog.text and "Traceback" in caplog.text


def test_step_error_with_request_id_fails_only_that_request(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel, "r1")
    start(stage, rel, "r2")
    ex.fail["step"] = ExecutorError("r2", "bad token")
    assert stage.step() == []
    assert [r for r, _ in stage.failures] == ["r2"]
    assert "ExecutorError: bad token" in stage.failures[0][1]
    assert stage.started == {"r1"}
    assert calls(log, "abort") == [("abort", "r2")]
    del ex.fail["step"]
    assert [e.request_id for e in stage.step()] == ["r1"]


def test_step_error_naming_a_request_no_longer_running_fails_nobody(
    ex: FakeExecutor, rel: Releases
) -> None:
    """A request's error raised after it was aborted (a barge-in while the KV pool is full)
    is its own: the requests still running go on."""
    stage = Stage("c", ex, ("a",))
    start(stage, rel, "r1")
    start(stage, rel, "r2")
    stage.abort("r2")
    ex.fail["step"] = ExecutorError("r2", "stale")
    assert stage.step() == []
    assert stage.failures == [] and stage.started == {"r1"}


def test_an_error_emit_fails_its_request_beside_the_others_outputs(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a",))
    for rid in ("r1", "r2", "r3"):
        start(stage, rel, rid)
    stage.abort("r3")  # aborted already: its late error is dropped

    def step() -> list[Emit]:
        return [Emit("r1", {"t": 1}), Emit("r2", error="no blocks"), Emit("r3", error="late")]

    ex.step = step  # type: ignore[method-assign]
    assert [(e.request_id, e.data) for e in stage.step()] == [("r1", {"t": 1})]
    assert stage.failures == [("r2", "no blocks")]
    assert stage.started == {"r1"} and "r2" in stage.closed
    assert calls(log, "abort") == [("abort", "r3")]  # the executor dropped r2 itself


def test_executor_abort_error_is_reported(log: list, ex: FakeExecutor, rel: Releases) -> None:
    stage = Stage("c", ex, ("a",))
    start(stage, rel)
    ex.fail["abort"] = Boom("stuck")
    stage.abort("r1")
    assert len(stage.failures) == 1
    assert stage.failures[0][0] == "r1"
    assert stage.failures[0][1].startswith("abort failed: Boom: stuck")
    assert not stage.holds("r1")


def test_a_repeated_once_payload_before_start_is_still_released(
    log: list, ex: FakeExecutor, rel: Releases
) -> None:
    stage = Stage("c", ex, ("a", "b"))
    stage.on_data("r1", "a", {"n": 1}, rel("a1"), once=True)
    stage.on_data("r1", "a", {"n": 2}, rel("a2"), once=True)  # an executor emitting twice
    stage.on_data("r1", "b", {}, rel("b"), once=True)
    rel.assert_each_once("a1", "a2", "b")


class HoldingExecutor(HoldsRequests):
    """Works on every request it has and is not holding; records who each step served."""

    def __init__(self) -> None:
        self.reqs: dict[str, int] = {}
        self.served: list[list[str]] = []
        self.aborted: list[str] = []

    def add_request(self, request_id: str, inputs: dict[str, Any]) -> None:
        self.reqs[request_id] = 0

    def add_item(self, request_id: str, src: str, item: dict[str, Any]) -> None:
        pass

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.running())

    def step(self) -> list[Emit]:
        self.served.append(sorted(self.running()))
        return [Emit(rid, {"n": 1}) for rid in self.running()]

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
        self.aborted.append(request_id)


def test_held_requests_are_left_alone_until_released() -> None:
    ex = HoldingExecutor()
    stage = Stage("s", ex, ())
    assert stage.can_hold and not Stage("t", FakeExecutor([]), ()).can_hold
    for rid in ("a", "b"):
        stage.on_data(rid, "up", {}, lambda: None, once=True)
    stage.set_held({"a", "unknown"})  # only started requests can be held
    assert stage.held == {"a"}
    assert [e.request_id for e in stage.step()] == ["b"]
    stage.set_held({"a", "b"})
    assert not ex.has_work()
    stage.set_held(set())
    assert [e.request_id for e in stage.step()] == ["a", "b"]
    assert ex.served == [["b"], ["a", "b"]]


def test_aborting_a_held_request_forgets_the_hold() -> None:
    ex = HoldingExecutor()
    stage = Stage("s", ex, ())
    stage.on_data("a", "up", {}, lambda: None, once=True)
    stage.set_held({"a"})
    stage.abort("a")
    assert stage.held == set() and ex.aborted == ["a"]
    assert ex.running() == {}  # the executor's hold went with the request


def test_an_abort_during_a_step_waits_for_the_step_and_drops_its_outputs() -> None:
    ex = HoldingExecutor()
    stage = Stage("s", ex, ())
    for rid in ("a", "b"):
        stage.on_data(rid, "up", {}, lambda: None, once=True)
    stage.begin_step()
    emits = ex.step()  # the model call, while another thread aborts `a`
    stage.abort("a")
    assert ex.aborted == []  # not during the step
    out = stage.end_step(emits, None)
    assert ex.aborted == ["a"]
    assert [e.request_id for e in out] == ["b"]


def test_stray_stream_ends_and_payloads_cannot_grow_the_pending_table(
    log: list, ex: FakeExecutor, rel: Releases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged StreamEnd (or a payload) for a request whose once-inputs never come left an
    entry for ever; past MAX_PENDING the oldest goes, what it held released."""
    monkeypatch.setattr(Stage, "MAX_PENDING", 8)
    stage = Stage("c", ex, ("a",))
    stage.on_data("held", "b", {}, rel("held"), once=False)  # an early item, waiting
    for i in range(100):
        stage.on_end(f"forged{i}", "b")
    assert len(stage.pending) == 8 and "held" not in stage.pending
    assert rel.count["held"] == 1  # its payload's credit went back
    start(stage, rel, "real")  # a real request still starts
    assert [c[1] for c in calls(log, "add_request")] == ["real"]
