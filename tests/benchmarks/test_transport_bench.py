"""benchmarks/transport.py runs end to end with a handful of iterations and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from realtime_omni.pipeline import mooncake
from realtime_omni.pipeline.shm import list_segments
from tests.conftest import ROOT, timeout

SIZES_BYTES = {8, 160, 4096, 532_480, 3_211_264}
CPU_TRANSPORTS = {"reference", "inline", "shm", "tcp", "tcp_curve"}


def test_transport_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "transport.json"
    cmd = [
        sys.executable,
        "benchmarks/transport.py",
        "--iters",
        "5",
        "--warmup",
        "2",
        "--rounds",
        "2",
    ]
    proc = subprocess.Popen(
        [*cmd, "--json", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout(120))
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert list_segments(proc.pid) == []  # its Outlets' segments are named after its pid
    data = json.loads(out.read_text())
    assert set(data) == {"rows", "baselines"}

    rows = data["rows"]
    for r in rows:
        assert set(r) == {"transport", "payload_bytes", "p50_us", "p99_us"}
        assert 0 < r["p50_us"] <= r["p99_us"]
    ran = {r["transport"] for r in rows}
    assert CPU_TRANSPORTS <= ran <= CPU_TRANSPORTS | {"cuda_ipc", "mooncake"}
    assert ("mooncake" in ran) == mooncake.available()
    assert sorted((r["transport"], r["payload_bytes"]) for r in rows) == sorted(
        (t, n) for t in ran for n in SIZES_BYTES
    )
    if "cuda_ipc" not in ran:
        assert "cuda_ipc: skipped (" in stdout
    if "mooncake" not in ran:
        assert "mooncake: skipped (" in stdout

    baselines = data["baselines"]
    for b in baselines:
        assert set(b) == {"name", "payload_bytes", "p50_us"}
        assert b["p50_us"] > 0
    assert sorted((b["name"], b["payload_bytes"]) for b in baselines) == sorted(
        (name, n)
        for name in ("memcpy", "memcpy_after_idle", "mp_queue_pickle", "zmq_ipc_bare")
        for n in SIZES_BYTES
    )

    table = [line.split() for line in stdout.splitlines()]
    printed = [cells for cells in table if cells and cells[0] in ran]
    assert len(printed) == len(rows)
    for cells, r in zip(printed, rows, strict=True):  # p50 is the median of the rounds' p50s
        a, b = (float(x) for x in cells[-3:] if x != "/")
        assert min(a, b) - 0.5 <= r["p50_us"] <= max(a, b) + 0.5
