"""What each request cost each stage: every step's seconds split among the requests it served.

A stage process charges the duration of every executor step to the requests the step worked
for (`charge`), in the shares the executor gives (`Executor.step_shares`, optional: e.g. a
batch's fixed cost split evenly and each request's own part its own; a prefill chunk that
emits nothing is still work) or, without them, evenly among the requests the step emitted
for. `take(stage, rid)` gives what a request has cost a stage so far and forgets it: the
worker sends it with the request's `StageDone` or `AbortAck`, so the caller's `RequestStream`
adds up what the request used (`compute_s`), an aborted one included. `busy_s` counts every
step's seconds per stage since start, attributed or not (`Stats.busy_s`). No sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping


class ComputeMeter:
    def __init__(self) -> None:
        # (stage, request) -> seconds charged and not yet taken. An entry lives from a request's
        # first step in a stage to its `StageDone` or `AbortAck` (or the `Spent` after a step it
        # was aborted in): at most the stage's started requests.
        self.spent: dict[tuple[str, str], float] = {}
        self.busy_s: dict[str, float] = {}

    def charge(self, stage: str, seconds: float, shares: Mapping[str, float]) -> None:
        """One step of `stage` took `seconds`; `shares` weighs the requests it served (any
        non-negative numbers: normalised here). With no weight at all, the step counts only
        as busy time."""
        self.busy_s[stage] = self.busy_s.get(stage, 0.0) + seconds
        total = sum(w for w in shares.values() if w > 0)
        if total <= 0:
            return
        for rid, w in shares.items():
            if w > 0:
                key = (stage, rid)
                self.spent[key] = self.spent.get(key, 0.0) + seconds * w / total

    def take(self, stage: str, rid: str) -> float:
        """Seconds `rid` cost `stage` since the last take; forgets them."""
        return self.spent.pop((stage, rid), 0.0)
