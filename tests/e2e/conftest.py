"""A real `realtime-omni serve` on a free port with the simulated Qwen3-Omni config."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from realtime_omni.clients.webrtc import espeak
from realtime_omni.gateway.media.audio import resample
from tests.conftest import ROOT, free_port, timeout
from tests.e2e.shapes import check_log

MAX_SESSIONS = 3


@contextlib.contextmanager
def serving(
    *args: str,
    config: Path | None = None,
    startup: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`realtime-omni serve` with `config` (default: the simulated one) on a free port, `args`
    added; yields its URL, and checks on the way out that SIGTERM left no shared memory behind.
    `startup` gets the lines the server printed up to its ready line."""
    port = free_port()
    config = config or ROOT / "configs" / "simulated-qwen3-omni.yaml"
    events = Path(tempfile.mkdtemp(prefix="rto-events-")) / "events.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "realtime_omni.cli",
            "serve",
            "--port",
            str(port),
            "--config",
            str(config),
            "--event-log",
            str(events),
            "--drain-s",  # what a test leaves open delays its teardown no more than this
            "5",
            *args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout(60)
    line = ""
    while time.monotonic() < deadline and "serving" not in line:
        line = proc.stdout.readline()
        if startup is not None:
            startup.append(line)
        if not line and proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}")
    assert f"http://127.0.0.1:{port}" in line
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout(15))  # uvicorn re-raises SIGTERM after a clean shutdown
    left = [p for p in os.listdir("/dev/shm") if p.startswith(f"rto_{proc.pid}_")]
    assert left == [], f"shared memory left behind: {left}"
    # Every event the clients got, as the openai SDK's types (GA and beta) would parse it.
    bad = check_log(events)
    shutil.rmtree(events.parent, ignore_errors=True)
    assert bad == {}, "server events the openai SDK's types refuse:\n" + json.dumps(bad, indent=1)


@pytest.fixture(scope="session")
def server() -> Iterator[str]:
    with serving("--max-sessions", str(MAX_SESSIONS)) as url:
        yield url


@pytest.fixture(scope="session")
def speech() -> np.ndarray:
    """'Hello, how are you today?' spoken by espeak-ng, 24 kHz float32 (pcm16's rate)."""
    spoken = espeak("Hello, how are you today?")
    if spoken is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); silero needs speech")
    x, rate = spoken
    return resample(x, rate, 24000)


BROWSER_SPEECH = "Hello, how are you today?"


@pytest.fixture(scope="session")
def mic_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake microphone: half a second of silence, the sentence, then 6 s of silence (Chromium
    loops the file), 48 kHz mono 16-bit."""
    for tool in ("espeak-ng", "sox"):
        assert shutil.which(tool), f"{tool} is missing: apt-get install {tool} (.ci/run does)"
    d = tmp_path_factory.mktemp("mic")
    raw, out = d / "speech.wav", d / "mic.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), BROWSER_SPEECH], check=True)
    subprocess.run(
        ["sox", str(raw), "-r", "48000", "-c", "1", "-b", "16", str(out), "pad", "0.5", "6"],
        check=True,
    )
    return out
