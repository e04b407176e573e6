"""Executors for integration tests (imported by the stage processes by module path)."""

from __future__ import annotations

import time
from typing import Any

from realtime_omni.errors import ExecutorError
from realtime_omni.pipeline.executor import Emit, StageContext
from realtime_omni.pipeline.simulated import SimulatedExecutor


class FlakyExecutor(SimulatedExecutor):
    """A simulated stage that fails the requests whose input says `fail_at` == this stage."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.doomed: set[str] = set()

    def add_request(self, request_id: str, inputs: dict[str, dict[str, Any]]) -> None:
        super().add_request(request_id, inputs)
        if self.reqs[request_id].meta.get("fail_at") == self.stage:
            self.doomed.add(request_id)

    def step(self) -> list[Emit]:
        for rid in self.doomed:
            if rid in self.reqs:
                self.doomed.discard(rid)
                raise ExecutorError(rid, f"{rid} asked to fail here")
        return super().step()


class BrokenExecutor:
    """Fails while loading, as a missing checkpoint would."""

    def __init__(self, ctx: StageContext) -> None:
        raise FileNotFoundError(f"no weights for {ctx.stage} in /nonexistent")


class ScalarMetaExecutor(SimulatedExecutor):
    """A simulated stage whose outputs carry a numpy scalar in their metadata (which msgpack
    cannot encode) for requests that ask for `bad_meta`."""

    def _emits(self, rid: str, meta: dict[str, Any], n: int) -> list[Emit]:
        emits = super()._emits(rid, meta, n)
        if rid in self.reqs and self.reqs[rid].meta.get("bad_meta"):
            import numpy as np

            for e in emits:
                if e.data is not None:
                    e.data["score"] = np.float32(0.5)
        return emits


class LaterExecutor(SimulatedExecutor):
    """A simulated stage whose requests have work only `params.after_s` after they arrive: no
    message wakes the loop then, the executor says when (`wake_in`)."""

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.after_s = float(ctx.params.get("after_s", 0.5))
        self.arrived: dict[str, float] = {}

    def add_request(self, request_id: str, inputs: dict[str, dict[str, Any]]) -> None:
        super().add_request(request_id, inputs)
        self.arrived[request_id] = time.monotonic()

    def _due_in(self) -> list[float]:
        """Seconds until each request has work: 0 or less once it has."""
        now = time.monotonic()
        return [self.arrived[rid] + self.after_s - now for rid in self.reqs]

    def has_work(self) -> bool:
        return all(t <= 0 for t in self._due_in()) and super().has_work()

    def wake_in(self) -> float | None:
        # A request that fell due after `has_work` said no is 0, not None.
        due = self._due_in()
        return max(0.0, min(due)) if due else None

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.arrived.pop(request_id, None)


class SpinExecutor(SimulatedExecutor):
    """A simulated stage that, after each step's sleep, spins until the step has used
    `SPIN_CPU_S` of CPU time: CPU time, not wall time, so what a step burns does not depend on
    how many other processes share the cores (a spin for a wall time got a third of it on a
    loaded machine)."""

    SPIN_CPU_S = 0.004

    def step(self) -> list[Emit]:
        t = time.thread_time()
        emits = super().step()
        while time.thread_time() - t < self.SPIN_CPU_S:
            pass
        return emits
