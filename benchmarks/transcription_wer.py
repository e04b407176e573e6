"""Word error rate of the thinker's input transcription (what a transcription session runs) on
spoken clips whose text is known.

Each clip goes through the pipeline as the request `gateway/session/transcribe.py` sends for a
committed turn (`transcribe.request`: the thinker alone, text only, greedy), and its text is
compared with the clip's words: WER = (substitutions + deletions + insertions) / reference
words, over all clips, after lower-casing and dropping punctuation. Needs the real checkpoint
(`--model-path`, else `$RTO_CHECKPOINT`, else the config's `model.path`); without one it says
so and exits 0 (the tiny and random-weight models write gibberish: their WER means nothing).

Clips are `NAME.wav` (mono 16-bit) with `NAME.txt` (the words) in `--clips`; `--make-clips DIR`
speaks `SENTENCES` into DIR with espeak-ng (on a machine that has it: the GPU machine may not,
so `benchmarks/gpu_check.sh wheels` makes them here and they travel in `.whl/`).

    python benchmarks/transcription_wer.py --make-clips .whl/wer-clips
    python benchmarks/transcription_wer.py --clips .whl/wer-clips [--config PATH]
        [--model-path DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import wave
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from realtime_omni.gateway.session.transcribe import request  # noqa: E402
from realtime_omni.pipeline.config import parse_config  # noqa: E402
from realtime_omni.pipeline.coordinator import Coordinator  # noqa: E402

RATE_HZ = 16000  # the thinker's audio input (the session's input buffer)
SENTENCES = [  # Harvard sentences: everyday words, every common phoneme
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
]


def words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    """Word-level Levenshtein distance: substitutions + deletions + insertions."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def read_wav(path: Path) -> np.ndarray:
    """A mono 16-bit wav as float32 at `RATE_HZ` (band-limited resampling, in one FFT)."""
    with wave.open(str(path)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2, f"{path}: not mono 16-bit"
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    if rate != RATE_HZ:
        n = round(len(x) * RATE_HZ / rate)
        spectrum = np.fft.rfft(x)[: n // 2 + 1]
        x = (np.fft.irfft(spectrum, n) * n / len(x)).astype(np.float32)
    return x


def make_clips(out: Path) -> None:
    if shutil.which("espeak-ng") is None:
        sys.exit("espeak-ng is not installed (apt-get install espeak-ng)")
    out.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(SENTENCES):
        subprocess.run(["espeak-ng", "-w", str(out / f"{i:02d}.wav"), text], check=True)
        (out / f"{i:02d}.txt").write_text(text + "\n")
    print(f"{len(SENTENCES)} clips in {out}")


async def transcribe_all(data: dict[str, Any], clips: list[Path]) -> list[dict[str, Any]]:
    rows = []
    async with Coordinator(parse_config(data)) as coord:
        for wav in clips:
            audio = read_wav(wav)
            t0 = time.monotonic()
            text = []
            async for out in await coord.submit(request(audio)):
                if out.data.get("text"):
                    text.append(str(out.data["text"]))
            took = time.monotonic() - t0
            ref, hyp = wav.with_suffix(".txt").read_text().strip(), "".join(text).strip()
            errors = edit_distance(words(ref), words(hyp))
            rows.append(
                {
                    "clip": wav.name,
                    "reference": ref,
                    "transcript": hyp,
                    "errors": errors,
                    "words": len(words(ref)),
                    "audio_s": round(len(audio) / RATE_HZ, 2),
                    "took_s": round(took, 3),
                }
            )
            print(f"{wav.name}: {errors}/{len(words(ref))} errors in {took:.2f} s: {hyp!r}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--make-clips", type=Path, help="speak SENTENCES into this folder, then exit")
    ap.add_argument("--clips", type=Path, default=ROOT / ".whl" / "wer-clips")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "qwen3-omni-1gpu.yaml")
    ap.add_argument("--model-path", default=os.environ.get("RTO_CHECKPOINT"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.make_clips:
        make_clips(args.make_clips)
        return
    data = yaml.safe_load(args.config.read_text())
    model_path = Path(args.model_path or data.get("model", {}).get("path", ""))
    result: dict[str, Any] = {"config": str(args.config), "model_path": str(model_path)}
    clips = sorted(args.clips.glob("*.wav")) if args.clips.is_dir() else []
    if not clips and shutil.which("espeak-ng"):
        make_clips(args.clips)
        clips = sorted(args.clips.glob("*.wav"))
    if not (model_path / "config.json").exists():
        result["skipped"] = f"no checkpoint at {model_path} (set --model-path or RTO_CHECKPOINT)"
    elif not clips:
        result["skipped"] = f"no clips in {args.clips} and no espeak-ng to speak them"
    if "skipped" in result:
        print("skipped:", result["skipped"])
    else:
        data.setdefault("model", {})["path"] = str(model_path)
        rows = asyncio.run(transcribe_all(data, clips))
        errors, total = sum(r["errors"] for r in rows), sum(r["words"] for r in rows)
        result.update(wer=round(errors / total, 4), errors=errors, words=total, clips=rows)
        audio_s, took_s = sum(r["audio_s"] for r in rows), sum(r["took_s"] for r in rows)
        print(
            f"WER {errors}/{total} = {errors / total:.1%} over {len(rows)} clips "
            f"({audio_s:.1f} s of speech transcribed in {took_s:.1f} s)"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
