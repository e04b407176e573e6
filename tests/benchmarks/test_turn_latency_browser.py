"""turn_latency.py --browser's measuring, without a browser: the microphone WAV's layout, and
how the page's sound edges pair into end of speech -> heard."""

from __future__ import annotations

import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import turn_latency_browser as tlb


def test_the_mic_wav_is_48k_mono_with_each_speech_where_the_layout_says(tmp_path: Path) -> None:
    speech = [np.full(4800, 0.5, np.float32), np.full(9600, 0.5, np.float32)]
    ends = tlb.write_mic(tmp_path / "mic.wav", speech)
    with wave.open(str(tmp_path / "mic.wav")) as w:
        assert (w.getframerate(), w.getnchannels()) == (48000, 1)
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    loud = np.flatnonzero(np.abs(pcm) > 1000)
    assert ends == pytest.approx([tlb.LEAD_S + 0.1, tlb.LEAD_S + 0.1 + tlb.GAP_S + 0.2])
    assert loud[0] == tlb.LEAD_S * 48000 and loud[-1] + 1 == round(ends[1] * 48000)


def test_each_speech_end_pairs_with_the_first_bot_sound_after_it() -> None:
    def ev(src: str, kind: str, ms: float) -> dict[str, object]:
        return {"src": src, "kind": kind, "ms": ms}

    events = [
        ev("mic", "on", 1000), ev("mic", "off", 2000),
        ev("bot", "on", 2400), ev("bot", "off", 4000),
        ev("mic", "on", 8000), ev("bot", "on", 8500), ev("mic", "off", 9000),  # premature
        ev("mic", "on", 15000), ev("mic", "off", 16000),  # never answered
        ev("bot", "on", 15500),
        ev("mic", "on", 22000), ev("mic", "off", 23000),  # past n: the file looping
    ]  # fmt: skip
    turns = tlb.pair(events, 3)
    assert [t["end_to_heard_ms"] for t in turns] == [400.0, None, None]
    assert [t["premature"] for t in turns] == [False, True, True]
    assert turns[0]["speech_ms"] == 1000.0
