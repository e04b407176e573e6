"""Gateway soak: polite callers beside misbehaving ones, for a bounded time; afterwards the server
is back where it started.

Starts `realtime-omni serve` on the simulated config and, for `--seconds`, keeps `--polite`
WebSocket callers asking questions (speech appended in real-time 20 ms pieces, server VAD, the
answer read to its `response.done`) and `--typists` typing theirs (a third cancelled once their
audio starts), while `--rude` others misbehave in turn:

- a message over the size limit, then JSON that does not parse, JSON nested 100,000 deep, an
  event that is not an object, an unknown event type, a bad base64 append;
- one valid append of 4 MiB of audio and a 4000x4000 PNG in `conversation.item.create`;
- a call that vanishes mid-turn (the socket dropped while its answer streams);
- a call that never reads (its send buffer fills until the server drops it);
- requests each of the server's bounds must refuse, with the error that names it
  (`REFUSED_WITH`): a call's form of 15,000 parts (`POST /v1/realtime/calls`), an image over
  the pixel bound (a 7,000 x 7,000 PNG of zeros, 0.2 MB on the wire), audio appended faster
  than real time past the first burst, an offer with 800 m= lines (`POST /v1/webrtc/offer`).

With `--kill-every S`, a random stage process is SIGKILLed every S seconds as well (the server
restarts it, from its warm spare where the config has one).

Every polite turn must end with a completed response, or, when a stage it was on was killed,
with a failed one whose error says so; each rude client must get `error` events (or be dropped)
and never take the server down; each bounded request must be refused with its own error, in the
warm-up and in the rounds alike. The baseline is taken after one caller of each kind (what the
server keeps once used, its executor's worker threads, is in it). The run is cut into
`--rounds`; after each, with every caller gone: no session, nothing in flight, every credit
free, the gateway's threads, file descriptors and UDP sockets and the shared-memory segments as
before, and RSS no higher than after the first round by more than `RSS_SLACK` (the first round
finds the allocator's high-water mark; a leak grows every round).

    python benchmarks/soak_gateway.py [--seconds 60] [--rounds 3] [--polite 4] [--typists 4]
                                      [--rude 2] [--kill-every S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from functools import cache
from pathlib import Path
from typing import Any

import psutil
import websockets
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.clients.webrtc import espeak, http  # noqa: E402
from realtime_omni.gateway.media.audio import float_to_pcm16, resample  # noqa: E402

PIECE = 960  # bytes: 20 ms of 24 kHz pcm16
RESUME_WINDOW_S = 3.0  # a vanished caller's session waits this long for it to come back
RSS_SLACK = 0.10  # of the first round's RSS: what heavy callers at random moments vary it by
# Each request a bound must refuse, and the error code that says which bound.
REFUSED_WITH = {
    "form": "too_large",  # a call's form past its parts
    "pixels": "image_too_large",
    "fast": "rate_limit_exceeded",  # audio past the burst, faster than real time
    "offer": "too_many_media_sections",
}
KINDS = ["garbage", "heavy", "vanish", "deaf", *REFUSED_WITH]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/stats", timeout=10) as r:
        return dict(json.loads(r.read()))


async def idle(url: str, limit_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:
        st = await asyncio.to_thread(stats, url)
        done = (
            st["sessions"] == 0 and st["in_flight"] == 0 and st["free_slots"] == st["total_slots"]
        )
        if done or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.05)  # not a stats request back to back with the server it measures


async def polite(url: str, speech: bytes, stop: float, out: dict[str, int]) -> None:
    """Questions until `stop`, each answer read to its end."""
    async with websockets.connect(url, max_size=1 << 24) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": 6}}))
        while time.monotonic() < stop:
            audio = speech + bytes(48000)  # the question, then 1 s of silence
            for i in range(0, len(audio), PIECE):
                piece = base64.b64encode(audio[i : i + PIECE]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
                await asyncio.sleep(0.02)
            response = await answer(ws, out)
            out["turns"] += 1
            out["completed"] += response["status"] == "completed"
            out["failed_clearly"] += failed_clearly(response)


async def answer(ws: Any, out: dict[str, int], cancel: bool = False) -> dict[str, Any]:
    """Read one answer to its `response.done` (counting `error`s; with `cancel`, cancelling it
    once its audio starts); gives its response."""
    deadline = time.monotonic() + 20
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic())))
        # A stage that died fails the response, and its `error` (response_failed) says so beside
        # the failed response.done: a clear failure. Any other error refused a polite caller.
        if ev["type"] == "error" and ev["error"].get("code") != "response_failed":
            out["polite_errors"] += 1
        if ev["type"] == "response.done":
            return dict(ev["response"])
        if cancel and ev["type"] == "response.output_audio.delta":
            await ws.send(json.dumps({"type": "response.cancel"}))
            cancel = False


def failed_clearly(response: dict[str, Any]) -> bool:
    """A response that failed because a stage died, and says so."""
    error = (response.get("status_details") or {}).get("error") or {}
    return response["status"] == "failed" and "died" in str(error.get("message", ""))


async def typist(url: str, stop: float, out: dict[str, int], seed: int) -> None:
    """Typed questions until `stop`, a third of them cancelled once their audio starts."""
    rng = random.Random(seed)
    text = {"type": "input_text", "text": "What is the weather like today?"}
    item = {"type": "message", "role": "user", "content": [text]}
    async with websockets.connect(url, max_size=1 << 24) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"max_output_tokens": 6}}))
        while time.monotonic() < stop:
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
            await ws.send(json.dumps({"type": "response.create"}))
            response = await answer(ws, out, cancel=rng.random() < 1 / 3)
            out["typed"] += 1
            out["typed_ended_well"] += response["status"] in ("completed", "cancelled")
            out["typed_ended_well"] += failed_clearly(response)


async def rude_once(url: str, kind: str, out: dict[str, int]) -> None:
    # A deaf caller never reads the server's close frame: without a short close_timeout its
    # own close would wait 10 s (websockets' default) for it, the server long done with it.
    try:
        async with websockets.connect(url, max_size=1 << 24, close_timeout=1.0) as ws:
            if kind == "garbage":
                for msg in (
                    "x" * (9 << 20),
                    "{not json",
                    "[" * 100_000 + "]" * 100_000,
                    "[1, 2, 3]",
                    json.dumps({"type": "no.such.event"}),
                    json.dumps({"type": "input_audio_buffer.append", "audio": "!!!"}),
                ):
                    await ws.send(msg)
                for _ in range(6):
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
                    out["rude_errors"] += ev["type"] == "error"
            elif kind == "heavy":
                # 4 MiB: 87 s of audio, under the burst (130 s) and, in base64 and JSON, under
                # the message bound (8 MiB); 6 MiB was over both and refused
                big = base64.b64encode(bytes(4 << 20)).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": big}))
                await ws.send(json.dumps({"type": "conversation.item.create", "item": png_item()}))
                await asyncio.sleep(1.0)
            elif kind == "vanish":
                await ws.send(json.dumps({"type": "response.create"}))
                await asyncio.sleep(random.uniform(0.05, 0.6))
                ws.transport.abort()  # no close handshake: the socket just goes
            elif kind == "deaf":
                await ws.send(json.dumps({"type": "session.update", "session": {}}))
                for _ in range(3):
                    await ws.send(json.dumps({"type": "response.create"}))
                    await asyncio.sleep(0.5)
                ws.transport.pause_reading()  # reads nothing more
                await asyncio.sleep(3.0)
            elif kind in REFUSED_WITH:
                refused(kind, await bounded_request(ws, url, kind), out)
        out["rude_" + kind] += 1
    except (websockets.ConnectionClosed, OSError, TimeoutError):
        out["rude_dropped"] += 1


def refused(kind: str, code: str | None, out: dict[str, int]) -> None:
    """Count a bounded request refused with its own error, or one that was not."""
    if code == REFUSED_WITH[kind]:
        out["rude_errors"] += 1
        out["refused_" + kind] += 1
    else:
        out["not_refused"] += 1
        print(f"soak_gateway: {kind} got {code!r}, not {REFUSED_WITH[kind]!r}", flush=True)


async def bounded_request(ws: Any, url: str, kind: str) -> str | None:
    """Send what the bound `kind` must refuse; the error code that came back, None for none."""
    base = url.replace("ws://", "http://").removesuffix("/v1/realtime")
    if kind in ("form", "offer"):
        if kind == "form":  # 15,000 parts in under the body's 1 MiB
            boundary = "rto-soak"
            part = f'--{boundary}\r\nContent-Disposition: form-data; name="x"\r\n\r\ny\r\n'
            body = (part * 15_000 + f"--{boundary}--\r\n").encode()
            args = ("/v1/realtime/calls", body, f"multipart/form-data; boundary={boundary}")
        else:
            sdp = "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n"
            sdp += "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\n" * 800
            body = json.dumps({"sdp": sdp, "type": "offer"}).encode()
            args = ("/v1/webrtc/offer", body, "application/json")
        status, _, reply = await asyncio.to_thread(http, "POST", base + args[0], *args[1:])
        code = json.loads(reply).get("error", {}).get("code") if status >= 400 else None
        return str(code) if status in (400, 413) and code else None
    if kind == "pixels":
        await ws.send(json.dumps({"type": "conversation.item.create", "item": bomb_item()}))
    else:  # 10 s appends, back to back, until one is refused (past the burst of 130 s)
        await ws.send(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        ten_s = base64.b64encode(bytes(PIECE * 500)).decode()
        for _ in range(20):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": ten_s}))
    deadline = time.monotonic() + 10
    with contextlib.suppress(TimeoutError):  # taken, not refused
        while True:
            left = max(0.1, deadline - time.monotonic())
            ev = json.loads(await asyncio.wait_for(ws.recv(), left))
            if ev["type"] == "error":
                return str(ev["error"].get("code"))
    return None


def png_item() -> dict[str, Any]:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_image", "image_url": url}],
    }


@cache
def bomb_item() -> dict[str, Any]:
    """A 7,000 x 7,000 RGB PNG of zeros (49 MP, over the 40 MP bound): 0.2 MB on the wire,
    147 MB decoded."""
    width = height = 7000
    z = zlib.compressobj(9)
    row = bytes(1 + 3 * width)  # filter byte, then the pixels
    data = b"".join(z.compress(row * 100) for _ in range(height // 100)) + z.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "input_image", "image_url": url}]
    return {"type": "message", "role": "user", "content": content}


async def rude(url: str, stop: float, out: dict[str, int], seed: int) -> None:
    """The kinds of misbehaviour in turn, each rude caller starting at another."""
    i = seed
    while time.monotonic() < stop:
        await rude_once(url, KINDS[i % len(KINDS)], out)
        i += 1


async def killer(base: str, stop: float, every_s: float, out: dict[str, int]) -> None:
    """SIGKILL a random stage process every `every_s` until `stop`."""
    rng = random.Random(7)
    while time.monotonic() + every_s < stop:
        await asyncio.sleep(every_s)
        pids = [p for p in (await asyncio.to_thread(stats, base))["pids"].values() if p]
        if pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(pids), signal.SIGKILL)
                out["kills"] += 1


def segments(server_pid: int) -> int:
    return sum(1 for _ in Path("/dev/shm").glob(f"rto_{server_pid}_*"))


async def main(args: argparse.Namespace) -> dict[str, Any]:
    spoken = espeak("What is the weather like today?")
    if spoken is None:
        raise SystemExit("espeak-ng is not installed")
    speech = float_to_pcm16(resample(spoken[0], spoken[1], 24000))
    port = free_port()
    # A caller that vanishes leaves its session waiting for a resume (`resume_window_s`): a
    # short window here, so that "nothing left" is checked after it ended.
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["realtime"] = {**cfg.get("realtime", {}), "resume_window_s": RESUME_WINDOW_S}
    config = Path(tempfile.mkdtemp()) / "soak.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(port),
         "--max-sessions", str(args.polite + args.typists + args.rude + 2),
         "--config", str(config)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    while "serving" not in (line := proc.stdout.readline()):
        if not line and proc.poll() is not None:
            raise SystemExit("the server did not start")
    base = f"http://127.0.0.1:{port}"
    url = f"ws://127.0.0.1:{port}/v1/realtime"
    server = psutil.Process(proc.pid)
    try:
        # Warm-up: one of each caller, so that what the server keeps for good once used (the
        # worker threads of its executor, the decoders' buffers) is in the baseline.
        out = dict.fromkeys(
            ["turns", "completed", "failed_clearly", "typed", "typed_ended_well",
             "polite_errors", "kills", "rude_errors", "rude_dropped", "not_refused",
             *(f"rude_{k}" for k in KINDS), *(f"refused_{k}" for k in REFUSED_WITH)], 0,
        )  # fmt: skip
        warm = dict(out)
        for kind in KINDS:
            await rude_once(url, kind, warm)
        await polite(url, speech, time.monotonic() + 0.1, warm)
        before = await idle(base)
        rss = [server.memory_info().rss]
        shm = [segments(proc.pid)]
        t0 = time.monotonic()
        for _ in range(args.rounds):
            stop = time.monotonic() + args.seconds / args.rounds
            tasks = [polite(url, speech, stop, out) for _ in range(args.polite)]
            tasks += [typist(url, stop, out, seed) for seed in range(args.typists)]
            tasks += [rude(url, stop, out, seed) for seed in range(args.rude)]
            if args.kill_every:
                tasks.append(killer(base, stop, args.kill_every, out))
            await asyncio.gather(*tasks)
            after = await idle(base)
            await asyncio.sleep(2.5)  # the heap is trimmed within 2 s of a session's end
            rss.append(server.memory_info().rss)
            shm.append(segments(proc.pid))
        elapsed = time.monotonic() - t0
        assert proc.poll() is None, "the server died"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    g0, g1 = before["gateway_process"], after["gateway_process"]
    # The event loop's worker pool grows to its bound as work needs and keeps its threads: not
    # a leak; every other thread must have gone.
    g0 = {**g0, "threads": g0["threads"] - g0["pool_threads"]}
    g1 = {**g1, "threads": g1["threads"] - g1["pool_threads"]}
    leaks = {k: (g0[k], g1[k]) for k in ("threads", "fds", "udp_sockets") if g1[k] > g0[k]}
    if shm[-1] != shm[0]:
        leaks["segments"] = (shm[0], shm[-1])
    if len(rss) > 2 and rss[-1] > rss[1] * (1 + RSS_SLACK):
        leaks["rss_mb"] = (round(rss[1] / 2**20, 1), round(rss[-1] / 2**20, 1))
    left = {
        "sessions": after["sessions"],
        "in_flight": after["in_flight"],
        "slots_lent": sum(after["total_slots"].values()) - sum(after["free_slots"].values()),
    }
    ended_well = out["completed"] + out["failed_clearly"] == out["turns"] > out["failed_clearly"]
    ended_well &= out["typed_ended_well"] == out["typed"]
    # Each bound refused what it bounds, with its error: in the warm-up (one of each) and after.
    refusals = {k: warm[f"refused_{k}"] + out[f"refused_{k}"] for k in REFUSED_WITH}
    not_refused = warm["not_refused"] + out["not_refused"]
    refused_all = not_refused == 0 and all(refusals.values())
    clean = not leaks and not any(left.values()) and ended_well and refused_all
    return {
        "seconds": round(elapsed, 1),
        **out,
        "refused": refusals,  # the warm-up's included
        "not_refused": not_refused,
        "left": left,
        "leaks": leaks,
        "gateway_before": before["gateway_process"],
        "gateway_after": after["gateway_process"],
        "rss_mb": [round(r / 2**20, 1) for r in rss],  # at the start and after each round
        "segments": shm,
        "clean": clean,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kill-every", type=float, default=0.0, help="seconds; 0: no stage killed")
    p.add_argument("--polite", type=int, default=4)
    p.add_argument("--typists", type=int, default=4)
    p.add_argument("--rude", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args()
    result = asyncio.run(main(a))
    for k, v in result.items():
        print(f"{k:16} {v}")
    print("soak_gateway: clean" if result["clean"] else "soak_gateway: NOT CLEAN")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["clean"] else 1)
