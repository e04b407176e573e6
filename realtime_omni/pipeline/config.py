"""The pipeline config: parsed and validated here, and nowhere else.

A config declares stages and their edges; the runtime knows nothing of any model. Load it with
`load_config(path)` or `parse_config(dict)`; every problem raises `ConfigError` naming the field,
the value and the fix. `realtime_omni.pipeline.graph.Graph` derives the edges and placement.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from realtime_omni.errors import ConfigError

Transport = Literal["auto", "reference", "inline", "shm", "cuda_ipc", "tcp", "mooncake"]
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# Top-level sections of a config file that belong to the gateway (`gateway/config.py` parses
# them); the pipeline's parser leaves them out.
GATEWAY_SECTIONS = ("phone", "sip", "realtime")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StageConfig(_Strict):
    executor: str = Field(
        description="Executor class: a short name registered in "
        "`realtime_omni.pipeline.executor.EXECUTORS` or `package.module:Class`."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Passed to the executor.")
    next: list[str] = Field(
        default_factory=list, description="Stages that get this stage's output once per request."
    )
    stream_to: list[str] = Field(
        default_factory=list, description="Stages that get every item this stage streams."
    )
    wait_for: list[str] | None = Field(
        default=None,
        description="Upstream stages whose once-output must all arrive before the request "
        "starts here. Default: every stage that lists this one in `next`.",
    )
    terminal: bool = Field(default=False, description="Outputs go back to the caller.")
    process: str | None = Field(
        default=None,
        description="Stages naming the same process share it and hand over by reference. "
        "Default: a process of their own, named after the stage.",
    )
    device: str = Field(default="cpu", description="cpu or cuda:N")
    host: str | None = Field(
        default=None, description="A key of `hosts`; null runs the stage on this machine."
    )
    replicas: int = Field(default=1, ge=1, le=64, description="Processes serving this stage.")
    replica_hosts: list[str | None] | None = Field(
        default=None,
        description="Per replica, the key of `hosts` it runs on (null: this machine), for "
        "replicas on several machines; overrides `host`. Edges of such a stage go over TCP. "
        "Ray placement sets it for the replicas it spreads.",
    )
    resources: dict[str, float] | None = Field(
        default=None,
        description="With `runtime.placement: ray`: what one process of this stage reserves "
        "({'GPU': 1}, {'CPU': 2}, a custom resource); default a GPU per CUDA device its process "
        "group names, else one CPU.",
    )
    threads: int = Field(default=1, ge=1, le=256, description="torch/BLAS threads per process.")
    max_batch: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="Requests one step of this stage serves together (one forward for all "
        "decoding requests). 1 serves one request per forward: the unbatched baseline. Streaming "
        "edges that are not set explicitly get credits for this many requests in flight, and "
        "one set below it is refused.",
    )
    max_prefill_tokens_per_step: int = Field(
        default=512,
        ge=1,
        description="Prompt tokens a step prefills besides its decode rows. A longer prompt is "
        "prefilled in chunks over several steps, so a new request delays the running ones' next "
        "token by at most one chunk's compute (a Qwen3-Omni thinker: ~25 ms per 512 tokens on "
        "an H200). Used by the thinker and the talker (and the simulated generate role).",
    )


class EdgeConfig(_Strict):
    """Overrides for one edge `src -> dst` (`client` names the caller side)."""

    src: str
    dst: str
    transport: Transport = "auto"
    slots: int | None = Field(default=None, ge=1, le=4096, description="In-flight payloads.")
    request_slots: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="In-flight payloads of one request; default a quarter of `slots` (at "
        "least 1). So one request whose consumer falls behind takes only its share of the edge "
        "and the others flow on, and a stream runs at most this far ahead of its consumer.",
    )
    slot_bytes: int | None = Field(default=None, ge=64, description="Largest payload, bytes.")


class HostConfig(_Strict):
    address: str = Field(description="IP address or name the other hosts reach this one at.")


class RuntimeConfig(_Strict):
    ipc_dir: str | None = Field(
        default=None,
        description="Folder for ipc:// sockets; default a private temp folder. Made 0700 (who "
        "can connect to the sockets talks to the stages); one that exists open to others is "
        "refused.",
    )
    ready_timeout_s: float = Field(default=120.0, gt=0, description="Stage start-up limit.")
    abort_timeout_s: float = Field(default=5.0, gt=0, description="Wait for every AbortAck.")
    restart_stages: bool = Field(default=True, description="Restart a stage process that died.")
    first_output_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A request's bound from `submit` to its first output (or its end, for one "
        "with none): past it the request fails with the cause (a stage down and not back, no "
        "free request slot or credit, a stage that does not answer) and is aborted, so no "
        "call waits for ever. Raise it where a first output can take longer (a restart of a "
        "checkpoint that new calls should wait for, a long prefill on a slow device).",
    )
    fork_server: bool = Field(
        default=True,
        description="Start local stage processes as forks of one process that has imported "
        "their executors' modules (torch, transformers) already: a start or restart costs the "
        "model's load, not seconds of imports. Off: each is a fresh interpreter.",
    )
    warm_spares: bool = Field(
        default=False,
        description="Keep a started, loaded spare of every local stage process: one that dies "
        "is replaced by its spare at once (new calls wait milliseconds, not a model load), and "
        "a new spare loads in the background. Costs each stage's memory (GPU memory too) "
        "twice.",
    )
    heartbeat_interval_s: float = Field(default=0.25, gt=0)
    heartbeat_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Silence after which a remote process (on another host or Ray node) counts "
        "as dead: its requests fail and new ones go to another replica. A node that stops "
        "answering is seen no sooner; 2 suits a real-time service on a private network "
        "(docs/deployment.md).",
    )
    inline_max_bytes: int = Field(
        default=16384, ge=0, description="Payloads up to this size ride in the control message."
    )
    default_slots: int = Field(default=8, ge=1, le=4096, description="Credits per edge.")
    default_slot_bytes: int = Field(
        default=256 << 10,
        ge=64,
        description="Slot size per edge; an edge whose payloads are larger sets its own "
        "`slot_bytes` (an oversized payload fails its request with the fix in the message).",
    )
    max_requests: int = Field(
        default=256, ge=1, description="Requests in flight at once; more wait in submit()."
    )
    base_port: int = Field(
        default=47100, ge=1024, le=65000, description="First TCP port when `hosts` are used."
    )
    bind_host: str = Field(default="127.0.0.1", description="This machine's address for TCP.")
    cross_host_transport: Literal["tcp", "mooncake"] = Field(
        default="tcp",
        description="What an edge between two hosts (or Ray nodes) left at `transport: auto` "
        "uses: tcp (CurveZMQ, authenticated), or mooncake (Mooncake's transfer engine: the "
        "`mooncake` extra, a private network only).",
    )
    mooncake_protocol: Literal["tcp", "rdma"] = Field(
        default="tcp",
        description="How edges with `transport: mooncake` move payloads between machines "
        "(Mooncake's transfer engine, the `mooncake` extra): tcp, or rdma on an RDMA fabric. "
        "Not authenticated, unlike the CurveZMQ control plane: a private network only.",
    )
    curve_secret_env: str = Field(
        default="REALTIME_OMNI_CURVE_SECRET",
        description="The environment variable holding the deployment's CurveZMQ secret key (40 "
        "Z85 characters, the same on every host; `realtime-omni keygen` makes one). Required "
        "with `hosts`: over TCP every control-plane connection is authenticated and encrypted "
        "with it. Never put the key in the file.",
    )
    placement: Literal["local", "ray"] = Field(
        default="local",
        description="local: this server starts the stage processes (on other `hosts`, they are "
        "started by hand); ray: a Ray cluster places and supervises them "
        "(`pipeline/ray_placement.py`, the `ray` extra; `serve --ray ADDRESS` sets it).",
    )
    ray_address: str | None = Field(
        default=None,
        description="With placement ray: the cluster to join (ray.init's address); None: the "
        "RAY_ADDRESS environment variable, else a local Ray started for this server.",
    )
    ray_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK",
        description="Ray's placement-group strategy over the stage process groups: PACK keeps "
        "them on few nodes (shared memory between them), SPREAD over many.",
    )
    stage_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Added to the niceness of every stage process this server starts. Where "
        "the stages compute on the same CPU cores as the gateway's media (the tiny model on a "
        "laptop), a positive value lets the calls' audio frames leave on time when the cores "
        "are oversubscribed, at the cost of the model's speed under that load. On GPU stages, "
        "which mostly wait for the device, it changes little.",
    )


class PipelineConfig(_Strict):
    name: str
    entry: str = Field(description="The stage a request enters at.")
    stages: dict[str, StageConfig]
    edges: list[EdgeConfig] = Field(default_factory=list)
    hosts: dict[str, HostConfig] = Field(default_factory=dict)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: dict[str, Any] = Field(
        default_factory=dict, description="Model-wide settings passed to every executor."
    )


def load_config(path: str | Path) -> PipelineConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, source=str(path))


def parse_config(data: Any, source: str = "config") -> PipelineConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in GATEWAY_SECTIONS}
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        more = f" (and {len(e.errors()) - 1} more problems)" if len(e.errors()) > 1 else ""
        raise ConfigError(
            f"{source}: field {where!r} = {err.get('input')!r}: {err['msg']}. "
            f"Fix: {_pydantic_fix(err)}{more}"
        ) from None
    _check(cfg, source)
    return cfg


def _pydantic_fix(err: Any) -> str:
    loc = [p for p in err["loc"] if isinstance(p, str)]
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] = PipelineConfig
        for part in loc[:-1]:
            field = model.model_fields.get(part)
            ann = getattr(field, "annotation", None)
            args = getattr(ann, "__args__", ())
            nested = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
            if nested:
                model = nested[0]
        allowed = sorted(model.model_fields)
        close = difflib.get_close_matches(loc[-1], allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{hint}allowed fields here: {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"add the required field {loc[-1]!r}"
    return "give a value of the documented type and range (see realtime_omni/pipeline/config.py)"


def _fail(source: str, field: str, value: Any, problem: str, fix: str) -> None:
    raise ConfigError(f"{source}: {field} = {value!r}: {problem}. Fix: {fix}")


def _check(cfg: PipelineConfig, src: str) -> None:
    names = list(cfg.stages)
    known = ", ".join(names)
    if not names:
        _fail(src, "stages", {}, "no stages", "declare at least one stage")
    for name in names:
        if not _NAME.match(name) or name == "client":
            _fail(src, "stages", name, "not a valid stage name", "use letters, digits, _ and -")
    if cfg.entry not in cfg.stages:
        _fail(src, "entry", cfg.entry, "not a stage", f"use one of: {known}")

    upstream: dict[str, list[str]] = {n: [] for n in names}
    for name, st in cfg.stages.items():
        for kind in ("next", "stream_to"):
            for i, dst in enumerate(getattr(st, kind)):
                field = f"stages.{name}.{kind}[{i}]"
                if dst not in cfg.stages:
                    _fail(src, field, dst, "unknown stage", f"use one of: {known}")
                if dst == name:
                    _fail(src, field, dst, "a stage cannot feed itself", "remove the edge")
            upstream_kind = st.next if kind == "next" else []
            for dst in upstream_kind:
                upstream[dst].append(name)
        both = set(st.next) & set(st.stream_to)
        if both:
            _fail(
                src,
                f"stages.{name}",
                sorted(both),
                "listed in both next and stream_to",
                "keep each downstream stage in one of the two lists",
            )
        for kind in ("next", "stream_to"):
            targets = getattr(st, kind)
            if len(set(targets)) != len(targets):
                _fail(
                    src,
                    f"stages.{name}.{kind}",
                    targets,
                    "a stage is listed twice",
                    "list each downstream stage once",
                )
        if not _DEVICE.match(st.device):
            _fail(src, f"stages.{name}.device", st.device, "unknown device", "use cpu or cuda:N")
        if st.replica_hosts is not None:
            if len(st.replica_hosts) != st.replicas:
                _fail(
                    src,
                    f"stages.{name}.replica_hosts",
                    st.replica_hosts,
                    f"{len(st.replica_hosts)} hosts for {st.replicas} replicas",
                    "name one host (or null) per replica",
                )
            for h in st.replica_hosts:
                if h is not None and h not in cfg.hosts:
                    _fail(
                        src,
                        f"stages.{name}.replica_hosts",
                        h,
                        "not declared in hosts",
                        f"add hosts.{h}.address or use one of: {', '.join(cfg.hosts) or 'none'}",
                    )
        if st.host is not None and st.host not in cfg.hosts:
            _fail(
                src,
                f"stages.{name}.host",
                st.host,
                "not declared in hosts",
                f"add hosts.{st.host}.address or use one of: {', '.join(cfg.hosts) or 'none'}",
            )
        if not (":" in st.executor or _NAME.match(st.executor)):
            _fail(
                src,
                f"stages.{name}.executor",
                st.executor,
                "not an executor name",
                "use a registered short name or 'package.module:Class'",
            )

    for name, st in cfg.stages.items():
        for i, w in enumerate(st.wait_for or []):
            if w not in upstream[name]:
                _fail(
                    src,
                    f"stages.{name}.wait_for[{i}]",
                    w,
                    "not a stage that lists this one in `next`",
                    f"use a subset of: {', '.join(upstream[name]) or 'none'}",
                )

    children = {n: list(s.next) + list(s.stream_to) for n, s in cfg.stages.items()}
    cycle = _find_cycle(children)
    if cycle:
        _fail(
            src,
            "stages",
            " -> ".join(cycle),
            "the edges form a cycle",
            "the stage graph must be acyclic; remove one edge of the cycle",
        )
    seen, todo = {cfg.entry}, [cfg.entry]
    while todo:
        for c in children[todo.pop()]:
            if c not in seen:
                seen.add(c)
                todo.append(c)
    for name in names:
        if name not in seen:
            _fail(
                src,
                f"stages.{name}",
                name,
                f"unreachable from the entry stage {cfg.entry!r}",
                "add it to some reachable stage's next or stream_to, or remove it",
            )
    if not any(s.terminal for s in cfg.stages.values()):
        _fail(
            src,
            "stages.*.terminal",
            False,
            "no terminal stage",
            "set terminal: true on the stage(s) whose output goes back to the caller",
        )

    groups: dict[str, tuple[str, str | None, int]] = {}
    for name, st in cfg.stages.items():
        proc = st.process or name
        if not _NAME.match(proc):
            _fail(
                src,
                f"stages.{name}.process",
                proc,
                "not a valid process name",
                "use letters, digits, _ and -",
            )
        if proc in groups:
            first, host, replicas = groups[proc]
            if cfg.stages[first].replica_hosts != st.replica_hosts:
                _fail(
                    src,
                    f"stages.{name}.replica_hosts",
                    st.replica_hosts,
                    f"stage {first!r} shares process {proc!r} with other replica_hosts",
                    "stages in one process must name the same replica_hosts",
                )
            if host != st.host:
                _fail(
                    src,
                    f"stages.{name}.host",
                    st.host,
                    f"stage {first!r} shares process {proc!r} but sits on host {host!r}",
                    "stages in one process must name the same host",
                )
            if replicas != st.replicas:
                _fail(
                    src,
                    f"stages.{name}.replicas",
                    st.replicas,
                    f"stage {first!r} shares process {proc!r} with replicas {replicas}",
                    "stages in one process must have the same replicas",
                )
        else:
            groups[proc] = (name, st.host, st.replicas)

    seen_edges = set()
    for i, e in enumerate(cfg.edges):
        field = f"edges[{i}]"
        pair = (e.src, e.dst)
        if pair in seen_edges:
            _fail(src, field, f"{e.src}->{e.dst}", "overridden twice", "merge the two entries")
        seen_edges.add(pair)
        is_edge = (
            (e.src == "client" and e.dst == cfg.entry)
            or (e.dst == "client" and e.src in cfg.stages and cfg.stages[e.src].terminal)
            or (e.src in cfg.stages and e.dst in children[e.src])
        )
        if not is_edge:
            _fail(
                src,
                field,
                f"{e.src}->{e.dst}",
                "not an edge of the graph",
                "name a pair from some stage's next/stream_to, client->entry or terminal->client",
            )
        s_st, d_st = cfg.stages.get(e.src), cfg.stages.get(e.dst)
        s_proc = (s_st.process or e.src) if s_st else "client"
        d_proc = (d_st.process or e.dst) if d_st else "client"
        s_host = s_st.host if s_st else None
        d_host = d_st.host if d_st else None
        for st_ in (s_st, d_st):  # replicas on several hosts: no one host to share memory on
            if st_ is not None and st_.replica_hosts and len(set(st_.replica_hosts)) > 1:
                s_host, d_host = "several", "hosts"
        if e.transport == "mooncake" and s_proc == d_proc:
            _fail(
                src,
                f"{field}.transport",
                e.transport,
                f"{e.src} and {e.dst} share a process",
                "use mooncake between processes (across machines), reference within one",
            )
        if e.transport == "reference" and s_proc != d_proc:
            _fail(
                src,
                f"{field}.transport",
                e.transport,
                f"{e.src} and {e.dst} run in different processes",
                "use reference only between stages sharing a process",
            )
        if e.transport in ("shm", "cuda_ipc") and s_host != d_host:
            _fail(
                src,
                f"{field}.transport",
                e.transport,
                "the two stages are on different hosts",
                "use tcp (or auto) across hosts",
            )
        if e.transport == "cuda_ipc" and not (
            s_st and d_st and s_st.device.startswith("cuda") and d_st.device.startswith("cuda")
        ):
            _fail(
                src,
                f"{field}.transport",
                e.transport,
                "both ends must be on cuda devices",
                "use shm (or auto) for edges with a CPU end",
            )


def _find_cycle(children: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for c in children[n]:
            if state.get(c) == 1:
                return [*stack[stack.index(c) :], c]
            if c not in state and (found := visit(c)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in children:
        if n not in state and (found := visit(n)):
            return found
    return None
