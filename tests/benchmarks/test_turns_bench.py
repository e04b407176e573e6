"""benchmarks/turns.py runs end to end: a speaking simulated server, one trial of an echo and
of an interruption under both policies, its JSON in the documented shape."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, timeout

ROW = {
    "condition", "policy", "trials", "false_pause", "false_barge_in", "missed_barge_in",
    "onset_to_silence_ms_p50", "onset_to_abort_ms_p50", "end_of_speech_to_audio_ms_p50",
}  # fmt: skip


def test_turns_benchmark_smoke(tmp_path: Path) -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed; the corpus is spoken by it")
    out = tmp_path / "turns.json"
    cmd = [sys.executable, "benchmarks/turns.py", "--trials", "1",
           "--conditions", "echo-12,interrupt", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["condition"], r["policy"]) for r in rows] == [
        ("echo-12", "now"), ("echo-12", "before"), ("interrupt", "now"), ("interrupt", "before")
    ]  # fmt: skip
    for r in rows:
        assert set(r) == ROW and r["trials"] == 1
        assert r["end_of_speech_to_audio_ms_p50"] > 0
    now = {r["condition"]: r for r in rows if r["policy"] == "now"}
    assert now["echo-12"]["false_barge_in"] == 0  # the bot's echo does not cut it off
    assert now["interrupt"]["missed_barge_in"] == 0  # a real interruption does
    assert "condition" in proc.stdout and "false pause" in proc.stdout
