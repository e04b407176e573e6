"""Prometheus metrics of one server, served at `/metrics` (text exposition format).

Per session (histograms, milliseconds, observed as the sessions measure them): time to first
audio, thinker token -> its audio leaving, barge-in -> silence, abort acknowledged. Per stage, read
from the stage processes' own logs at each scrape: step time and batch size (histograms of the
steps made since the previous scrape, of the last 512 a stage keeps) and the steps' CPU time (a
counter: below the step time's sum when the stages wait for the cores), requests held; per edge,
credits in use and messages waiting (received, not yet taken by the stage; emitted, not yet sent
for want of credit); per stage with a KV cache, its pool's blocks in use and in all and the kept
sessions evicted for room (since each process started); per process, restarts and whether it is
up (a 0 beside its replica's 1: degraded, still serving); per transport,
live sessions; WebRTC output frames sent and late. A stage that makes more than 512 steps between
two scrapes loses the oldest from its histograms (scrape every few seconds).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
_SESSION = {
    "first_audio_ms": "End of the user's turn to the first audio frame out",
    "token_to_audio_ms": "A thinker token to its first audio frame out",
    "barge_in_to_silence_ms": "Speech over the bot to the first silent frame out",
    "abort_ms": "A response's abort until every stage acknowledged it",
}


TRANSPORTS = ("websocket", "webrtc", "twilio", "telnyx", "plivo", "sip")  # always exported


class Exporter:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.session = {
            k: Histogram(f"rto_session_{k}", doc, buckets=_MS, registry=r)
            for k, doc in _SESSION.items()
        }
        self.step = Histogram(
            "rto_stage_step_seconds", "One executor step", ["stage"], registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )  # fmt: skip
        self.step_cpu = Counter(
            "rto_stage_step_cpu_seconds",
            "CPU time of the executor steps (the stepping thread's); on a CPU stage, short of "
            "rto_stage_step_seconds_sum by its waits for a core",
            ["stage"], registry=r,
        )  # fmt: skip
        self.batch = Histogram(
            "rto_stage_batch_size", "Requests one step served", ["stage"], registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )  # fmt: skip
        self.held = Gauge("rto_stage_requests", "Requests holding state", ["stage"], registry=r)
        self.slots = Gauge("rto_edge_slots_in_use", "Credits lent on an edge", ["edge"], registry=r)
        self.queued = Gauge(
            "rto_edge_queued", "Messages waiting on an edge: side=in, received and not yet taken "
            "by its stage; side=out, emitted and not yet sent for want of credit",
            ["edge", "side"], registry=r,
        )  # fmt: skip
        self.kv_used = Gauge(
            "rto_kv_blocks_in_use", "KV cache blocks held by requests and kept sessions",
            ["stage"], registry=r,
        )  # fmt: skip
        self.kv_total = Gauge("rto_kv_blocks", "KV cache blocks in the pool", ["stage"], registry=r)
        self.kv_evicted = Gauge(
            "rto_kv_evictions", "Kept sessions evicted for room since the stage processes started",
            ["stage"], registry=r,
        )  # fmt: skip
        self.kv_preempted = Gauge(
            "rto_kv_preemptions", "Requests that gave their KV blocks back for an older one's "
            "decode (recomputed later) since the stage processes started", ["stage"], registry=r,
        )  # fmt: skip
        self.restarts = Gauge(
            "rto_process_restarts", "Restarts of a stage process", ["process"], registry=r
        )
        self.up = Gauge(
            "rto_process_up", "1 while a stage process is up, 0 while it is down (restarting, "
            "a lost node's); a 0 beside a replica's 1 is a degraded but serving pipeline",
            ["process"], registry=r,
        )  # fmt: skip
        self.sessions = Gauge("rto_sessions", "Live sessions", ["transport"], registry=r)
        self.in_flight = Gauge("rto_requests_in_flight", "Pipeline requests", registry=r)
        self.frames = Counter("rto_webrtc_frames", "WebRTC output frames sent", registry=r)
        self.late = Counter(
            "rto_webrtc_frames_late", "WebRTC output frames more than a frame late", registry=r
        )
        self._seen: dict[tuple[str, str], float] = {}  # (process, stage) -> last step observed
        self._frames = self._late = 0

    def observe(self, name: str, value_ms: float) -> None:
        """A session's measurement (Session's `on_metric`)."""
        hist = self.session.get(name)
        if hist is not None:
            hist.observe(value_ms)

    async def scrape(self, gateway: Any, webrtc: Any) -> bytes:
        coord = gateway.coord
        stats = await coord.stats()
        held: dict[str, int] = {}
        used: dict[str, int] = {}
        kv: dict[str, list[int]] = {}
        queued: dict[tuple[str, str], int] = {}
        for process, st in stats.items():
            for side, counts in (("in", st.queued_in), ("out", st.queued_out)):
                for edge, n in counts.items():
                    queued[edge, side] = queued.get((edge, side), 0) + n
            for stage, counts in st.kv.items():
                sums = kv.get(stage, [0] * len(counts))
                kv[stage] = [a + b for a, b in zip(sums, counts, strict=True)]
            for stage, log in st.steps.items():
                sizes = st.batches.get(stage, [])
                cpu = st.step_cpu.get(stage, [])
                last = self._seen.get((process, stage), float("-inf"))
                for i, (start, seconds) in enumerate(log):
                    if start > last:
                        self.step.labels(stage).observe(seconds)
                        if i < len(sizes):
                            self.batch.labels(stage).observe(sizes[i])
                        if i < len(cpu):
                            self.step_cpu.labels(stage).inc(cpu[i])
                if log:
                    self._seen[(process, stage)] = log[-1][0]
            for stage, n in st.active_requests.items():
                held[stage] = held.get(stage, 0) + n
            for edge, total in st.total_slots.items():
                used[edge] = used.get(edge, 0) + total - st.free_slots.get(edge, total)
        for stage, n in held.items():
            self.held.labels(stage).set(n)
        for edge, n in used.items():
            self.slots.labels(edge).set(n)
        for (edge, side), n in queued.items():
            self.queued.labels(edge, side).set(n)
        for stage, (in_use, total, evicted, preempted) in kv.items():
            self.kv_used.labels(stage).set(in_use)
            self.kv_total.labels(stage).set(total)
            self.kv_evicted.labels(stage).set(evicted)
            self.kv_preempted.labels(stage).set(preempted)
        down = coord.degraded
        for process, epoch in coord.epochs.items():
            self.restarts.labels(process).set(epoch)
            self.up.labels(process).set(0 if process in down else 1)
        calls = webrtc.stats()
        live: dict[str, int] = dict.fromkeys(TRANSPORTS, 0)
        for s in gateway.sessions:
            live[s.transport] = live.get(s.transport, 0) + 1
        for transport, n in live.items():
            self.sessions.labels(transport).set(n)
        self.in_flight.set(coord.in_flight)
        self.frames.inc(max(0, calls["frames"] - self._frames))
        self.late.inc(max(0, calls["frames_late"] - self._late))
        self._frames, self._late = calls["frames"], calls["frames_late"]
        return generate_latest(self.registry)
