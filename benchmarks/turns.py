"""Turn-taking in a room: does the bot's own echo, a backchannel, a cough or a click cut it
off, and does a real interruption silence it?

Starts `realtime-omni serve` on the simulated config with its vocoder speaking (espeak-ng speech
instead of the tone) and calls it over the WebSocket API with `realtime_omni.clients.room`: the
caller asks a question, the answer plays from a loudspeaker whose sound comes back into the
microphone (late, quieter, with reverb), and 1.2 s into the answer (0.2 s for the early
interruptions) the condition's sound is made. Each condition runs under the policies asked
for on the same corpus: `now` (pause first, abort after `min_interruption_ms`, the echo gate),
`aec` (`now` with the gate listening through the echo canceller too, `echo_gate_aec: true`),
`before` (`min_interruption_ms: 0`, no echo gate: any speech start over the bot aborts it, as
the server did until this policy) and `semantic` (`now` with `semantic_vad`: Smart Turn's real
weights end the question's turn, instead of 500 ms of silence).

Per condition and policy it prints: trials, false pauses (the answer stopped with nobody
talking), false barge-ins (the answer aborted by something that is not an interruption), missed
barge-ins (an interruption that did not abort it), onset -> the server stopped sending, onset
-> abort acknowledged (`response.done` cancelled) and end of the question -> first audio.

    python benchmarks/turns.py [--trials 4] [--conditions echo-12,interrupt,...]
                               [--policies now,aec,before,semantic] [--smart-turn DIR]
                               [--json PATH]

Needs espeak-ng.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.clients.room import RATE_HZ, RoomCall  # noqa: E402
from realtime_omni.clients.webrtc import espeak  # noqa: E402
from realtime_omni.gateway.media.audio import resample  # noqa: E402

BOT_SPEECH = (
    "The weather today is sunny with a light breeze from the west. It will stay warm until the "
    "evening, when clouds come in from the coast, and there may be rain tomorrow morning."
)
QUESTION = "What is the weather like today?"
INTERRUPTION = "Wait, stop, I have a question."
BACKCHANNELS = ["mhm", "uh-huh", "yeah", "okay", "right"]
INTO_ANSWER_S = 1.2  # the condition's sound starts this far into the answer
LISTEN_S = 3.0  # and the trial watches this long after it
GAP_S = 0.12  # no audio delta for this long during an answer: it paused
POLICIES = {
    "now": {},
    "before": {"min_interruption_ms": 0, "echo_gate": False},
    # `now` with the echo gate listening through WebRTC's echo canceller too (`echo_gate_aec`)
    "aec": {"echo_gate_aec": True},
    # `now`, with the turn's end decided by Smart Turn (--smart-turn) instead of 500 ms of silence
    "semantic": {"type": "semantic_vad", "eagerness": "auto"},
}
# Smart Turn v3's real weights, as pipecat-ai's wheel ships them (`make install` builds that
# client environment for the e2e tests): nothing is downloaded.
PIPECAT_SMART_TURN = next(
    (ROOT / ".cache" / "venvs" / "pipecat" / "lib").glob(
        "python3*/site-packages/pipecat/audio/turn/smart_turn/data"
    ),
    None,
)


@dataclass(frozen=True)
class Condition:
    name: str
    sound: str  # "" (echo only), "backchannel", "cough", "click", "interrupt"
    echo_db: float | None = None
    delay_ms: float = 100.0
    phone: bool = False
    into_s: float = INTO_ANSWER_S  # when the sound starts, after the answer's first audio

    @property
    def interrupts(self) -> bool:
        return self.sound == "interrupt"


CONDITIONS = [
    Condition("echo-6", "", -6, 30),
    Condition("echo-12", "", -12, 100),
    Condition("echo-20", "", -20, 200),
    Condition("echo-30", "", -30, 60),
    Condition("backchannel", "backchannel", -20, 100),
    Condition("cough", "cough", -20, 100),
    Condition("click", "click", -20, 100),
    Condition("interrupt", "interrupt"),
    Condition("interrupt+echo-12", "interrupt", -12, 100),
    # In the answer's first words, before the echo gate can have learnt any path
    Condition("early-interrupt", "interrupt", into_s=0.2),
    Condition("early-interrupt+echo-6", "interrupt", -6, 30, into_s=0.2),
    Condition("phone:echo-12", "", -12, 100, True),
    Condition("phone:backchannel", "backchannel", -20, 100, True),
    Condition("phone:interrupt", "interrupt", -12, 100, True),
]


def speak(text: str) -> np.ndarray:
    spoken = espeak(text)
    if spoken is None:
        raise SystemExit("turns.py needs espeak-ng (apt-get install espeak-ng)")
    return resample(spoken[0], spoken[1], RATE_HZ)


def cough(seed: int) -> np.ndarray:
    """A 180 ms burst of low-passed noise with a fast attack and a slower decay."""
    rng = np.random.default_rng(seed)
    n = int(0.18 * RATE_HZ)
    x = np.convolve(rng.standard_normal(n), np.ones(12) / 12, "same")
    env = np.minimum(np.arange(n) / (0.01 * RATE_HZ), 1) * np.exp(-np.arange(n) / (0.06 * RATE_HZ))
    return (0.5 * x * env / np.abs(x).max()).astype(np.float32)


def click(seed: int) -> np.ndarray:
    """Three sharp clicks (a pen, a keyboard) 90 ms apart."""
    x = np.zeros(int(0.3 * RATE_HZ), np.float32)
    for k in range(3):
        at = int((0.02 + 0.09 * k) * RATE_HZ)
        x[at : at + 24] = np.random.default_rng(seed + k).uniform(-0.6, 0.6, 24)
    return x


class Corpus:
    def __init__(self) -> None:
        self.question = speak(QUESTION)
        loud = np.flatnonzero(np.abs(self.question) > 0.01 * np.abs(self.question).max())
        self.question_s = (loud[-1] + 1) / RATE_HZ  # espeak-ng pads its speech with silence
        self.interruption = speak(INTERRUPTION)
        self.backchannels = [speak(b) for b in BACKCHANNELS]

    def sound(self, kind: str, trial: int) -> np.ndarray:
        if kind == "backchannel":
            return self.backchannels[trial % len(self.backchannels)]
        if kind == "cough":
            return cough(trial)
        if kind == "click":
            return click(trial)
        if kind == "interrupt":
            return self.interruption
        return np.zeros(0, np.float32)


async def trial(url: str, c: Condition, policy: dict[str, Any], corpus: Corpus, k: int) -> dict:
    room = RoomCall(url, c.echo_db, c.delay_ms, phone=c.phone)
    td = {"type": "server_vad", **policy}
    await room.connect({"max_output_tokens": 60, "audio": {"input": {"turn_detection": td}}})
    try:
        room.say(np.concatenate([corpus.question, np.zeros(RATE_HZ // 2, np.float32)]))
        t_created, created = await room.wait("response.created", 20)
        rid = created["response"]["id"]
        while not room.deltas:
            await asyncio.sleep(0.01)
        t_first = room.deltas[0][0]
        asked_end = room.utterances[0][0] + corpus.question_s  # its last sound, not its padding
        await asyncio.sleep(c.into_s)
        sound = corpus.sound(c.sound, k)
        onset = None
        if len(sound):
            room.say(sound)
            while not room.utterances[-1]:
                await asyncio.sleep(0.005)
            onset = room.utterances[-1][0]
        await asyncio.sleep(LISTEN_S)
        done = [ev for t, ev in room.events if ev.get("type") == "response.done"]
        first = next((ev for ev in done if ev["response"]["id"] == rid), None)
        cut = first is not None and first["response"]["status"] == "cancelled"
        t_done = next(
            (t for t, ev in room.events if ev.get("type") == "response.done"
             and ev["response"]["id"] == rid), None,
        )  # fmt: skip
        # pauses: gaps in the answer's audio while it was active
        arrivals = [
            t for t, item, _ in room.deltas if t >= t_first and (t_done is None or t <= t_done)
        ]
        gaps = [(a, b) for a, b in itertools.pairwise(arrivals) if b - a > GAP_S]
        if t_done is None and arrivals and time.monotonic() - arrivals[-1] > GAP_S:
            gaps.append((arrivals[-1], time.monotonic()))
        silence_at = None  # the last audio the server sent before it stopped, after the onset
        if onset is not None:
            nxt = [*arrivals[1:], float("inf")]
            silence_at = next(
                (
                    a
                    for a, b in zip(arrivals, nxt, strict=True)
                    if a >= onset - 0.02 and b - a > GAP_S
                ),
                None,
            )
        return {
            "barge_in": cut,
            "paused": bool(gaps),
            "onset_to_silence_ms": None
            if silence_at is None or onset is None
            else (silence_at - onset) * 1e3,
            "onset_to_abort_ms": None
            if not cut or t_done is None or onset is None
            else (t_done - onset) * 1e3,
            "end_of_speech_to_audio_ms": (t_first - asked_end) * 1e3,
            "created_after_s": t_created - asked_end,
        }
    finally:
        await room.close()


def p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 1) if values else None


async def run_condition(url: str, c: Condition, name: str, trials: int, corpus: Corpus) -> dict:
    rs = [await trial(url, c, POLICIES[name], corpus, k) for k in range(trials)]
    talking = c.sound in ("interrupt", "backchannel")
    return {
        "condition": c.name,
        "policy": name,
        "trials": trials,
        "false_pause": 0 if talking else sum(r["paused"] for r in rs),
        "false_barge_in": 0 if c.interrupts else sum(r["barge_in"] for r in rs),
        "missed_barge_in": sum(not r["barge_in"] for r in rs) if c.interrupts else 0,
        "onset_to_silence_ms_p50": p50([r["onset_to_silence_ms"] for r in rs
                                        if r["onset_to_silence_ms"] is not None]),
        "onset_to_abort_ms_p50": p50([r["onset_to_abort_ms"] for r in rs
                                      if r["onset_to_abort_ms"] is not None]),
        "end_of_speech_to_audio_ms_p50": p50([r["end_of_speech_to_audio_ms"] for r in rs]),
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def speaking_config(tmp: Path, smart_turn: Path | None, speech: str = BOT_SPEECH) -> Path:
    """The simulated config, its vocoder saying `speech` (and Smart Turn from `smart_turn`)."""
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["stages"]["code2wav"]["params"]["speech_text"] = speech
    if smart_turn is not None:
        cfg["realtime"] = {"smart_turn_dir": str(smart_turn)}
    path = tmp / "speaking.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--conditions", help="comma-separated names; default: all")
    parser.add_argument("--policies", default="now,before")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--smart-turn",
        type=Path,
        default=PIPECAT_SMART_TURN,
        help="directory of Smart Turn's ONNX model, for the semantic policy (default: the one "
        "pipecat-ai's wheel ships, in .cache/venvs/pipecat)",
    )
    args = parser.parse_args()
    if "semantic" in args.policies.split(",") and args.smart_turn is None:
        raise SystemExit("the semantic policy needs --smart-turn DIR (Smart Turn's ONNX model)")
    wanted = args.conditions.split(",") if args.conditions else [c.name for c in CONDITIONS]
    conditions = [c for c in CONDITIONS if c.name in wanted]
    corpus = Corpus()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "realtime_omni.cli", "serve", "--port", str(port),
               "--config", str(speaking_config(Path(tmp), args.smart_turn))]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        try:
            while (line := proc.stdout.readline()) and "serving" not in line:
                pass
            if not line:
                raise SystemExit("the server did not start")
            url = f"http://127.0.0.1:{port}"
            rows = []
            for c in conditions:
                for name in args.policies.split(","):
                    print(f"  {c.name} / {name} ...", file=sys.stderr, flush=True)
                    rows.append(asyncio.run(run_condition(url, c, name, args.trials, corpus)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    cols = ("false_pause", "false_barge_in", "missed_barge_in", "onset_to_silence_ms_p50",
            "onset_to_abort_ms_p50", "end_of_speech_to_audio_ms_p50")  # fmt: skip
    heads = ("false pause", "false barge", "missed", "onset>silent", "onset>abort", "eos>audio")
    print(f"\n{'condition':20} {'policy':8} {'n':>3} " + " ".join(f"{h:>12}" for h in heads))
    for r in rows:
        cells = " ".join(f"{'-' if r[k] is None else r[k]:>12}" for k in cols)
        print(f"{r['condition']:20} {r['policy']:8} {r['trials']:>3} {cells}")
    print(
        "\nonset: the caller's first frame of the sound; silent: the server's last audio before "
        "the answer paused; eos: the end of the question; targets: no false barge-in from echo "
        "at -12 dB or quieter, <= 2 % at -6 dB, <= 5 % of backchannels cut the bot off, every "
        "interruption confirmed, onset -> silence <= 250 ms p50"
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
