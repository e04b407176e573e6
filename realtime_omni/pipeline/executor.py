"""The contract between a stage and its model code.

An executor is the model call of one stage. It knows tensors, not sockets: the stage loop hands
it inputs and asks it to step; whatever it returns as `Emit`s the loop routes downstream. Every
call is made from the stage's single loop thread, so an executor needs no locks.

Lifecycle of a request in one stage:
    add_request(rid, inputs)         once, when the inputs named by `wait_for` arrived
    add_item(rid, src, item)         for each item streamed in (only after add_request)
    end_stream(rid, src)             when a streaming source is done
    step() -> [Emit, ...]            called while has_work(); one step for the active requests
    abort(rid)                       at any time: drop everything held for rid

Arrays in `inputs` and `item` are read-only views valid only during the call: copy what you keep.
An `Emit`'s data may hold numpy arrays, CUDA tensors (moved GPU to GPU on `cuda_ipc` edges) and
CPU torch tensors; across processes, a CPU tensor arrives as a numpy array (`pipeline/relay.py`).
Emitted arrays are handed over, not copied at once: a stage in the same process gets the very
objects, and a payload waiting for credit is read when it is sent. Do not write into an array or
tensor after emitting it; emit a fresh one (or a copy) instead of reusing a buffer.
An `Emit` with `done=True` is the request's last here: its streams close and its state is gone.
An `Emit` with `error` fails that request alone (the executor has dropped it already), beside
the other requests' outputs of the same step: the way to refuse one request mid-step (its KV
blocks, its prefill chunk raising). Raising from `step` fails the `ExecutorError`'s request, or,
for any other exception, every request the stage holds.

Optional: `hold(rid, held)`. While a request is held (its outputs wait for credit downstream,
e.g. a listener who is far behind), `has_work` and `step` must ignore it; the runtime lifts the
hold when its outputs flow again. An executor without `hold` makes the stage stop stepping
altogether while any of its requests waits, so one slow request stalls the others there.

Optional: `wake_in() -> float | None`. An executor whose `has_work` can turn true with no call
in between (a paced step falling due, a listener's lead running out) says in how many seconds;
the idle loop waits no longer than that for a message. A time already past is 0, not None: the
loop asks `has_work` and then `wake_in`, and the moment can fall between the two calls (None
would leave the loop waiting for the next message or heartbeat).

Optional: `step_shares() -> {request_id: weight}`. How the last step's work divides among the
requests it served (any non-negative weights, e.g. tokens computed for each; none: the step
computed nothing for anyone), so each request is charged its part of the step's time
(`pipeline/meter.py`). Without it a step is split evenly among the requests it emitted for, and
a step that emitted nothing (a prefill chunk mid-prompt) is charged to nobody.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from realtime_omni.errors import ConfigError

if TYPE_CHECKING:
    from realtime_omni.pipeline.config import PipelineConfig

Payload = dict[str, Any]


@dataclass
class Emit:
    request_id: str
    data: Payload | None = None  # None: nothing to send (e.g. only `done`)
    to: str | None = None  # a downstream stage (or "client"); None: every downstream edge
    done: bool = False
    error: str | None = None  # the request failed here, and why (the executor dropped it)


@dataclass
class StageContext:
    """What an executor learns of its place in the graph."""

    stage: str
    device: str
    params: dict[str, Any]
    model: dict[str, Any]  # the config's model section
    downstream: list[str] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    max_batch: int = 32  # requests one step serves together at most (the stage's `max_batch`)
    max_prefill_tokens_per_step: int = 512  # prompt tokens one step prefills at most
    # The whole config, for an executor that sizes what it holds with the stages beside it (a
    # KV pool sharing its GPU: `cache.pool_blocks`); None where an executor runs on its own.
    pipeline: PipelineConfig | None = None
    # A folder private to this run of the pipeline on this host (the ipc folder), for what its
    # stage processes share (a simulated GPU's time: `pipeline/sim_device.py`); None in-process.
    run_dir: str | None = None


class Executor(Protocol):
    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None: ...

    def add_item(self, request_id: str, src: str, item: Payload) -> None: ...

    def end_stream(self, request_id: str, src: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Emit]: ...

    def abort(self, request_id: str) -> None: ...


@runtime_checkable
class Holds(Protocol):
    """An executor that can hold one request while the others go on (optional: see above)."""

    def hold(self, request_id: str, held: bool) -> None: ...


@runtime_checkable
class Wakes(Protocol):
    """An executor whose `has_work` can turn true of itself (optional: see above)."""

    def wake_in(self) -> float | None: ...


@runtime_checkable
class Shares(Protocol):
    """An executor that says how its last step divides among requests (optional: see above)."""

    def step_shares(self) -> dict[str, float]: ...


@runtime_checkable
class ReportsKv(Protocol):
    """An executor that keeps a KV pool and says how full: blocks in use, blocks, kept sessions
    evicted, requests preempted (each since it started)."""

    def kv_stats(self) -> tuple[int, int, int, int]: ...


class HoldsRequests:
    """`hold` for an executor that keeps its requests in `self.reqs`: iterate `self.running()`
    in `has_work` and `step`, and held requests are left alone."""

    reqs: dict[str, Any]

    def hold(self, request_id: str, held: bool) -> None:
        holding: set[str] = self.__dict__.setdefault("_held", set())
        if held:
            holding.add(request_id)
        else:
            holding.discard(request_id)

    def running(self) -> dict[str, Any]:
        holding = self.__dict__.get("_held")
        if not holding:
            return self.reqs
        holding.intersection_update(self.reqs)  # forget finished and aborted requests
        return {rid: r for rid, r in self.reqs.items() if rid not in holding}


EXECUTORS: dict[str, str] = {
    "simulated": "realtime_omni.pipeline.simulated:SimulatedExecutor",
}


def load_executor(spec: str, ctx: StageContext) -> Executor:
    target = EXECUTORS.get(spec, spec)
    if ":" not in target:
        raise ConfigError(
            f"stages.{ctx.stage}.executor = {spec!r}: unknown executor. "
            f"Fix: use one of {sorted(EXECUTORS)} or 'package.module:Class'"
        )
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"stages.{ctx.stage}.executor = {spec!r}: cannot import {target}: {e}"
        ) from None
    return cls(ctx)
