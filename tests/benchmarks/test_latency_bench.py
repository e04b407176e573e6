"""benchmarks/latency.py runs end to end on the simulated config, one turn and two small
concurrency levels, writes its JSON and leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, timeout

MEASURES = ("token_to_audio_ms", "first_audio_ms", "barge_in_to_silence_ms", "abort_ack_ms")
RUN_ONLY = (
    "token_to_audio_over_compute_ms",
    "speech_end_to_heard_ms",
    "speech_end_to_heard_preemptive_ms",
    "twilio_speech_end_to_media_ms",
)
# under "runs" alone; with one turn nobody talks over an answer, so these stay empty (n = 0)
BARGE_INS = ("twilio_onset_to_clear_ms", "sip_onset_to_rtp_silence_ms")
# One turn, one barge-in: made exactly once (token_to_audio: every chunk that found the queue empty)
ONCE = ("first_audio_ms", "speech_end_to_heard_ms", "speech_end_to_heard_preemptive_ms",
        "barge_in_to_silence_ms", "abort_ack_ms")  # fmt: skip
SESSIONS = [1, 2]


def test_latency_benchmark_smoke(tmp_path: Path) -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); the caller speaks")
    out = tmp_path / "latency.json"
    cmd = [sys.executable, "benchmarks/latency.py", "--configs", "simulated", "--turns", "1"]
    cmd += ["--seconds", "2", "--sessions", ",".join(map(str, SESSIONS)), "--json", str(out)]
    cmd += ["--caller-nice", "5"]
    # A group of its own: the benchmark, its server and the server's stage processes.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout(90))
        assert proc.returncode == 0, stderr
        with pytest.raises(ProcessLookupError):  # nothing of it is left running
            os.killpg(proc.pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    data = json.loads(out.read_text())
    assert set(data) == {*MEASURES, "sessions", "runs"}

    (run,) = data["runs"]
    assert run["config"] == "simulated"
    for key in MEASURES:
        assert data[key] == run[key], key  # the top level is the first config's run
    for key in (*MEASURES, *RUN_ONLY):
        m = run[key]
        assert set(m) == {"p50", "p99", "n"}, (key, m)
        assert m["n"] >= 1, (key, m)  # one turn makes each of them at least once
        assert math.isfinite(m["p50"]) and math.isfinite(m["p99"]), (key, m)
        assert 0 <= m["p50"] <= m["p99"], (key, m)
    for key in ONCE:
        assert run[key]["n"] == 1, (key, run[key])
    for key in BARGE_INS:
        assert run[key]["n"] == 0, (key, run[key])
    sip = run["sip_speech_end_to_rtp_audio_ms"]  # a real SIP call, where baresip is installed
    assert sip["n"] == (1 if shutil.which("baresip") else 0), sip
    assert run["token_to_audio_ms"]["p50"] > 0

    assert [s["n"] for s in data["sessions"]] == SESSIONS
    for s in data["sessions"]:
        assert set(s) == {"n", "late_frame_ratio", "cpu_cores", "answers"}
        assert s["answers"] >= 0
        assert 0.0 <= s["late_frame_ratio"] <= 1.0, s
        assert set(s["cpu_cores"]) == {"callers", "gateway", "stages"}
        assert all(0 <= v <= 64 for v in s["cpu_cores"].values()), s
        assert s["cpu_cores"]["gateway"] > 0 and s["cpu_cores"]["callers"] > 0, s
    assert data["sessions"] == run["sessions"]

    assert "simulated: measure" in stdout
    late = next(line for line in stdout.splitlines() if "late output frames" in line)
    assert late.endswith(
        f"calls: 1: {100 * data['sessions'][0]['late_frame_ratio']:.2f}%, 2: "
        f"{100 * data['sessions'][1]['late_frame_ratio']:.2f}% (callers at niceness 5)"
    ), late
