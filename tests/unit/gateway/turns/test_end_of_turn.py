"""Semantic end of turn (`gateway/turns/end_of_turn.py`): the decision on traces, Smart Turn's
features against Whisper's own extractor, the model file, and a session it ends turns for."""

import asyncio
from pathlib import Path

import numpy as np
import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.gateway.protocol.session_update import apply_session_update
from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.turns.end_of_turn import Ask, EndOfTurn
from realtime_omni.gateway.turns.vad import SpeechStarted, SpeechStopped
from realtime_omni.models.smart_turn import SmartTurn, log_mel
from tests.conftest import run
from tests.unit.gateway.fakes import FakeCoord, silence, speak


def trace(eot: EndOfTurn, probs: list[float]) -> list[Ask]:
    """Feed window probabilities (the first is the speech start); the asks made."""
    asks = []
    for i, p in enumerate(probs):
        ask = eot.feed(p, SpeechStarted(0, 32) if i == 0 else None)
        if ask is not None:
            asks.append(ask)
    return asks


def test_the_model_is_asked_at_each_probe_of_a_pause_and_only_a_fresh_answer_counts() -> None:
    eot = EndOfTurn(probe_ms=200)
    asks = trace(eot, [0.9] * 10 + [0.0] * 36)  # 7th silent window: 224 ms; 16th: 512 ms; ...
    assert len(asks) == 3  # at 224, 512 and 1024 ms of silence (REPROBE_MS)
    first, ask = asks[0], asks[-1]
    assert not eot.answer(first, 0.9)  # a newer question was asked since
    assert eot.answer(ask, 0.9) and not eot.answer(ask, 0.3)
    eot.feed(0.9, None)  # they went on talking before the answer came
    assert not eot.answer(ask, 0.9)
    again = [a for a in (eot.feed(p, None) for p in [0.9] * 3 + [0.0] * 7) if a]
    assert len(again) == 1 and again[0].token != ask.token and eot.answer(again[0], 0.9)
    assert trace(EndOfTurn(reprobe_ms=()), [0.9] * 10 + [0.0] * 60) != []  # once without
    assert len(trace(EndOfTurn(reprobe_ms=()), [0.9] * 10 + [0.0] * 60)) == 1


def test_no_question_without_speech_and_none_after_the_turn_ends() -> None:
    eot = EndOfTurn(probe_ms=200)
    assert [eot.feed(0.0, None) for _ in range(20)] == [None] * 20
    (ask,) = trace(eot, [0.9] * 5 + [0.0] * 7)
    eot.feed(0.0, SpeechStopped(1000))
    assert not eot.answer(ask, 1.0)
    # windows between the thresholds are neither speech nor silence
    assert trace(EndOfTurn(probe_ms=200), [0.9] + [0.4] * 30) == []


@pytest.mark.parametrize("seconds", [0.5, 3.0, 11.0])
def test_log_mel_is_whispers_feature_extractor(seconds: float) -> None:
    from transformers import WhisperFeatureExtractor

    x = (np.random.default_rng(1).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32)
    n = 8 * 16000
    padded = np.pad(x[-n:], (max(0, n - len(x)), 0))  # what Smart Turn's own code hands it
    want = WhisperFeatureExtractor(chunk_length=8)(
        padded, sampling_rate=16000, return_tensors="np", padding="max_length", max_length=n,
        truncation=True, do_normalize=True,
    ).input_features[0]  # fmt: skip
    got = log_mel(x)
    assert got.shape == (80, 800) and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.models.random_smart_turn import build

    root = tmp_path_factory.mktemp("smart_turn")
    return {k: build(root / k, bias=b).parent for k, b in (("complete", 6), ("trails", -6))}


def test_smart_turn_runs_a_model_of_the_real_signature(models: dict[str, Path]) -> None:
    speechlike = (np.random.default_rng(2).standard_normal(40000) * 0.1).astype(np.float32)
    assert SmartTurn(models["complete"]).predict(speechlike) > 0.9
    assert SmartTurn(models["trails"]).predict(speechlike) < 0.1


def test_a_directory_without_the_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no ONNX model"):
        SmartTurn(tmp_path)


class Scripted:
    """An end-of-turn model that answers `p` and records what it heard."""

    def __init__(self, p: float) -> None:
        self.p, self.heard = p, []

    async def complete(self, audio: np.ndarray) -> float:
        self.heard.append(len(audio))
        return self.p


def semantic(s: Session, eagerness: str) -> None:
    td = {"type": "semantic_vad", "eagerness": eagerness}
    s.configure({"turn_detection": td})


def committed(s: Session) -> bool:
    return any(e["type"] == "input_audio_buffer.committed" for e in s.pending_events())


@pytest.mark.parametrize(
    ("p", "eagerness", "silent_windows_to_end"),
    [
        (0.9, "auto", 7),  # complete: at the first question, after ~200 ms of silence
        (0.1, "high", 63),  # trailing off: 2 s of silence, high eagerness' longest
        (0.1, "auto", 125),  # 4 s
    ],
)
def test_a_session_ends_the_turn_when_the_model_hears_it_complete(
    p: float, eagerness: str, silent_windows_to_end: int
) -> None:
    async def body() -> None:
        model = Scripted(p)
        s = Session(FakeCoord(chunks=2), end_of_turn=model)
        await s.start()
        semantic(s, eagerness)
        speak(s, 20)
        for i in range(1, 130):  # noqa: B007
            silence(s, 1)
            await asyncio.sleep(0)  # the model's answer
            await asyncio.sleep(0)
            if committed(s):
                break
        assert i == silent_windows_to_end
        assert model.heard[0] >= 20 * 512  # the turn's audio, its speech included
        await s.close()

    run(body())


def test_without_a_model_semantic_vad_is_the_silence_its_eagerness_sets() -> None:
    async def body() -> None:
        s = Session(FakeCoord(chunks=2))
        await s.start()
        semantic(s, "high")  # 300 ms
        speak(s, 20)
        for i in range(1, 40):  # noqa: B007
            silence(s, 1)
            if committed(s):
                break
        assert i == 10  # 10 windows of 32 ms: the first past 300 ms
        await s.close()

    run(body())


def test_semantic_vad_settings_round_trip() -> None:
    from realtime_omni.gateway.protocol.settings import Settings, Voices

    s, refused = apply_session_update(
        Settings(),
        {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}},
        Voices(),
        False,
    )
    assert not refused and s.turn_detection is not None
    assert s.turn_detection.to_openai()["eagerness"] == "low"
