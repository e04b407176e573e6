"""Gateway latency over a WebRTC loopback call: token -> audio leaving, first audio, barge-in,
abort, and late output frames with 1, 4 and 16 (`--sessions`) concurrent calls.

For each config the script starts a server (this script in `--serve` mode: the real app on
uvicorn in its own process, plus a `/bench/raw` route that hands over the raw timings) and calls
it with the aiortc caller of `realtime_omni.clients.webrtc`, which speaks espeak-ng speech
into its microphone track in real time:

- one call, `--turns` turns, preemptive answers off (`preemptive_ms: null`: an answer starts
  when the turn ends, so a token's audio is never held back, and the token -> audio figures are
  the runtime's own): speech, the answer starts, plays `HOLD_S`, then the caller talks over it
  (barge-in). Measured on the server: thinker token -> its first audio frame handed to
  aiortc (an answer's first token, and every token whose audio found the playout queue empty),
  raw and minus the model compute on that path (the talker and code2wav steps between the
  token and the frame, from the stages' step logs); speech stop detected -> first frame out;
  barge-in detected -> first silent frame out; abort acknowledged by every stage. Measured on the
  caller: end of its speech (the last sample sent) -> first audible frame received.
- the same call again with preemptive answers on (`PREEMPTIVE_MS`, the default): what they do to
  the caller's end of speech -> heard, in a row of its own.
- phone calls, `--turns` utterances each, every one after the first talking over the answer
  to the one before: over the Twilio bridge (the scripted provider of
  `realtime_omni.clients.media_stream`) the caller's end of speech -> first `media` received,
  and its speech onset -> `clear` received; over SIP (baresip calling, recording both
  directions) end of speech -> first audible RTP frame, and onset -> the RTP audio silent.
- n = 1, 4, 16 calls (`--sessions`) at once for `--seconds` each, every call talking and
  cancelling answers: the share of output frames that left more than one frame period after
  their due time. The callers stand for people on their own devices, but here they share the
  server's two cores: they run at niceness `--caller-nice` (default 10, the stages' own), so
  that they take what the server leaves instead of half of it (0 shares the cores evenly).

    python benchmarks/latency.py [--configs simulated,tiny] [--turns 8] [--seconds 10]
                                 [--sessions 1,4,16] [--caller-nice 10] [--loop uvloop]
                                 [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni import aio  # noqa: E402
from realtime_omni.clients import baresip  # noqa: E402
from realtime_omni.clients.media_stream import ProviderCall  # noqa: E402
from realtime_omni.clients.webrtc import Caller, espeak, http  # noqa: E402
from realtime_omni.gateway.media.audio import resample  # noqa: E402
from realtime_omni.pipeline.worker import freeze_start_up  # noqa: E402

CONFIGS = {
    "simulated": ROOT / "configs/simulated-qwen3-omni.yaml",
    "tiny": ROOT / "configs/tiny.yaml",
}
HOLD_S = 0.6  # the answer plays this long before the caller barges in
PREEMPTIVE_MS = 160  # turn_detection.preemptive_ms's default
LOUD = 0.02  # a received frame with a peak above this is audible
HANG_UP_S = 10.0  # a hang-up that takes longer is given up (aiortc can stall closing)
TARGETS = {  # DESIGN.md budgets
    "token_to_audio_over_compute_ms": {"p50": 10.0, "p99": 25.0},
    "barge_in_to_silence_ms": {"p99": 20.0},
    "abort_ack_ms": {"p99": 10.0},
}


# ---- server side (`--serve`) -----------------------------------------------------------


def serve(config: str, port: int, stage_nice: int | None, sip_port: int | None, loop: str) -> None:
    import uvicorn
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from realtime_omni.gateway.app import create_app
    from realtime_omni.gateway.config import GatewayConfig, PhoneConfig, SipConfig
    from realtime_omni.pipeline.config import load_config

    phone = {"idle_timeout_s": None, "routes": {"default": {"session": {"max_output_tokens": 40}}}}
    gw_cfg = GatewayConfig(
        max_sessions=32,
        ice_host_addresses=["127.0.0.1"],
        phone=PhoneConfig.model_validate(phone),
        sip=None if sip_port is None else SipConfig(port=sip_port),
    )
    cfg = load_config(config)
    if stage_nice is not None:
        cfg = cfg.model_copy(
            update={"runtime": cfg.runtime.model_copy(update={"stage_nice": stage_nice})}
        )
    app = create_app(cfg, gw_cfg)

    async def raw(request: Request) -> Response:
        gw, calls = app.state.gateway, app.state.webrtc
        steps: dict[str, list[Any]] = {}
        for st in (await gw.coord.stats()).values():
            for stage, log in st.steps.items():
                steps.setdefault(stage, []).extend(log)
        metrics: dict[str, list[float]] = {k: list(v) for k, v in gw.metrics.items()}
        for s in gw.sessions:
            for k, v in s.metrics.items():
                metrics.setdefault(k, []).extend(v)
        chunks = [c for call in calls.calls.values() for c in call.track.chunk_log]
        late = [x for call in calls.calls.values() for x in call.track.lateness_ms]
        return JSONResponse(
            {
                "steps": steps,
                "metrics": metrics,
                "chunks": chunks,
                "lateness_ms": late,
                "webrtc": calls.stats(),
            }
        )

    app.add_route("/bench/raw", raw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        freeze_start_up()  # as `realtime-omni serve` does once up: no full passes over start-up
        print("ready", flush=True)
        await task

    aio.run(main(), loop)  # `realtime-omni serve`'s default unless --loop says otherwise


# ---- caller side -----------------------------------------------------------------------


def speech_48k() -> np.ndarray:
    spoken = espeak("Hello, how are you today?")
    if spoken is None:
        sys.exit("espeak-ng is not installed (apt-get install espeak-ng)")
    x, rate = spoken
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return resample(x[: loud[-1] + 1], rate, 48000)  # end where the voice ends


def get(url: str) -> Any:
    status, _, body = http("GET", url)
    if status != 200:
        raise RuntimeError(f"GET {url}: {status} {body[:200]!r}")
    return json.loads(body)


def pct(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "n": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2), "n": len(values)}


def compute_ms(steps: dict[str, list[list[float]]], token_time: float, left: float) -> float:
    """Model compute between a thinker token and its first frame leaving (one call at a time):
    the last code2wav step that ended before the frame left, plus the talker steps that ran
    between the token and that step."""
    c2w = [(s, d) for s, d in steps.get("code2wav", []) if s >= token_time and s + d <= left]
    if not c2w:
        raise RuntimeError("no code2wav step between a token and its audio: step log incomplete")
    c_start, c_dur = c2w[-1]
    talker = [d for s, d in steps.get("talker_ar", []) if s >= token_time and s + d <= c_start]
    return (sum(talker) + c_dur) * 1e3


async def set_turns(caller: Caller, on: bool, tokens: int, preemptive_ms: int | None) -> None:
    """Server VAD on; `on` False: a turn it detects gets no answer (the talk-over speech)."""
    td = {"type": "server_vad", "create_response": on, "preemptive_ms": preemptive_ms}
    caller.send(
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "max_output_tokens": tokens,
                "audio": {"input": {"turn_detection": td}},
            },
        }
    )
    await caller.wait_for("session.updated", 10, since=time.monotonic() - 0.001)


async def one_call(
    url: str, speech: np.ndarray, turns: int, tokens: int, preemptive_ms: int | None = None
) -> dict[str, Any]:
    caller = Caller(url)
    await caller.connect(limit_s=30)
    heard: list[float] = []
    steps: dict[str, set[tuple[float, float]]] = {}  # stage -> (start, duration) of every step
    try:
        await asyncio.sleep(0.5)
        for _ in range(turns):
            await set_turns(caller, True, tokens, preemptive_ms)
            caller.mic.say(speech)
            await caller.wait_for("response.created", 30, since=time.monotonic())
            await caller.wait_for("output_audio_buffer.started", 60)
            end = caller.mic.speech_ended_at
            await set_turns(caller, False, tokens, preemptive_ms)  # talking over it: no answer
            await asyncio.sleep(HOLD_S)  # the audio also passes the caller's jitter buffer
            first = next((t for t, p in caller.frames if end and t > end and p > LOUD), None)
            if end is not None and first is not None:
                heard.append((first - end) * 1e3)
            t_talk = time.monotonic()
            caller.mic.say(speech)  # talk over the answer, past min_interruption_ms
            await caller.wait_for("input_audio_buffer.speech_started", 15, since=t_talk)
            await caller.wait_for("response.done", 15, since=t_talk)
            while caller.mic.queued_s > 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            # Each turn's steps now: the stages remember only their last 512 steps.
            raw = await asyncio.to_thread(get, f"{url}/bench/raw")
            for stage, log in raw["steps"].items():
                steps.setdefault(stage, set()).update(map(tuple, log))
        raw["steps"] = {stage: sorted(log) for stage, log in steps.items()}
        return {"raw": raw, "heard_ms": heard}
    finally:
        await caller.hang_up()


async def busy_call(url: str, speech: np.ndarray, until: float, tokens: int) -> int:
    """Talk, let the answer play a second, cancel it, again, until `until`: answers heard."""
    caller = Caller(url, listen=False)  # late frames are counted on the server
    answers = 0
    try:
        await caller.connect(limit_s=60)
        await set_turns(caller, True, tokens, None)
        while time.monotonic() < until:
            caller.mic.say(speech)
            try:
                await caller.wait_for("output_audio_buffer.started", 30, since=time.monotonic())
                answers += 1
                await asyncio.sleep(1.0)
                t_cancel = time.monotonic()
                caller.send({"type": "response.cancel"})
                await caller.wait_for("response.done", 15, since=t_cancel)
            except TimeoutError:
                pass
    finally:
        await asyncio.wait_for(caller.hang_up(), HANG_UP_S)
    return answers


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU time so far of the callers (this process), the gateway (the server process) and the
    stage processes (its children)."""

    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    server = psutil.Process(server_pid)
    stages = 0.0
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            stages += used(child)
    return {"callers": used(psutil.Process()), "gateway": used(server), "stages": stages}


async def concurrent(
    url: str, speech: np.ndarray, n: int, seconds: float, tokens: int, server_pid: int
) -> tuple[float, dict[str, float], int]:
    """The late-frame ratio of n busy calls, each side's CPU over the window (cores), and the
    answers the calls heard start (the work done: a starved model answers fewer turns)."""
    before = (await asyncio.to_thread(get, f"{url}/v1/stats"))["webrtc"]
    cpu0, t0 = cpu_seconds(server_pid), time.monotonic()
    until = time.monotonic() + seconds
    calls = [busy_call(url, speech, until, tokens) for _ in range(n)]
    # One call failing must not tear down the others mid-call.
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [e for e in results if isinstance(e, BaseException)]
    answers = sum(r for r in results if isinstance(r, int))
    for e in errors:
        print(f"  a call failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    await asyncio.sleep(0.5)
    after = (await asyncio.to_thread(get, f"{url}/v1/stats"))["webrtc"]
    cpu1, wall = cpu_seconds(server_pid), time.monotonic() - t0
    frames = after["frames"] - before["frames"]
    cores = {k: round((cpu1[k] - cpu0[k]) / wall, 3) for k in cpu0}
    return (after["frames_late"] - before["frames_late"]) / max(1, frames), cores, answers


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PHONE_GAP_S = 1.8  # after each utterance: the answer starts, plays about a second, is cut
PHONE_LOUD = int(LOUD * 32768)


def phone_script(speech48: np.ndarray, turns: int) -> list[np.ndarray]:
    """0.5 s of silence, then `turns` times: the utterance and the gap after it (8 kHz)."""
    say = resample(speech48, 48000, 8000)
    gap = np.zeros(int(PHONE_GAP_S * 8000), np.float32)
    return [np.zeros(4000, np.float32)] + [x for _ in range(turns) for x in (say, gap)]


async def twilio_call(url: str, speech48: np.ndarray, turns: int) -> dict[str, list[float]]:
    call = ProviderCall(url, "twilio")
    await call.connect()
    try:
        for part in phone_script(speech48, turns):
            call.say(part)
        while call.saying:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
    finally:
        await call.hang_up()
    spoken = call.utterances[1::2]  # the speech, not the silences between
    heard, cleared = [], []
    for i, (start, end) in enumerate(spoken):
        media = [t for t, _ in call.received if t > end]
        if media and (i + 1 == len(spoken) or media[0] < spoken[i + 1][0]):
            heard.append((media[0] - end) * 1e3)
        if i:
            clear = [t for t in call.clears if t > start]
            if clear and clear[0] < end + PHONE_GAP_S:
                cleared.append((clear[0] - start) * 1e3)
    return {"heard_ms": heard, "clear_ms": cleared}


def sip_call(port: int, speech48: np.ndarray, turns: int) -> dict[str, list[float]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        mic = Path(tmp) / "mic.wav"
        baresip.write_wav(mic, np.concatenate(phone_script(speech48, turns)))
        seconds = int(0.5 + turns * (len(speech48) / 48000 + PHONE_GAP_S)) + 2
        proc = baresip.dial(Path(tmp) / "call", f"sip:bot@127.0.0.1:{port}", mic, seconds)
        proc.wait(timeout=seconds + 30)
        sent, got = baresip.recordings(Path(tmp) / "call")
    said, heard = baresip.loud(sent, PHONE_LOUD), baresip.loud(got, PHONE_LOUD)
    frame_ms = 20
    # utterances: loud runs of what baresip sent, merged over gaps shorter than 400 ms
    runs: list[list[int]] = []
    for i, x in enumerate(said):
        if x and runs and i - runs[-1][1] <= 20:
            runs[-1][1] = i
        elif x:
            runs.append([i, i])
    out: dict[str, list[float]] = {"heard_ms": [], "clear_ms": []}
    for k, (start, end) in enumerate(runs):
        nxt = runs[k + 1][0] if k + 1 < len(runs) else len(heard)
        first = next((i for i in range(end + 1, nxt) if heard[i]), None)
        if first is not None:
            out["heard_ms"].append((first - end) * frame_ms)
        if k and any(heard[start - 5 : start]):  # the answer was playing at the onset
            quiet = next(
                (i for i in range(start, end) if not any(heard[i : i + 3])), None
            )  # three silent frames in a row: the cut, not a pause in the audio
            if quiet is not None:
                out["clear_ms"].append((quiet - start) * frame_ms)
    return out


def measure(
    name: str,
    turns: int,
    seconds: float,
    sessions: list[int],
    speech: np.ndarray,
    stage_nice: int | None = None,
    caller_nice: int = 0,
    loop: str = aio.DEFAULT_LOOP,
) -> dict[str, Any]:
    port = free_port()
    sip_port = free_port(socket.SOCK_DGRAM) if sip_available() else None
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(CONFIGS[name]), "--port", str(port)]
        + ["--loop", loop]
        + ([] if stage_nice is None else ["--stage-nice", str(stage_nice)])
        + ([] if sip_port is None else ["--sip-port", str(sip_port)]),
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    try:
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass  # PJSIP prints a few lines of its own before it takes our log config
        if not line:
            raise RuntimeError(f"the {name} server did not start")
        url = f"http://127.0.0.1:{port}"
        tokens = 40  # answers still being made when the caller barges in: the abort has work
        one = asyncio.run(one_call(url, speech, turns, tokens))
        raw = one["raw"]
        steps = raw["steps"]
        tta = [(left - t) * 1e3 for t, left in raw["chunks"]]
        over = [(left - t) * 1e3 - compute_ms(steps, t, left) for t, left in raw["chunks"]]
        m = raw["metrics"]
        print(f"  {name}: preemptive answers on ...", file=sys.stderr, flush=True)
        preempting = asyncio.run(one_call(url, speech, turns, tokens, PREEMPTIVE_MS))
        print(f"  {name}: phone calls ...", file=sys.stderr, flush=True)
        twilio = asyncio.run(twilio_call(url, speech, turns))
        sip = sip_call(sip_port, speech, turns) if sip_port else {"heard_ms": [], "clear_ms": []}
        late = []
        for n in sessions:
            print(f"  {name}: {n} concurrent calls ...", file=sys.stderr, flush=True)
            ratio, cores, answers = niced(
                caller_nice, concurrent(url, speech, n, seconds, tokens, proc.pid)
            )
            late.append(
                {"n": n, "late_frame_ratio": round(ratio, 5), "cpu_cores": cores,
                 "answers": answers}
            )  # fmt: skip
        return {
            "config": name,
            "token_to_audio_ms": pct(tta),
            "token_to_audio_over_compute_ms": pct(over),
            "first_audio_ms": pct(m.get("first_audio_ms", [])),
            "speech_end_to_heard_ms": pct(one["heard_ms"]),
            "speech_end_to_heard_preemptive_ms": pct(preempting["heard_ms"]),
            "barge_in_to_silence_ms": pct(m.get("barge_in_to_silence_ms", [])),
            "abort_ack_ms": pct(m.get("abort_ms", [])),
            "twilio_speech_end_to_media_ms": pct(twilio["heard_ms"]),
            "twilio_onset_to_clear_ms": pct(twilio["clear_ms"]),
            "sip_speech_end_to_rtp_audio_ms": pct(sip["heard_ms"]),
            "sip_onset_to_rtp_silence_ms": pct(sip["clear_ms"]),
            "sessions": late,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def niced(nice: int, coro: Any) -> Any:
    """Run `coro` in a thread of its own at `nice` above this one: on Linux niceness belongs
    to a thread and the threads it starts (aiortc's among them), so the servers this process
    starts later keep their own."""
    out: dict[str, Any] = {}

    def body() -> None:
        os.nice(nice)
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=body, name="callers")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def sip_available() -> bool:
    import importlib.util
    import shutil

    return shutil.which("baresip") is not None and importlib.util.find_spec("pjsua2") is not None


def verdict(key: str, r: dict[str, Any]) -> str:
    target = TARGETS.get(key)
    if not target:
        return ""
    ok = all(r[key][q] <= v for q, v in target.items())
    want = ", ".join(f"{q} <= {v:g}" for q, v in target.items())
    return f"{'ok' if ok else 'OVER'} ({want})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="simulated,tiny")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument(
        "--sessions", default="1,4,16", help="concurrent calls, one level after another"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stage-nice", type=int, help="override the config's runtime.stage_nice")
    parser.add_argument(
        "--caller-nice", type=int, default=10, help="niceness of the concurrent callers"
    )
    parser.add_argument(
        "--loop", choices=aio.LOOPS, default=aio.DEFAULT_LOOP, help="the server's event loop"
    )
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sip-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.stage_nice, args.sip_port, args.loop)
        return
    sessions = [int(n) for n in args.sessions.split(",")]
    speech = speech_48k()
    runs = []
    for name in args.configs.split(","):
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        runs.append(
            measure(name, args.turns, args.seconds, sessions, speech, args.stage_nice,
                    args.caller_nice, args.loop)
        )  # fmt: skip
    rows = [
        ("token_to_audio_ms", "thinker token -> its audio leaving (raw)"),
        ("token_to_audio_over_compute_ms", "  the same minus talker+code2wav compute"),
        ("first_audio_ms", "speech stop detected -> first frame out"),
        ("speech_end_to_heard_ms", "caller: end of speech -> audio heard"),
        ("speech_end_to_heard_preemptive_ms", f"  the same, preemptive on ({PREEMPTIVE_MS} ms)"),
        ("barge_in_to_silence_ms", "barge-in detected -> silent frame out"),
        ("abort_ack_ms", "abort acknowledged by every stage"),
        ("twilio_speech_end_to_media_ms", "twilio: end of speech -> first media in"),
        ("twilio_onset_to_clear_ms", "twilio: talking over it -> clear in"),
        ("sip_speech_end_to_rtp_audio_ms", "sip: end of speech -> audible RTP in"),
        ("sip_onset_to_rtp_silence_ms", "sip: talking over it -> RTP silent"),
    ]
    for r in runs:
        print(f"\n{r['config']}: {'measure':44} {'p50':>9} {'p99':>9} {'n':>5}  target")
        for key, label in rows:
            v = r[key]
            print(
                f"  {label:52} {v['p50']:>7.1f}ms {v['p99']:>7.1f}ms {v['n']:>5}  {verdict(key, r)}"
            )
        late = ", ".join(f"{s['n']}: {100 * s['late_frame_ratio']:.2f}%" for s in r["sessions"])
        print(f"  late output frames (> 1 frame period after due), by concurrent calls: {late}"
              f" (callers at niceness {args.caller_nice})")  # fmt: skip
        for s in r["sessions"]:
            c = s["cpu_cores"]
            print(
                f"  CPU with {s['n']} calls, in cores: callers {c['callers']:.2f}, gateway "
                f"{c['gateway']:.2f} ({1e3 * c['gateway'] / s['n']:.0f} ms/s per call), "
                f"stages {c['stages']:.2f}; {s['answers']} answers started"
            )
    print(
        "\nserver-side figures are taken when a frame is handed to aiortc; the caller's "
        "include VAD silence (500 ms), Opus and its jitter buffer; the phone rows are the "
        "caller's (SIP: baresip's recording, in 20 ms frames), VAD silence and detection included"
    )
    if args.json:
        first = runs[0]
        out = {k: first[k] for k in ("token_to_audio_ms", "first_audio_ms")}
        out |= {k: first[k] for k in ("barge_in_to_silence_ms", "abort_ack_ms", "sessions")}
        out["runs"] = runs
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
