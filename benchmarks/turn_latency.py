"""How soon the bot answers once a person stops talking, and whether it ever answers half a
sentence: end of speech -> first audio heard, per turn-taking policy, in one run.

Starts `realtime-omni serve` on the simulated Qwen3-Omni config (its vocoder speaking espeak-ng
speech) and calls it over WebRTC with the aiortc caller of `realtime_omni.clients.webrtc`, which
speaks a corpus in real time: complete questions, and sentences with a pause in the middle
("I'd like to book a table for ... four people tonight", pauses of `PAUSES_MS`) that must not be
answered at the pause. Each policy is one call whose `session.update` sets it:

- `silence`: server_vad, the answer starts after 500 ms of silence;
- `smart_turn`: semantic_vad with Smart Turn v3.2 (installed by `make install`) ending the turn
  once the speech pauses 200 ms and it hears the turn complete;
- `smart_turn+preemptive`: the same, the answer computed from 160 ms of silence on and released
  when the turn is judged over (`preemptive_ms`);
- `+prefill`: the same, the turn's audio also prefilled while it is spoken
  (`prefill_while_speaking`: at speech start, and at each whole 8 s window of the audio encoder).

Per policy: end of the caller's speech (its last sample sent) -> the first audible frame it
received (after its own jitter buffer), p50 and p90 over every turn; premature answers (audio
heard before the person finished) over the paused sentences; and the compute discarded: the
stages' seconds spent on abandoned preemptive answers over all the seconds the turns cost
(`/v1/metrics`' `discarded_compute_ms`, `answer_compute_ms` and `prefill_compute_ms`).

With `--browser`, the browser's own figure too: the demo page in headless Chromium (web/, as the
server serves it) speaks the complete questions through a fake microphone under the page's
default policy (Smart Turn on, the server's preemptive_ms: `smart_turn+preemptive`), and the
page measures end of speech -> first audible sample of the answer on one audio clock
(`turn_latency_browser.py`); its row is `browser`, with no premature or discarded figures.

    python benchmarks/turn_latency.py [--rounds 2] [--policies silence,smart_turn,...]
                                      [--browser] [--json PATH]

Needs espeak-ng and Smart Turn's model (`make install`); `--browser` also chromium and
playwright. `--policies ''` with `--browser` runs the browser alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from turns import speaking_config  # noqa: E402  (benchmarks/turns.py)

from realtime_omni.clients.webrtc import Caller, http  # noqa: E402
from realtime_omni.gateway.media.audio import resample  # noqa: E402
from realtime_omni.models.smart_turn import DEFAULT_DIR, FILE_NAME  # noqa: E402

RATE_HZ = 48000  # the caller's microphone
LOUD = 0.02  # a received frame with a peak above this is audible
QUIET_S = 1.0  # an answer is over once this long passed with nothing audible
BOT_SPEECH = "Sure, I can help you with that."
ANSWER_TOKENS = 12  # short answers: what is measured is how they start
QUESTIONS = [
    "What is the weather like today?",
    "Can you tell me a short joke?",
    "How far away is the moon?",
    "What time does the museum open tomorrow?",
]
# (before the pause, after it): neither half may be answered alone. A person who stops
# mid-sentence to think says so: the last word drawn out on a rising pitch, or a filler. espeak-ng
# reads a half sentence flat, as if it were whole (Smart Turn then hears it complete: 0.53-0.97),
# so the first half is spoken as people hesitate (SSML prosody, or "um"/"uh").
RISE = "<speak>{}<prosody rate='x-slow' pitch='+30%'>{}</prosody></speak>"
PAUSED = [
    (RISE.format("I'd like to book a table ", "for"), "four people tonight."),
    ("Could you remind me to call, uh", "my sister at six?"),
    ("The meeting has been moved to, um", "Thursday afternoon."),
    (RISE.format("I was wondering whether you ", "could"), "recommend a good book."),
]
PAUSES_MS = (400, 800)
# `--json`'s rows: exactly these (ms, and ratios of 0-1); the table also shows turns and unanswered.
JSON_KEYS = (
    "policy",
    "end_to_heard_ms_p50",
    "end_to_heard_ms_p90",
    "premature_ratio",
    "discarded_compute_ratio",
)
POLICIES: dict[str, dict[str, Any]] = {
    "silence": {"type": "server_vad", "preemptive_ms": None},
    "smart_turn": {"type": "semantic_vad", "preemptive_ms": None},
    "smart_turn+preemptive": {"type": "semantic_vad", "preemptive_ms": 160},
    "+prefill": {"type": "semantic_vad", "preemptive_ms": 160, "prefill_while_speaking": True},
}


def voice(text: str) -> np.ndarray:
    """`text` (SSML if it starts with `<speak>`) spoken at 48 kHz, its leading and trailing
    silence cut: its last sample is the end of speech."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("turn_latency.py needs espeak-ng")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "speech.wav"
        ssml = ["-m"] if text.startswith("<speak>") else []
        subprocess.run(["espeak-ng", *ssml, "-w", str(path), text], check=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    loud = np.flatnonzero(np.abs(pcm) > 0.01)
    return resample(pcm[loud[0] : loud[-1] + 1], rate, RATE_HZ) * 0.8


def utterances(rounds: int) -> list[tuple[str, list[np.ndarray], bool]]:
    """(text, pieces to say one after the other, has a pause) per turn."""
    out = []
    for _ in range(rounds):
        for q in QUESTIONS:
            out.append((q, [voice(q)], False))
        for i, (a, b) in enumerate(PAUSED):
            pause = np.zeros(PAUSES_MS[i % len(PAUSES_MS)] * RATE_HZ // 1000, np.float32)
            out.append((f"{a} ... {b}", [voice(a), pause, voice(b)], True))  # the pause: silence
    return out


def metrics(url: str) -> dict[str, Any]:
    status, _, body = http("GET", f"{url}/v1/metrics")
    assert status == 200, body
    return dict(json.loads(body))


def total(m: dict[str, Any], key: str) -> float:
    return float(m.get(key, {}).get("sum", 0.0))


async def call(url: str, policy: dict[str, Any], turns: list[Any]) -> list[dict[str, Any]]:
    """One call that speaks `turns` under `policy`: per turn, end of speech -> heard, and
    whether anything was heard before the speech ended."""
    caller = Caller(url)
    await caller.connect()
    td = {"prefill_while_speaking": False, **policy}
    sent = time.monotonic()
    session = {"audio": {"input": {"turn_detection": td}}, "max_output_tokens": ANSWER_TOKENS}
    caller.send({"type": "session.update", "session": session})
    _, updated = await caller.wait_for("session.updated", since=sent)
    got = updated["session"]["audio"]["input"]["turn_detection"]
    assert got["type"] == td["type"] and got["preemptive_ms"] == td["preemptive_ms"], got
    out = []
    try:
        for text, pieces, paused in turns:
            await asyncio.sleep(0.5)
            began = time.monotonic()
            caller.mic.speech_ended_at = None
            for p in pieces:
                caller.mic.say(p)
            while caller.mic.speech_ended_at is None:
                await asyncio.sleep(0.01)
            ended = caller.mic.speech_ended_at
            heard = None
            deadline = ended + 10.0
            while heard is None and time.monotonic() < deadline:
                heard = next((t for t, peak in caller.frames if t >= ended and peak > LOUD), None)
                await asyncio.sleep(0.01)
            early = any(began + 0.2 <= t < ended and peak > LOUD for t, peak in caller.frames)
            while True:  # the answer plays out
                last = max((t for t, peak in caller.frames if peak > LOUD), default=0.0)
                if time.monotonic() - last > QUIET_S:
                    break
                await asyncio.sleep(0.05)
            out.append(
                {
                    "text": text,
                    "paused": paused,
                    "end_to_heard_ms": None if heard is None else (heard - ended) * 1e3,
                    "premature": early,
                }
            )
    finally:
        await caller.hang_up()
    return out


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 1) if xs else None


def browser_row(url: str, rounds: int, detail: dict[str, Any]) -> dict[str, Any]:
    """The demo page in Chromium speaks the complete questions `rounds` times; its row."""
    from turn_latency_browser import browser_call

    speeches = [(q, voice(q)) for _ in range(rounds) for q in QUESTIONS]
    results, report = browser_call(url, speeches, ANSWER_TOKENS)
    td = report["turn_detection"] or {}
    assert td.get("type") == "semantic_vad", f"the page's policy is not Smart Turn: {td}"
    assert td.get("preemptive_ms") is not None, f"no preemptive answers: {td}"
    assert not report["errors"], report["errors"]
    detail["browser"] = {"turns": results, **report}
    heard = [r["end_to_heard_ms"] for r in results if r["end_to_heard_ms"] is not None]
    return {
        "policy": "browser",
        "turns": len(speeches),
        "unanswered": len(speeches) - len(heard),
        "end_to_heard_ms_p50": pct(heard, 50),
        "end_to_heard_ms_p90": pct(heard, 90),
        "premature_ratio": None,
        "discarded_compute_ratio": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="times through the corpus")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", type=Path, help="the rows, in the issue's shape (JSON_KEYS)")
    parser.add_argument("--detail", type=Path, help="every turn's figures, per policy (JSON)")
    parser.add_argument(
        "--browser", action="store_true", help="the demo page in Chromium too: the browser row"
    )
    args = parser.parse_args()
    if not (DEFAULT_DIR / FILE_NAME).exists():
        raise SystemExit(f"Smart Turn's model is not in {DEFAULT_DIR}: run make install")
    turns = utterances(args.rounds)
    rows, detail = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(args.port),
               "--config", str(speaking_config(Path(tmp), None, BOT_SPEECH))]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        try:
            while (line := proc.stdout.readline()) and "serving" not in line:
                pass
            if not line:
                raise SystemExit("the server did not start")
            url = f"http://127.0.0.1:{args.port}"
            for name in [n for n in args.policies.split(",") if n]:
                print(f"  {name} ...", file=sys.stderr, flush=True)
                before = metrics(url)
                results = asyncio.run(call(url, POLICIES[name], turns))
                detail[name] = results
                time.sleep(1.0)  # the last requests' costs come in
                after = metrics(url)
                answered = sum(
                    total(after, k) - total(before, k)
                    for k in ("answer_compute_ms", "prefill_compute_ms")
                )
                wasted = total(after, "discarded_compute_ms") - total(
                    before, "discarded_compute_ms"
                )
                heard = [r["end_to_heard_ms"] for r in results if r["end_to_heard_ms"] is not None]
                paused = [r for r in results if r["paused"]]
                rows.append(
                    {
                        "policy": name,
                        "turns": len(results),
                        "unanswered": sum(r["end_to_heard_ms"] is None for r in results),
                        "end_to_heard_ms_p50": pct(heard, 50),
                        "end_to_heard_ms_p90": pct(heard, 90),
                        "premature_ratio": round(
                            sum(r["premature"] for r in paused) / max(1, len(paused)), 3
                        ),
                        "discarded_compute_ratio": round(wasted / max(1e-9, answered + wasted), 3),
                    }
                )
            if args.browser:
                print("  browser ...", file=sys.stderr, flush=True)
                rows.append(browser_row(url, args.rounds, detail))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    heads = ("turns", "unanswered", "end_to_heard_ms_p50", "end_to_heard_ms_p90",
             "premature_ratio", "discarded_compute_ratio")  # fmt: skip
    print(f"\n{'policy':24} " + " ".join(f"{h:>24}" for h in heads))
    for r in rows:
        print(
            f"{r['policy']:24} " + " ".join(f"{'-' if r[h] is None else r[h]:>24}" for h in heads)
        )
    print(
        "\nend_to_heard: the caller's last sample of speech -> its first audible frame received; "
        "premature: of the sentences with a pause, those whose answer was heard before they "
        "ended; targets (the full policy): p50 <= 450 ms, premature <= 5 %"
    )
    if args.json:
        shaped = [{k: r[k] for k in JSON_KEYS} for r in rows]
        args.json.write_text(json.dumps({"rows": shaped}, indent=2))
    if args.detail:
        args.detail.write_text(json.dumps(detail, indent=2))


if __name__ == "__main__":
    main()
