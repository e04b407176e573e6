"""A config's stages in this process, stepped by hand: the graph's edges, the runtime's own
fan-in bookkeeping (`pipeline/stage.py`) and its router (`pipeline/router.py`, the one every
stage process routes with), without sockets, so a test decides exactly when each request
arrives and which requests share a step. Every edge between stages is by reference and no
credit runs out. The real stage processes are tested against the same oracle in
test_equivalence.py; this one makes batching deterministic to test."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.executor import Emit, StageContext, Wakes, load_executor
from realtime_omni.pipeline.graph import Edge, Graph
from realtime_omni.pipeline.messages import CLIENT, DataReady
from realtime_omni.pipeline.router import Route, Router, Unmetered
from realtime_omni.pipeline.stage import Payload, Stage

STEP_S = 0.01  # how far the clock moves per `step()`: about a tiny model's step on a CPU


class InProcess:
    """The stages' clocks (the thinker's decode pacing, code2wav's listeners) read a clock of
    this object's own, which moves `STEP_S` per step and, when no stage has work, to the
    earliest time a stage asked to be woken at: what runs in which step does not depend on how
    fast this machine steps."""

    def __init__(self, config: dict[str, Any], expect_failures: bool = False) -> None:
        """A request failing in a stage raises AssertionError, unless `expect_failures`: then
        it is aborted everywhere, as the coordinator does, and named in `failed` with why, and
        the step's outputs for the others go on."""
        self.now = 0.0
        self.expect_failures = expect_failures
        self.failed: dict[str, str] = {}
        cfg = parse_config(config)
        self.graph = Graph(cfg)
        self.stages: dict[str, Stage] = {}
        for name in cfg.stages:
            self.stages[name] = Stage(name, self._executor(name), self.graph.wait_for[name])
        self.outputs: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.open: dict[str, set[str]] = {}  # request -> terminal stages not yet done
        self.batches: dict[str, list[int]] = defaultdict(list)  # stage -> requests per step
        credits = {(e.src, e.dst): Unmetered() for e in self.graph.edges if e.src != CLIENT}
        self.router = Router(
            self.graph, self.stages, credits, self, local=lambda e: e.dst != CLIENT
        )

    def _executor(self, name: str) -> Any:
        cfg, st = self.graph.cfg, self.graph.cfg.stages[name]
        ctx = StageContext(
            stage=name,
            device=st.device,
            params=dict(st.params),
            model=dict(cfg.model),
            downstream=[e.dst for e in self.graph.out_edges[name]],
            upstream=[e.src for e in self.graph.in_edges[name]],
            max_batch=st.max_batch,
            max_prefill_tokens_per_step=st.max_prefill_tokens_per_step,
        )
        executor = load_executor(st.executor, ctx)
        if hasattr(executor, "clock"):
            executor.clock = lambda: self.now
        return executor

    def restart(self, name: str) -> None:
        """As a restarted stage process: a new executor, nothing of the old one kept."""
        self.stages[name].executor = self._executor(name)

    def submit(self, rid: str, payload: dict[str, Any]) -> None:
        self.open[rid] = set(self.graph.terminals)
        self.stages[self.graph.entry].on_data(rid, CLIENT, payload, lambda: None, once=True)

    def abort(self, rid: str) -> None:
        self.router.abort(rid)
        self.open.pop(rid, None)

    def step(self) -> None:
        """One step of every stage that has work, in the config's order; with none, the clock
        goes to the earliest time a stage waits for."""
        self.now += STEP_S
        idle = not any(self.router.deliverable(n) for n in self.stages)
        if idle and not any(stage.executor.has_work() for stage in self.stages.values()):
            waits = [
                w
                for stage in self.stages.values()
                if isinstance(stage.executor, Wakes) and (w := stage.executor.wake_in()) is not None
            ]
            if not waits and self.open:
                raise AssertionError(
                    f"stuck: no stage has work or waits for any, {sorted(self.open)}"
                )
            self.now += min(waits, default=0.0)
        self.router.work(self._step)

    def _step(self, stage: Stage) -> list[Emit]:
        emits = stage.step()
        if stage.failures and not self.expect_failures:
            raise AssertionError(f"{stage.name}: {stage.failures}")
        for rid, why in stage.failures:
            self.failed[rid] = why
            self.abort(rid)
        stage.failures.clear()
        self.batches[stage.name].append(len({e.request_id for e in emits}))
        return emits

    def run(self, limit: int = 10_000) -> None:
        """Step until every submitted request is done."""
        for _ in range(limit):
            if not self.open:
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps: {sorted(self.open)}")

    # ---- the router's link: only what reaches the client leaves ----------------------

    def send_data(
        self, edge: Edge, peer: str, request_id: str, lease: int, payload: Payload, route: Route
    ) -> None:
        self.outputs[request_id][edge.src].append(payload)

    def send_end(self, edge: Edge, peer: str, request_id: str, route: Route) -> None:
        pass

    def open_payload(self, msg: DataReady, frames: list[Any]) -> Payload:
        raise AssertionError("every payload here is by reference")

    def stage_done(self, stage: str, request_id: str) -> None:
        if stage in self.graph.terminals:
            self.open.get(request_id, set()).discard(stage)
            if not self.open.get(request_id, True):
                del self.open[request_id]

    def stage_error(self, stage: str, request_id: str, message: str) -> None:
        raise AssertionError(f"{stage}: {[(request_id, message)]}")

    def abort_acked(self, stage: str, request_id: str) -> None:
        pass
