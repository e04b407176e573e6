"""The echo gate and WebRTC's echo canceller (LiveKit's bindings) on synthetic echo of real
speech: espeak-ng's voice back through a loudspeaker and a room."""

from __future__ import annotations

import numpy as np
import pytest

from realtime_omni.clients.webrtc import espeak
from realtime_omni.gateway.media.audio import resample, ulaw_decode, ulaw_encode
from realtime_omni.gateway.media.echo_canceller import EchoCanceller
from realtime_omni.gateway.turns.echo import ECHO_CORRELATION, EchoGate
from realtime_omni.gateway.turns.policy import TurnParams
from realtime_omni.gateway.turns.vad import Windower


def speech(text: str) -> np.ndarray:
    spoken = espeak(text)
    if spoken is None:
        pytest.skip("espeak-ng is not installed")
    x, rate = spoken
    return resample(x, rate, 16000) * 0.5


def room(x: np.ndarray, db: float, delay_ms: int) -> np.ndarray:
    """`x` back through a loudspeaker and a room: attenuated, late, with 150 ms of reverb."""
    y = np.concatenate([np.zeros(delay_ms * 16, np.float32), x])[: len(x)] * 10 ** (db / 20)
    ir = np.exp(-np.arange(2400) / 400.0) * np.random.default_rng(0).standard_normal(2400) * 0.05
    ir[0] = 1.0
    return np.convolve(y, ir)[: len(x)].astype(np.float32)


def level_db(x: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(np.square(x)) + 1e-12))


def cancel(far: np.ndarray, mic: np.ndarray, chunk: int) -> np.ndarray:
    pytest.importorskip("livekit")
    aec = EchoCanceller.create()
    assert aec is not None
    out = []
    for i in range(0, len(mic), chunk):  # as a transport would: reads and pushes in chunks
        aec.far(far[i : i + chunk])
        out.append(aec.near(mic[i : i + chunk]))
    return np.concatenate(out)


@pytest.mark.parametrize(("db", "delay_ms"), [(-6, 30), (-12, 100), (-20, 200)])
def test_the_bots_echo_is_removed(db: float, delay_ms: int) -> None:
    bot = speech(
        "The weather today is sunny with a light breeze from the west, warm until evening."
    )
    mic = room(bot, db, delay_ms)
    out = cancel(bot, mic, 320)
    half = len(out) // 2  # once the delay estimator has found the echo path
    assert level_db(out[half:]) < level_db(mic[half : len(out)]) - 20


def test_the_person_talking_over_the_echo_comes_through() -> None:
    bot = speech(
        "The weather today is sunny with a light breeze from the west, warm until evening."
    )
    person = speech("Wait, stop, I have a question.")
    n = len(bot)
    start = n // 2
    near = np.zeros(n, np.float32)
    near[start : start + len(person)] = person[: n - start]
    out = cancel(bot, room(bot, -12, 100) + near, 320)
    span = slice(start, min(n, start + len(person), len(out)))
    assert level_db(out[span]) > level_db(near[span]) - 10  # the person, not suppressed away


BOT = "The weather today is sunny with a light breeze from the west, warm until the evening."


def gated(
    far: np.ndarray, mic: np.ndarray, aec: bool = False, correlate: bool = True
) -> np.ndarray:
    """Per 32 ms window: did the gate take it for echo (far end fed 20 ms at a time, as a
    WebRTC track reads it). With `aec`, as a session whose gate listens through the canceller
    (`echo_gate_aec`): each window beside what the canceller leaves of it. `correlate`: the
    gate's waveform comparison (off: energies alone)."""
    gate, out = EchoGate(correlate=correlate), []
    canceller = EchoCanceller() if aec else None
    windower = Windower()
    if aec:
        pytest.importorskip("livekit")
    for i in range(0, len(mic) - 511, 512):
        for j in range(i, i + 512, 320):
            gate.far(far[j : min(j + 320, i + 512)], 100 + j / 16000)
            if canceller is not None:
                canceller.far(far[j : min(j + 320, i + 512)])
        t = 100 + (i + 512) / 16000
        if canceller is None:
            out.append(gate.window(mic[i : i + 512], t))
        for w in windower.push(canceller.beside(mic[i : i + 512])) if canceller else []:
            out.append(gate.window(w[0], t, w[1]))
    return np.array(out)


def speechy(x: np.ndarray) -> np.ndarray:
    """Windows with sound in them (what the VAD could take for speech): within 30 dB of the
    loudest."""
    env = np.array([np.mean(np.square(x[i : i + 512])) for i in range(0, len(x) - 511, 512)])
    return env > env.max() / 1000


@pytest.mark.parametrize(("db", "delay_ms"), [(-6, 30), (-12, 100), (-20, 200), (-30, 60)])
def test_the_gate_takes_the_bots_echo_for_echo(db: float, delay_ms: int) -> None:
    bot = speech(BOT)
    echo = room(bot, db, delay_ms)
    g, loud = gated(bot, echo), speechy(echo)
    assert g[32:][loud[32:]].mean() > 0.95  # once it has learnt the path (a second)


def test_before_a_path_is_learnt_a_12_db_echo_is_taken_for_echo() -> None:
    """The first second of an answer: no path fitted yet, the prior decides (it paused every
    answer's first second at -12 dB when it took only what is 10 dB under the far end)."""
    bot = speech(BOT)
    echo = room(bot, -12, 100)
    g, loud = gated(bot, echo), speechy(echo)
    first = slice(0, 16)  # 512 ms: fewer windows than any fit needs
    assert g[first][loud[first]].mean() > 0.9


def test_through_the_canceller_a_6_db_echo_is_echo_from_the_first_second() -> None:
    """Energies alone take 13 % of a -6 dB echo's first second for something else (it paused
    every answer in `benchmarks/turns.py`); what the canceller takes away says it is echo."""
    bot = speech(BOT)
    echo = room(bot, -6, 30)
    loud = speechy(echo)
    first = slice(0, 32)
    assert gated(bot, echo, correlate=False)[first][loud[first]].mean() < 0.95  # energies alone
    g = gated(bot, echo, aec=True)
    assert len(g) >= len(loud) - 1
    assert g[first][loud[first]].all() and g[loud[: len(g)]].mean() > 0.99


def phone_band(x: np.ndarray) -> np.ndarray:
    """`x` as a phone line carries it: 8 kHz mu-law, back at 16 kHz."""
    line = ulaw_decode(ulaw_encode(resample(x, 16000, 8000)))
    return resample(line, 8000, 16000)[: len(x)]


@pytest.mark.parametrize(
    ("db", "delay_ms", "phone"),
    [(-6, 30, False), (-6, 200, False), (-6, 30, True), (-12, 100, True)],
)
def test_a_loud_echo_is_echo_from_its_first_window_without_the_canceller(
    db: float, delay_ms: int, phone: bool
) -> None:
    """Energies alone take 13 % of a -6 dB echo's first second for something else, and one
    window of it that the VAD calls speech pauses the answer; its waveform is the far end's."""
    bot = speech(BOT)
    echo = room(bot, db, delay_ms)
    echo = phone_band(echo) if phone else echo
    g, loud = gated(bot, echo), speechy(echo)
    assert g[loud[: len(g)]].all()


def correlations(far: np.ndarray, mic: np.ndarray) -> np.ndarray:
    """`EchoGate.correlation` of each 32 ms microphone window, the far end fed as it plays."""
    gate, out = EchoGate(), []
    for i in range(0, len(mic) - 511, 512):
        t = 100 + (i + 512) / 16000
        gate.far(far[i : i + 512], t - 512 / 16000)
        gate.window(mic[i : i + 512], t)
        out.append(gate.correlation(round(t * 16000)))
    return np.array(out)


def test_the_waveform_tells_the_bots_echo_from_a_person() -> None:
    bot, person = speech(BOT), speech("Wait, stop, I have a question about that.")
    for db, delay_ms in [(-6, 30), (-30, 200)]:
        echo = room(bot, db, delay_ms)
        r = correlations(bot, echo)[speechy(echo)[: len(bot) // 512]]
        assert np.median(r) > 0.8 and (r >= ECHO_CORRELATION).mean() > 0.9, (db, np.median(r))
    # A person over the bot's far end, nothing of it coming back: the same espeak-ng voice,
    # so their voiced sounds are alike, yet they seldom match.
    mic = np.zeros(len(bot), np.float32)
    mic[: len(person)] = person[: len(bot)]
    r = correlations(bot, mic)[speechy(mic)[: len(bot) // 512]]
    assert np.median(r) < 0.35 and (r >= ECHO_CORRELATION).mean() < 0.1, np.median(r)


@pytest.mark.parametrize("at_s", [0.1, 0.2, 0.3])
def test_a_person_interrupting_an_answers_first_words_is_heard(at_s: float) -> None:
    """No echo comes back (a headset), and too little of the answer has played to learn that:
    the prior decides. Taking all sound 6 dB under the far end for echo (energies alone), it
    let 672-736 ms of this person through, about `min_interruption_ms`."""
    bot, person = speech(BOT), speech("Wait, stop, I have a question about that.")
    start = int(at_s * 16000)
    mic = np.zeros(len(bot), np.float32)
    mic[start : start + len(person)] = person[: len(bot) - start]
    g = gated(bot, mic)
    heard = ~g[speechy(mic)[: len(g)]]
    assert heard.sum() * 32 >= TurnParams().min_interruption_ms + 160, heard.sum() * 32


@pytest.mark.parametrize("aec", [False, True])
@pytest.mark.parametrize("db", [-12, -20, None])  # at -6 dB the echo is as loud as them
def test_the_gate_lets_a_person_through_over_the_echo_or_without_one(
    db: float | None, aec: bool
) -> None:
    bot, person = speech(BOT), speech("Wait, stop, I have a question about that.")
    start = len(bot) // 2
    near = np.zeros(len(bot), np.float32)
    near[start : start + len(person)] = person[: len(bot) - start]
    mic = near + (room(bot, db, 100) if db is not None else 0)
    g = gated(bot, mic, aec)
    talking = speechy(near)[: len(g)]
    heard = ~g[talking]  # windows of the person the gate let through
    # enough of them for the turn policy to confirm the interruption, all without an echo
    assert heard.sum() * 32 >= TurnParams().min_interruption_ms if db else heard.all()


def longest_run(x: np.ndarray) -> int:
    best = run = 0
    for v in x:
        run = run + 1 if v else 0
        best = max(best, run)
    return best


@pytest.mark.parametrize(("answer_s", "overlap_s"), [(0.3, 0.0), (0.5, 0.1), (0.5, 0.3)])
def test_a_person_who_starts_as_a_short_answer_ends_is_not_cut_up(
    answer_s: float, overlap_s: float
) -> None:
    # No echo comes back (headphones). Too short an answer to learn that from: the person's
    # first words, quiet against the answer, are taken for echo by the prior and must not teach
    # the gate a path that then calls their next words echo (it did: 320 ms of their speech
    # gated, which the VAD took for the end of their turn).
    bot = speech("Sure, here it is.")[: int(answer_s * 16000)]
    person = speech("Hello, how are you today?")
    start = len(bot) - int(overlap_s * 16000)
    n = start + len(person) + 16000
    mic, far = np.zeros(n, np.float32), np.zeros(n, np.float32)
    mic[start : start + len(person)] = person
    far[: len(bot)] = bot
    g = gated(far, mic)[speechy(mic)]
    assert longest_run(g) <= 3, g.astype(int)  # at most a window or three at a quiet consonant


def test_noise_reduction_suppresses_a_steady_noise_and_keeps_speech() -> None:
    """`audio.input.noise_reduction`: WebRTC's noise suppressor, no echo canceller."""
    pytest.importorskip("livekit")
    aec = EchoCanceller.create(echo=False, noise=True)
    assert aec is not None
    noise = (np.random.default_rng(0).standard_normal(48000) * 0.03).astype(np.float32)
    person = speech("Wait, stop, I have a question.")[:24000]
    mic = noise.copy()
    mic[24000 : 24000 + len(person)] += person
    out = np.concatenate([aec.near(mic[i : i + 320]) for i in range(0, len(mic), 320)])
    quiet = slice(12000, 24000)  # noise alone, once the suppressor has learnt it
    assert level_db(out[quiet]) < level_db(mic[quiet]) - 6
    said = slice(24000, 24000 + len(person))
    assert level_db(out[said]) > level_db(person) - 6  # the person comes through
