"""The stage graph derived from a validated config: edges with their transports, process groups,
and the socket endpoint of every process. Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.config import PipelineConfig, Transport
from realtime_omni.pipeline.messages import CLIENT


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: Literal["once", "stream"]
    transport: str  # reference | inline | shm | cuda_ipc | tcp | mooncake
    slots: int  # credits: payloads in flight on this edge at most
    slot_bytes: int  # largest payload; shm and cuda_ipc slots are this big
    request_slots: int = 0  # payloads of one request in flight at most (0: no cap)

    @property
    def key(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class ProcessGroup:
    name: str
    stages: tuple[str, ...]
    host: str | None
    replicas: int
    threads: int
    devices: tuple[str, ...]

    def process_names(self) -> list[str]:
        return [f"{self.name}#{i}" for i in range(self.replicas)]


def group_of(process: str) -> str:
    return process.rsplit("#", 1)[0]


class Graph:
    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg
        self.entry = cfg.entry
        self.stages = cfg.stages
        self.process_of: dict[str, str] = {n: s.process or n for n, s in cfg.stages.items()}
        self.process_of[CLIENT] = CLIENT
        self.host_of: dict[str, str | None] = {n: s.host for n, s in cfg.stages.items()}
        self.host_of[CLIENT] = None
        # A stage whose replicas sit on several hosts (`replica_hosts`) has no one host: its
        # edges go over TCP, and each of its processes has its own address.
        self.spans: set[str] = {
            n for n, s in cfg.stages.items() if s.replica_hosts and len(set(s.replica_hosts)) > 1
        }
        for n, s in cfg.stages.items():
            if s.replica_hosts and n not in self.spans:
                self.host_of[n] = s.replica_hosts[0]

        groups: dict[str, list[str]] = {}
        for n in cfg.stages:
            groups.setdefault(self.process_of[n], []).append(n)
        self.groups = {
            g: ProcessGroup(
                name=g,
                stages=tuple(ss),
                host=cfg.stages[ss[0]].host,
                replicas=cfg.stages[ss[0]].replicas,
                threads=max(cfg.stages[s].threads for s in ss),
                devices=tuple(sorted({cfg.stages[s].device for s in ss})),
            )
            for g, ss in groups.items()
        }

        overrides = {(e.src, e.dst): e for e in cfg.edges}
        rt = cfg.runtime
        pairs: list[tuple[str, str, Literal["once", "stream"]]] = [(CLIENT, cfg.entry, "once")]
        for n, s in cfg.stages.items():
            pairs += [(n, d, "once") for d in s.next]
            pairs += [(n, d, "stream") for d in s.stream_to]
            if s.terminal:
                pairs.append((n, CLIENT, "stream"))
        self.edges: list[Edge] = []
        for src, dst, kind in pairs:
            o = overrides.get((src, dst))
            slots = o.slots if o and o.slots else rt.default_slots
            request_slots = o.request_slots if o and o.request_slots else max(1, slots // 4)
            # Credits for a batch: on a streaming edge the stage that batches (the receiver, or
            # the sender for edges to the caller) can have `max_batch` requests in flight, each
            # with its share. A once-payload holds its credit only until its request starts.
            batch = cfg.stages[dst if dst != CLIENT else src].max_batch
            if kind == "once":
                pass
            elif not (o and o.slots):
                slots = max(slots, batch * request_slots)
            elif slots < batch:
                raise ConfigError(
                    f"edges: {src}->{dst} slots = {slots}: fewer than the {batch} requests "
                    f"stage {dst if dst != CLIENT else src!r} batches (max_batch). Fix: set "
                    f"slots >= {batch * request_slots} ({batch} x request_slots "
                    f"{request_slots}), or lower max_batch"
                )
            transport = o.transport if o else "auto"
            if transport == "auto":
                transport = self._auto_transport(src, dst)
            elif (
                transport == "tcp"
                and self.host_of[src] == self.host_of[dst]
                and not {src, dst} & self.spans
            ):
                raise ConfigError(
                    f"edges: {src}->{dst} transport = 'tcp': both stages are on one host. "
                    "Fix: tcp is for edges across hosts; use inline or shm on one host"
                )
            self.edges.append(
                Edge(
                    src=src,
                    dst=dst,
                    kind=kind,
                    transport=transport,
                    slots=slots,
                    slot_bytes=(o.slot_bytes if o and o.slot_bytes else rt.default_slot_bytes),
                    request_slots=request_slots,
                )
            )
        self.out_edges: dict[str, list[Edge]] = {n: [] for n in [*cfg.stages, CLIENT]}
        self.in_edges: dict[str, list[Edge]] = {n: [] for n in [*cfg.stages, CLIENT]}
        for e in self.edges:
            self.out_edges[e.src].append(e)
            self.in_edges[e.dst].append(e)
        self.wait_for: dict[str, tuple[str, ...]] = {}
        for n, s in cfg.stages.items():
            once_in = [e.src for e in self.in_edges[n] if e.kind == "once"]
            self.wait_for[n] = tuple(s.wait_for if s.wait_for is not None else once_in)
        self.terminals = tuple(n for n, s in cfg.stages.items() if s.terminal)
        self.use_tcp = bool(cfg.hosts)
        # Processes that came back somewhere else than the config placed them (Ray restarted
        # them on another node): process -> the address their inbox is at now.
        self.moved: dict[str, str] = {}

    def _auto_transport(self, src: str, dst: str) -> Transport:
        if self.process_of[src] == self.process_of[dst]:
            return "reference"
        if self.host_of[src] != self.host_of[dst] or {src, dst} & self.spans:
            return self.cfg.runtime.cross_host_transport
        devs = [self.stages[s].device if s != CLIENT else "cpu" for s in (src, dst)]
        if all(d.startswith("cuda") for d in devs):
            return "cuda_ipc"
        return "shm"

    def edge(self, src: str, dst: str) -> Edge:
        for e in self.out_edges[src]:
            if e.dst == dst:
                return e
        raise KeyError(f"{src}->{dst}")

    def processes(self) -> list[str]:
        """Every stage process to run, named `group#replica`."""
        return [p for g in self.groups.values() for p in g.process_names()]

    def host_of_process(self, process: str) -> str | None:
        """The key of `hosts` a stage process runs on; None: this machine."""
        g = self.groups[group_of(process)]
        hosts = self.cfg.stages[g.stages[0]].replica_hosts
        return hosts[int(process.rsplit("#", 1)[1])] if hosts else g.host

    def local_processes(self) -> list[str]:
        return [p for p in self.processes() if self.host_of_process(p) is None]

    def placed_address(self, process: str) -> str:
        """The address the config gives `process` (its host's, else this machine's, which is
        the coordinator's, `client`)."""
        h = None if process == CLIENT else self.host_of_process(process)
        return self.cfg.hosts[h].address if h else self.cfg.runtime.bind_host

    def shares_memory(self, a: str, b: str) -> bool:
        """Whether processes `a` and `b` still run on one machine, as their edge's shm or CUDA
        IPC transport assumes: false once Ray moved one of them to a node at another address
        (its payloads then go inline over TCP)."""
        if not self.moved or not (a in self.moved or b in self.moved):
            return True
        return self.address_of(a) == self.address_of(b)

    def address_of(self, process: str) -> str:
        """Where `process` listens now: where it moved, else where the config placed it."""
        return self.moved.get(process) or self.placed_address(process)

    def endpoint(self, process: str, epoch: int, ipc_dir: Path) -> str:
        """The inbox address of `process` (or of the coordinator, `client`).

        On one machine: an ipc:// socket whose path carries the incarnation, so messages queued
        for a dead incarnation never reach its successor. Across hosts: fixed TCP ports.
        """
        if not self.use_tcp:
            name = "client" if process == CLIENT else f"{process}.{epoch}"
            return f"ipc://{ipc_dir}/{name}.sock"
        rt = self.cfg.runtime
        if process == CLIENT:
            port, host = rt.base_port, rt.bind_host
        else:
            # By sorted name, so hosts agree whatever order their copy of the config lists.
            port = rt.base_port + 1 + sorted(self.processes()).index(process)
            host = self.address_of(process)
        return f"tcp://{host}:{port}"
