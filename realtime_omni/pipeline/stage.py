"""One stage's request bookkeeping: fan-in, buffering, finish and abort. No sockets, no threads.

The worker feeds it what arrives (`on_data`, `on_end`) with a `release` callback per payload that
acknowledges it upstream. A payload is released right after the executor call that consumed it,
or when the request is aborted; a request that is closed here (finished or aborted) has every
late payload released at once and dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from realtime_omni.errors import ExecutorError
from realtime_omni.pipeline.executor import Emit, Executor, Holds

Release = Callable[[], None]
Payload = dict[str, Any]
log = logging.getLogger(__name__)


@dataclass
class _Pending:
    once: dict[str, tuple[Payload, Release]] = field(default_factory=dict)
    items: list[tuple[str, Payload, Release]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)


class Stage:
    # Ids of closed requests remembered so late payloads are dropped; bounded, oldest forgotten
    # first (a payload that late finds no state and starts nothing it can finish).
    MAX_CLOSED = 8192
    # Requests waiting for their once-inputs, at most this many: a forged or stray message (a
    # StreamEnd for a request that never comes) would otherwise leave an entry for ever. The
    # oldest goes first, its payloads released; a real request is never that far behind.
    MAX_PENDING = 4096

    def __init__(self, name: str, executor: Executor, wait_for: tuple[str, ...]) -> None:
        self.name = name
        self.executor = executor
        self.wait_for = wait_for
        self.pending: dict[str, _Pending] = {}
        self.started: set[str] = set()
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.failures: list[tuple[str, str]] = []  # (request_id, message); the worker drains it
        self.stepping = False
        self._abort_after_step: set[str] = set()
        self.aborted_in_step: set[str] = set()  # aborted during the last step (see `end_step`)
        self.can_hold = isinstance(executor, Holds)
        self.held: set[str] = set()

    @property
    def active(self) -> int:
        return len(self.pending) + len(self.started)

    def holds(self, rid: str) -> bool:
        return rid in self.pending or rid in self.started

    def on_data(self, rid: str, src: str, payload: Payload, release: Release, once: bool) -> None:
        if rid in self.closed:
            release()
            return
        if rid in self.started:
            self._call(rid, self.executor.add_item, rid, src, payload)
            release()
            return
        p = self._pending(rid)
        if once and src not in p.once:
            p.once[src] = (payload, release)
        else:
            p.items.append((src, payload, release))
        self._maybe_start(rid)

    def on_end(self, rid: str, src: str) -> None:
        if rid in self.closed:
            return
        if rid in self.started:
            self._call(rid, self.executor.end_stream, rid, src)
            return
        self._pending(rid).ended.append(src)
        self._maybe_start(rid)

    def _pending(self, rid: str) -> _Pending:
        p = self.pending.get(rid)
        if p is None:
            while len(self.pending) >= self.MAX_PENDING:
                self.abort(next(iter(self.pending)))  # the oldest: releases what it held
            p = self.pending[rid] = _Pending()
        return p

    def _maybe_start(self, rid: str) -> None:
        p = self.pending[rid]
        if not all(w in p.once for w in self.wait_for):
            return
        del self.pending[rid]
        self.started.add(rid)
        first = {s: p.once.pop(s) for s in self.wait_for}
        ok = self._call(rid, self.executor.add_request, rid, {s: v[0] for s, v in first.items()})
        for _, rel in first.values():
            rel()
        # Once-inputs outside wait_for and items that came early follow in arrival order.
        later = [(s, pl, rel) for s, (pl, rel) in p.once.items()] + p.items
        for s, payload, rel in later:
            if ok and rid in self.started:
                ok = self._call(rid, self.executor.add_item, rid, s, payload)
            rel()
        for s in p.ended:
            if ok and rid in self.started:
                ok = self._call(rid, self.executor.end_stream, rid, s)

    def step(self) -> list[Emit]:
        """One executor step, all in the calling thread (see `begin_step` for the split form)."""
        self.begin_step()
        try:
            emits, error = self.executor.step(), None
        except Exception as e:
            emits, error = [], e
        return self.end_step(emits, error)

    def begin_step(self) -> None:
        """From here until `end_step`, another thread may abort requests: their executor state
        is dropped after the step, and what the step emits for them is discarded."""
        self.stepping = True

    def end_step(self, emits: list[Emit], error: Exception | None) -> list[Emit]:
        """Close the step: requests aborted during it leave the executor now (and stay named in
        `aborted_in_step` until the next step ends)."""
        self.stepping = False
        for rid in self._abort_after_step:
            self._executor_abort(rid)
        self.aborted_in_step = self._abort_after_step
        self._abort_after_step = set()
        if error is not None:
            if isinstance(error, ExecutorError):  # one request's: fail it if it still runs
                victims = [error.request_id] if error.request_id in self.started else []
            else:
                victims = sorted(self.started)
            _log(self.name, victims, error)
            for r in victims:
                self.fail(r, _describe(error))
            return []
        for e in emits:
            if e.error is not None and e.request_id in self.started:
                self.started.discard(e.request_id)  # the executor dropped it already
                self.failures.append((e.request_id, e.error))
                self.abort(e.request_id)
        return [e for e in emits if e.request_id not in self.closed]

    def set_held(self, rids: set[str]) -> None:
        """Hold exactly these requests in the executor (their outputs wait for credit)."""
        on, off = rids - self.held, self.held - rids
        if on or off:
            executor = self.executor
            if not isinstance(executor, Holds):
                raise TypeError(f"stage {self.name}: its executor has no `hold`")
            for rid in on:
                if rid in self.started:
                    executor.hold(rid, True)
            for rid in off:
                if rid in self.started:
                    executor.hold(rid, False)
        self.held = {r for r in rids if r in self.started}

    def finish(self, rid: str) -> None:
        """The executor emitted `done` for rid."""
        self.started.discard(rid)
        self._close(rid)

    def abort(self, rid: str) -> None:
        p = self.pending.pop(rid, None)
        if p is not None:
            for _, rel in p.once.values():
                rel()
            for _, _, rel in p.items:
                rel()
        self.held.discard(rid)
        if rid in self.started:
            self.started.discard(rid)
            if self.stepping:
                self._abort_after_step.add(rid)
            else:
                self._executor_abort(rid)
        self._close(rid)

    def _executor_abort(self, rid: str) -> None:
        try:
            self.executor.abort(rid)
        except Exception as e:
            _log(self.name, [rid], e)
            self.failures.append((rid, f"abort failed: {_describe(e)}"))

    def fail(self, rid: str, message: str) -> None:
        """The request failed here: drop it and report it (the coordinator then aborts it)."""
        self.failures.append((rid, message))
        self.abort(rid)

    def _call(self, rid: str, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:
            _log(self.name, [rid], e)
            self.fail(rid, _describe(e))
            return False

    def _close(self, rid: str) -> None:
        self.closed[rid] = None
        self.closed.move_to_end(rid)
        while len(self.closed) > self.MAX_CLOSED:
            self.closed.popitem(last=False)


def _describe(e: BaseException) -> str:
    """What the request's caller is told: the error's type and words, never where in the
    server's files it was raised (that goes to the stage's log, `_log`)."""
    return f"{type(e).__name__}: {e}"


def _log(stage: str, rids: list[str], e: BaseException) -> None:
    """An executor's own refusal (`ExecutorError`) in a line; anything else with its traceback."""
    trace = None if isinstance(e, ExecutorError) else e
    who = ", ".join(rids) or "no request"
    log.warning("stage %s: %s failed: %s", stage, who, _describe(e), exc_info=trace)
