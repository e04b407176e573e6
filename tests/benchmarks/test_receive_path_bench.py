"""benchmarks/receive_path.py runs end to end: one short call per path and link, its JSON in
the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, timeout

ROW = {
    "link", "path", "packets", "to_push_audio_ms_p50", "to_push_audio_ms_p90",
    "to_vad_window_ms_p50", "frames_lost_beyond_dropped_per_call",
}  # fmt: skip


def test_receive_path_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "receive_path.json"
    cmd = [sys.executable, "benchmarks/receive_path.py", "--rounds", "1", "--seconds", "2",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["link"], r["path"]) for r in rows) == [
        (link, path) for link in ("clean", "lossy")
        for path in ("aiortc jitter buffer", "as they arrive")
    ]  # fmt: skip
    for r in rows:
        assert set(r) == ROW and r["packets"] > 0
    ours = [r for r in rows if r["path"] == "as they arrive"]
    assert all(r["frames_lost_beyond_dropped_per_call"] == 0 for r in ours)
    assert "verdict" in proc.stdout
