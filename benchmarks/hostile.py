"""Hostile: honest WebRTC callers speaking turns while a driver runs, one after another, the
probes of the second exposure review (issue 40), each with a browser's client secret (a fresh
one per connection, as a page would hold) or with nothing. Each probe is bounded in count and
time; what it does to the honest callers and to the server is measured while it runs.

`realtime-omni serve` on the simulated config, API keys set, a Twilio auth token set. The
honest callers (aiortc, `realtime_omni.clients.webrtc`, each with a client secret) say a
sentence, wait for the answer's `response.done`, and say it again, for the whole run. Per probe:

- honest_late_frame_ratio: of the audio frames the server sent the honest calls while it ran,
  the share that left more than one frame period (20 ms) after its due time (the WebRTC track's
  own count, `/v1/stats`' `webrtc`: the server's stall, not the callers' host's). The callers
  run at niceness `--caller-nice` (10, the stages' own) and drop what they receive on arrival:
  they stand for people on devices of their own, and take what the server leaves;
- healthz_worst_ms: the slowest `/healthz` answer, asked every 100 ms meanwhile;
- rss_growth_mb: the gateway's RSS at its highest while the probe ran, over what it was before;
  rss_after_mb: the same `--settle-s` after the probe ended (back: near 0);
- status: what the server did with it (each refusal's code and count).

Probes (`--probes`, default all):

- event_ids: unknown events with an `event_id` of 64 KiB each (the error echoes it);
- json_nesting: 1.5 MB messages of `[[],[],...]` (parsed off the loop, bounded in nodes);
- live_append: the Live API's `session.input_audio.append` with 1 MiB of G.711 a message;
- settings_echo: a session's instructions and tools grown past their bound, then empty
  `session.update`s (each echoes the settings);
- offers: WebRTC offers past the size and candidate bounds on the Live and WHIP routes;
- phone_unsigned: tokenless streams to `/v1/phone/telnyx`, held open, and unsigned ones to
  `/v1/phone/twilio`;
- bad_host: the Twilio webhook with `Host: localhost:99999` and a signature;
- secret_reuse: a used client secret tried again, and calls with no credential at all.

    python benchmarks/hostile.py [--callers 8] [--probe-s 10] [--settle-s 10]
                                 [--probes event_ids,...] [--json PATH]

Targets, every probe: honest late frames <= 1 %, healthz worst <= 100 ms, RSS growth <= 200 MB
and back within 60 s, and every probe refused or bounded (its status).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import websockets

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.clients.webrtc import Caller, espeak, http  # noqa: E402
from realtime_omni.gateway.media.audio import resample  # noqa: E402
from realtime_omni.gateway.transports.signatures import twilio_signature  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.unit.gateway.app_harness import sdp_offer  # noqa: E402

KEY = "sk-hostile-bench"
TWILIO = "twilio-auth-token"
Counts = dict[str, int]


class Server:
    def __init__(self, callers: int, port: int | None = None) -> None:
        """Start the server, or (`port`) stand for the one running there (a probe's process)."""
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}"
        if port is not None:
            return
        env = {**os.environ, "REALTIME_OMNI_API_KEYS": KEY, "TWILIO_AUTH_TOKEN": TWILIO}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(self.port),
             "--max-sessions", str(callers + 24), "--config",
             str(ROOT / "configs" / "simulated-qwen3-omni.yaml")],
            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        while "serving" not in (line := self.proc.stdout.readline()):
            if not line and self.proc.poll() is not None:
                raise SystemExit("the server did not start")
        self.ps = psutil.Process(self.proc.pid)

    def rss_mb(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def mint(self) -> str:
        body = json.dumps({"session": {"type": "realtime"}}).encode()
        status, _, raw = http(
            "POST", f"{self.base}/v1/realtime/client_secrets", body, "application/json",
            {"Authorization": f"Bearer {KEY}"},
        )  # fmt: skip
        assert status == 200, raw
        return str(json.loads(raw)["value"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def count(counts: Counts, what: str) -> None:
    counts[what] = counts.get(what, 0) + 1


async def errors_of(ws: Any, counts: Counts, limit_s: float = 5.0) -> None:
    """Read the server's events until an `error` (counted by its code) or `limit_s`."""
    deadline = time.monotonic() + limit_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            ev = json.loads(await asyncio.wait_for(ws.recv(), left))
        except (TimeoutError, websockets.ConnectionClosed) as e:
            count(counts, type(e).__name__)
            return
        if ev.get("type") == "error":
            count(counts, ev["error"].get("code") or "error")
            return


# ---- the probes ----------------------------------------------------------------------------


def realtime(srv: Server) -> Any:
    """A `/v1/realtime` connection with a client secret of its own, as a page would hold."""
    return websockets.connect(
        f"{srv.ws}/v1/realtime", additional_headers=bearer(srv.mint()), max_size=None
    )


async def each_refused(srv: Server, until: float, counts: Counts, message: str, times: int) -> None:
    """Send `message` up to `times` times on one connection, counting each refusal."""
    async with realtime(srv) as ws:
        await ws.recv()
        for _ in range(times):
            if time.monotonic() > until:
                break
            await ws.send(message)
            await errors_of(ws, counts)


async def event_ids(srv: Server, until: float, counts: Counts) -> None:
    message = json.dumps({"type": "no.such.event", "event_id": "e" * (64 << 10)})
    await each_refused(srv, until, counts, message, 200)


async def json_nesting(srv: Server, until: float, counts: Counts) -> None:
    nested = '{"type": "session.update", "session": ' + "[]," * (500_000) + "[]}"
    await each_refused(srv, until, counts, nested, 50)


async def live_append(srv: Server, until: float, counts: Counts) -> None:
    audio = base64.b64encode(bytes([0xFF]) * (1 << 20)).decode()  # 1 MiB of G.711 silence
    start = {"type": "session.start", "session": {"model": "qwen3-omni",
             "audio": {"format": {"type": "audio/pcmu"}}}}  # fmt: skip
    secret = bearer(srv.mint())
    async with websockets.connect(f"{srv.ws}/v1/live/sessions", additional_headers=secret,
                                  max_size=None) as ws:  # fmt: skip
        await ws.send(json.dumps(start))

        async def read() -> None:
            async for raw in ws:
                ev = json.loads(raw)
                if ev.get("type") == "error":
                    count(counts, ev["error"].get("code") or "error")

        reader = asyncio.ensure_future(read())
        sent = 0
        while time.monotonic() < until and sent < 400:
            await ws.send(json.dumps({"type": "session.input_audio.append", "audio": audio}))
            sent += 1
            await asyncio.sleep(0.02)
        counts["appends_sent"] = sent
        reader.cancel()


async def settings_echo(srv: Server, until: float, counts: Counts) -> None:
    big = {"type": "session.update", "session": {"instructions": "i" * (400 << 10)}}
    tool = {"type": "function", "name": "t", "parameters": {"description": "d" * (400 << 10)}}
    async with realtime(srv) as ws:
        await ws.recv()
        await ws.send(json.dumps(big))
        await ws.send(json.dumps({"type": "session.update", "session": {"tools": [tool]}}))
        await errors_of(ws, counts)
        largest = 0
        for _ in range(200):
            if time.monotonic() > until:
                break
            await ws.send('{"type":"session.update","session":{}}')
            while (ev := await ws.recv()) and json.loads(ev)["type"] != "session.updated":
                pass
            largest = max(largest, len(ev))
        counts["largest_echo_kib"] = largest >> 10


async def offers(srv: Server, until: float, counts: Counts) -> None:
    sdp = await sdp_offer()
    head, rest = sdp.split("\r\na=mid:", 1)
    lines = "".join(f"\r\na=candidate:{i} 1 udp 1 10.9.0.{i + 1} 9 typ host" for i in range(100))
    secret = srv.mint()  # a browser's: each offer is refused before it takes a session
    variants = [sdp + "a=x-pad:" + "p" * (300 << 10) + "\r\n", head + lines + "\r\na=mid:" + rest]
    while time.monotonic() < until and sum(counts.values()) < 200:
        for body in variants:
            live = json.dumps({"session": {"model": "qwen3-omni"},
                               "transport": {"type": "webrtc", "sdp": body}}).encode()  # fmt: skip
            for path, data, kind in (("/v1/live/sessions", live, "application/json"),
                                     ("/v1/whip", body.encode(), "application/sdp")):  # fmt: skip
                status, _, _ = await asyncio.to_thread(
                    http, "POST", f"{srv.base}{path}", data, kind, bearer(secret)
                )
                count(counts, str(status))


async def phone_unsigned(srv: Server, until: float, counts: Counts) -> None:
    held = []
    for _ in range(40):
        try:
            ws = await websockets.connect(f"{srv.ws}/v1/phone/telnyx")
            held.append(ws)
        except websockets.InvalidStatus as e:
            count(counts, f"telnyx_{e.response.status_code}")
    await asyncio.sleep(0.5)
    for ws in held:
        code = ws.close_code
        count(counts, "telnyx_open" if code is None else f"telnyx_closed_{code}")
    for _ in range(20):
        try:
            async with websockets.connect(f"{srv.ws}/v1/phone/twilio"):
                count(counts, "twilio_accepted")
        except websockets.InvalidStatus as e:
            count(counts, f"twilio_{e.response.status_code}")
    while time.monotonic() < until:
        await asyncio.sleep(0.1)  # hold the sockets for the probe's time
    for ws in held:
        await ws.close()


async def bad_host(srv: Server, until: float, counts: Counts) -> None:
    url = "http://localhost:99999/v1/phone/twilio/voice"
    headers = {"Host": "localhost:99999", "X-Twilio-Signature": twilio_signature(TWILIO, url, {})}
    for _ in range(100):
        if time.monotonic() > until:
            break
        status, _, _ = await asyncio.to_thread(
            http, "POST", f"{srv.base}/v1/phone/twilio/voice?token={KEY}", b"CallSid=CA1",
            "application/x-www-form-urlencoded", headers,
        )  # fmt: skip
        count(counts, str(status))


async def secret_reuse(srv: Server, until: float, counts: Counts) -> None:
    secret = await asyncio.to_thread(srv.mint)
    for token in (secret, secret, None, "ek_made_up"):
        try:
            async with websockets.connect(
                f"{srv.ws}/v1/realtime", additional_headers=bearer(token)
            ) as ws:
                ev = json.loads(await ws.recv())
                count(counts, ev["error"]["code"] if ev["type"] == "error" else ev["type"])
        except websockets.InvalidStatus as e:
            count(counts, str(e.response.status_code))
        await asyncio.sleep(0.3)  # the closed session let go of its place


async def nothing(srv: Server, until: float, counts: Counts) -> None:
    await asyncio.sleep(max(0.0, until - time.monotonic()))


PROBES: dict[str, Callable[[Server, float, Counts], Awaitable[None]]] = {
    "none": nothing,  # the honest calls alone: the baseline of the same run
    "event_ids": event_ids,
    "json_nesting": json_nesting,
    "live_append": live_append,
    "settings_echo": settings_echo,
    "offers": offers,
    "phone_unsigned": phone_unsigned,
    "bad_host": bad_host,
    "secret_reuse": secret_reuse,
}


# ---- the honest callers and the watch ------------------------------------------------------


async def honest(srv: Server, speech: np.ndarray, stop: asyncio.Event) -> Caller:
    caller = Caller(srv.base, listen=False)
    await caller.connect(token=await asyncio.to_thread(srv.mint))

    async def talk() -> None:
        while not stop.is_set():
            t = time.monotonic()
            caller.mic.say(speech)
            with contextlib.suppress(TimeoutError):
                await caller.wait_for("response.done", limit_s=20, since=t)
            await asyncio.sleep(0.5)

    caller._tasks.append(asyncio.ensure_future(talk()))
    return caller


def frames_sent(srv: Server) -> tuple[int, int]:
    """(frames, frames late) the server's WebRTC tracks have sent, as it counts them."""
    status, _, raw = http("GET", f"{srv.base}/v1/stats", None, None, bearer(KEY))
    webrtc = json.loads(raw)["webrtc"] if status == 200 else {}
    return int(webrtc.get("frames", 0)), int(webrtc.get("frames_late", 0))


async def watch(srv: Server, stop: asyncio.Event, healthz: list[float], rss: list[float]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.to_thread(http, "GET", f"{srv.base}/healthz")
        healthz.append((time.monotonic() - t) * 1000)
        rss.append(srv.rss_mb())
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    spoken = espeak("What is the weather like in Paris today?")
    if spoken is None:
        raise SystemExit("espeak-ng is not installed")
    speech = resample(spoken[0], spoken[1], 48000)
    srv = Server(args.callers)
    os.nice(args.caller_nice)  # the callers (this process), after the server started
    stop = asyncio.Event()
    rows = []
    try:
        callers = [await honest(srv, speech, stop) for _ in range(args.callers)]
        await asyncio.sleep(args.settle_s)  # the calls under way
        for name in args.probes.split(","):
            before = srv.rss_mb()
            healthz: list[float] = []
            rss: list[float] = []
            done = asyncio.Event()
            watcher = asyncio.ensure_future(watch(srv, done, healthz, rss))
            sent = await asyncio.to_thread(frames_sent, srv)
            counts = await probe_apart(srv, name, args.probe_s)
            after = await asyncio.to_thread(frames_sent, srv)
            frames, late = after[0] - sent[0], after[1] - sent[1]
            done.set()
            await watcher
            await asyncio.sleep(args.settle_s)  # then what it left: RSS back
            row = {
                "name": name,
                "honest_late_frame_ratio": round(late / frames, 4) if frames else None,
                "frames": frames,
                "healthz_worst_ms": round(max(healthz, default=0.0), 1),
                "healthz_p50_ms": round(statistics.median(healthz), 1) if healthz else None,
                "rss_growth_mb": round(max(rss, default=before) - before, 1),
                "rss_after_mb": round(srv.rss_mb() - before, 1),
                "status": counts,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        stop.set()
        for c in callers:
            await c.hang_up()
    finally:
        srv.stop()
    return rows


async def probe_apart(srv: Server, name: str, probe_s: float) -> Counts:
    """Run probe `name` in a process of its own (the attacker is not the honest callers' host:
    its work must not delay their frames here); what it counted."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--probe", name, "--port", str(srv.port),
        "--probe-s", str(probe_s), stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), probe_s + 60)
    lines = out.decode().strip().splitlines()
    return json.loads(lines[-1]) if lines else {"probe_failed": proc.returncode or -1}


async def probe(name: str, port: int, probe_s: float) -> Counts:
    """In the probe's own process: run it against the server on `port`."""
    counts: Counts = {}
    try:
        until = time.monotonic() + probe_s
        await asyncio.wait_for(PROBES[name](Server(0, port), until, counts), probe_s + 30)
    except Exception as e:  # a probe that broke says so in its row
        count(counts, f"probe_failed: {type(e).__name__}: {e}"[:120])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--probe-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--caller-nice", type=int, default=10)
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # in a probe's own process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(asyncio.run(probe(args.probe, args.port, args.probe_s))))
        return
    rows = asyncio.run(run(args))
    late = [r for r in rows if (r["honest_late_frame_ratio"] or 0) > 0.01
            or r["healthz_worst_ms"] > 100 or r["rss_growth_mb"] > 200]  # fmt: skip
    print(
        f"{len(rows) - len(late)} of {len(rows)} probes within the targets",
        *(r["name"] for r in late),
    )
    if args.json:
        args.json.write_text(json.dumps({"probes": rows}, indent=2))


if __name__ == "__main__":
    main()
