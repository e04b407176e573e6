"""benchmarks/transcription_wer.py: its word error rate, its clips, the pass it takes without a
checkpoint, and one run through the tiny model's pipeline (gibberish: the path, not the WER)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, timeout

sys.path.insert(0, str(ROOT / "benchmarks"))
import transcription_wer as wer

SCRIPT = ROOT / "benchmarks" / "transcription_wer.py"


def test_word_error_rate_counts_substitutions_deletions_and_insertions() -> None:
    assert wer.words("It's the cat, SAT!") == ["it's", "the", "cat", "sat"]
    assert wer.edit_distance(wer.words("the cat sat"), wer.words("The cat, sat.")) == 0
    assert wer.edit_distance(list("abcd"), list("axc")) == 2  # one substituted, one deleted
    assert wer.edit_distance(list("ab"), list("zabz")) == 2  # two inserted
    assert wer.edit_distance([], list("ab")) == 2


def test_a_clip_is_read_at_the_thinkers_rate(tmp_path: Path) -> None:
    import wave

    t = np.arange(22050) / 22050
    tone = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    with wave.open(str(tmp_path / "a.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(22050)
        w.writeframes(tone.tobytes())
    x = wer.read_wav(tmp_path / "a.wav")
    assert len(x) == 16000 and x.dtype == np.float32
    peak = np.abs(np.fft.rfft(x)).argmax()  # 1 s: bin k is k Hz
    assert peak == 440 and 0.45 < np.abs(x[100:-100]).max() < 0.55


def test_without_a_checkpoint_it_says_so_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "wer.json"
    cmd = [sys.executable, str(SCRIPT), "--model-path", str(tmp_path / "none")]
    r = subprocess.run(
        [*cmd, "--clips", str(tmp_path / "clips"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    assert r.returncode == 0, r.stderr
    assert "no checkpoint" in json.loads(out.read_text())["skipped"]


def test_the_tiny_models_pipeline_transcribes_every_clip(tmp_path: Path) -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    clips = tmp_path / "clips"
    subprocess.run([sys.executable, str(SCRIPT), "--make-clips", str(clips)], check=True)
    for extra in sorted(clips.iterdir())[4:]:  # two clips are enough for the path
        extra.unlink()
    tiny = ROOT / ".cache" / "tiny-qwen3-omni-2-0"
    if not (tiny / "config.json").exists():
        pytest.skip("the tiny model is not built (make install)")
    out = tmp_path / "wer.json"
    config = ROOT / "configs" / "tiny.yaml"
    args = ["--clips", str(clips), "--config", str(config), "--model-path", str(tiny)]
    subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        check=True,
        timeout=timeout(240),
    )
    result = json.loads(out.read_text())
    assert [c["clip"] for c in result["clips"]] == ["00.wav", "01.wav"]
    assert result["words"] == sum(len(wer.words(s)) for s in wer.SENTENCES[:2])
    assert all(c["transcript"] for c in result["clips"]) and result["wer"] > 0
