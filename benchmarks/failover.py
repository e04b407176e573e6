"""Failover: a stage process SIGKILLed, to the next call served, with and without warm spares.

The tiny model through the real stage processes, first without the gateway (a Coordinator in
this process), then through it (`realtime-omni serve` on configs/tiny.yaml, a new Realtime
WebSocket call for each try, as a caller who hangs up and dials again). After a warm-up request
(and, with warm spares, once the spare has loaded) the `speech` process (talker and code2wav)
is SIGKILLed; from then on a request (a call) is made again and again, one that meets the dead
process failing and being retried, until one gives audio. It reports the time from the kill to
that first audio, in three setups in the same run:

- `before`: `runtime.fork_server: false`, no spares: the process is started again as a fresh
  interpreter (imports torch and transformers, then loads its model), as before session 24;
- `fork_server` (the default): it is forked from the fork server, which imported those once;
- `warm_spares`: `runtime.warm_spares: true` too: its loaded spare takes over.

    python benchmarks/failover.py [--rounds 3] [--via coordinator,gateway] [--json PATH]

Target (issue 31): the next call within 3 s on the tiny config through the gateway, by default.
`--json` writes `{"rows": [{"via", "setup", "kill_to_audio_ms", "p50_ms"}]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import websockets
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.errors import StageDied  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

VICTIM = "speech#0"


def request() -> dict[str, Any]:
    t = np.arange(16000) / 16000
    audio = (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)
    content = [{"type": "audio", "audio": "audio0"}, {"type": "text", "text": "Answer."}]
    return {"messages": [{"role": "user", "content": content}], "audio0": audio,
            "max_tokens": 4, "temperature": 0.0, "talker_max_tokens": 8}  # fmt: skip


async def first_audio(coord: Coordinator) -> bool:
    try:
        async for out in await coord.submit(request()):
            if "pcm" in out.data:
                return True
    except StageDied:
        return False
    return False


SETUPS = {"before": (False, False), "fork_server": (True, False), "warm_spares": (True, True)}


def config(setup: str) -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    fork, warm = SETUPS[setup]
    data.setdefault("runtime", {}).update(fork_server=fork, warm_spares=warm)
    return data


async def measure(setup: str, rounds: int) -> list[float]:
    data = config(setup)
    warm = data["runtime"]["warm_spares"]
    times = []
    async with Coordinator(parse_config(data)) as coord:
        await first_audio(coord)
        for _ in range(rounds):
            if warm:
                await asyncio.wait_for(coord.supervisor.spare_ready[VICTIM], 120)
            pid = coord.pid_of(VICTIM)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not await first_audio(coord):
                await asyncio.sleep(0.01)
            times.append((time.monotonic() - t0) * 1e3)
            print(f"  {setup}: {times[-1]:.0f} ms", file=sys.stderr, flush=True)
    return times


async def call(url: str) -> bool:
    """One call: a new WebSocket session, a typed question; True once its audio starts."""
    try:
        async with websockets.connect(url, max_size=1 << 24, open_timeout=10) as ws:
            await ws.send(json.dumps({"type": "session.update",
                                      "session": {"max_output_tokens": 4}}))  # fmt: skip
            item = {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "Hello?"}]}  # fmt: skip
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if ev["type"] == "response.output_audio.delta":
                    return True
                if ev["type"] == "response.done":
                    return False
    except (OSError, TimeoutError, websockets.WebSocketException):
        return False


def stats(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v1/stats", timeout=10) as r:
        return dict(json.loads(r.read()))


async def measure_gateway(setup: str, rounds: int) -> list[float]:
    data = config(setup)
    warm = data["runtime"]["warm_spares"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as cfg:
        yaml.safe_dump(data, cfg)
        proc = subprocess.Popen(
            [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(port),
             "--config", cfg.name],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            while "serving" not in (line := proc.stdout.readline()):
                if not line and proc.poll() is not None:
                    raise SystemExit("the server did not start")
            base, url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/realtime"
            times = []
            assert await call(url), "the warm-up call gave no audio"
            for _ in range(rounds):
                while warm and not stats(base)["spares_loaded"].get(VICTIM):
                    await asyncio.sleep(0.1)
                os.kill(stats(base)["pids"][VICTIM], signal.SIGKILL)
                t0 = time.monotonic()
                while not await call(url):
                    await asyncio.sleep(0.01)
                times.append((time.monotonic() - t0) * 1e3)
                print(f"  gateway, {setup}: {times[-1]:.0f} ms", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)  # the restarted (or new spare) process settles
        finally:
            proc.terminate()
            proc.wait(30)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--via", default="coordinator,gateway")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for via in args.via.split(","):
        for setup in SETUPS:
            run = measure if via == "coordinator" else measure_gateway
            times = asyncio.run(run(setup, args.rounds))
            rows.append({"via": via, "setup": setup, "kill_to_audio_ms": times,
                         "p50_ms": statistics.median(times)})  # fmt: skip
    for r in rows:
        each = ", ".join(f"{t:.0f}" for t in r["kill_to_audio_ms"])
        print(f"{r['via']:11} {r['setup']:11}  SIGKILL -> next call's first audio: "
              f"p50 {r['p50_ms']:7.0f} ms  ({each})")  # fmt: skip
    for via in dict.fromkeys(r["via"] for r in rows):
        p50 = {r["setup"]: r["p50_ms"] for r in rows if r["via"] == via}
        verdict = "ok" if p50["fork_server"] <= 3000 else "OVER"
        print(
            f"{via}: the fork server {p50['before'] / p50['fork_server']:.1f}x sooner than "
            f"before, spares {p50['before'] / p50['warm_spares']:.0f}x; the default within "
            f"3 s: {verdict}"
        )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
