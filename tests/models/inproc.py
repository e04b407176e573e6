"""A config's stages in this process, stepped by hand: the graph's edges and the runtime's own
fan-in bookkeeping (`pipeline/stage.py`), without sockets, so a test decides exactly when each
request arrives and which requests share a step. The real stage processes are tested against
the same oracle in test_equivalence.py; this one makes batching deterministic to test."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.executor import Emit, StageContext, load_executor
from realtime_omni.pipeline.graph import Graph
from realtime_omni.pipeline.messages import CLIENT
from realtime_omni.pipeline.stage import Stage

STEP_S = 0.01  # how far the clock moves per `step()`: about a tiny model's step on a CPU


class InProcess:
    """The stages' clocks (the thinker's decode pacing, code2wav's listeners) read a clock of
    this object's own, which moves `STEP_S` per step and, when no stage has work, to the
    earliest time a stage asked to be woken at: what runs in which step does not depend on how
    fast this machine steps."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.now = 0.0
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
        for stage in self.stages.values():
            stage.abort(rid)
        self.open.pop(rid, None)

    def step(self) -> None:
        """One step of every stage that has work, in the config's order; with none, the clock
        goes to the earliest time a stage waits for."""
        self.now += STEP_S
        if not any(stage.executor.has_work() for stage in self.stages.values()):
            waits = [
                getattr(stage.executor, "wake_in", lambda: None)() for stage in self.stages.values()
            ]
            waits = [w for w in waits if w is not None]
            if not waits and self.open:
                raise AssertionError(
                    f"stuck: no stage has work or waits for any, {sorted(self.open)}"
                )
            self.now += min(waits, default=0.0)
        for name, stage in self.stages.items():
            if not stage.executor.has_work():
                continue
            emits = stage.step()
            if stage.failures:
                raise AssertionError(f"{name}: {stage.failures}")
            self.batches[name].append(len({e.request_id for e in emits}))
            for e in emits:
                self._route(name, e)

    def run(self, limit: int = 10_000) -> None:
        """Step until every submitted request is done."""
        for _ in range(limit):
            if not self.open:
                return
            self.step()
        raise AssertionError(f"not done after {limit} steps: {sorted(self.open)}")

    def _route(self, src: str, e: Emit) -> None:
        edges = self.graph.out_edges[src]
        if e.data is not None:
            for edge in edges:
                if e.to not in (None, edge.dst):
                    continue
                if edge.dst == CLIENT:
                    self.outputs[e.request_id][src].append(e.data)
                else:
                    once = edge.kind == "once"
                    self.stages[edge.dst].on_data(e.request_id, src, e.data, lambda: None, once)
        if e.done:
            self.stages[src].finish(e.request_id)
            for edge in edges:
                if edge.dst == CLIENT:
                    self.open.get(e.request_id, set()).discard(src)
                    if not self.open.get(e.request_id, True):
                        del self.open[e.request_id]
                elif edge.kind == "stream":
                    self.stages[edge.dst].on_end(e.request_id, src)
