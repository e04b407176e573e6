"""WebRTC's echo canceller (through LiveKit's bindings) on synthetic echo of real speech."""

from __future__ import annotations

import numpy as np
import pytest

from realtime_omni.clients.webrtc import espeak
from realtime_omni.gateway.audio import resample
from realtime_omni.gateway.echo import EchoCanceller

pytest.importorskip("livekit")


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
