"""Sample formats and rates, the one home of both: the server's two rates, a streaming resampler
(libsoxr), int16 <-> float32 (one scale, 32768, both ways), pcm16 bytes, G.711 mu-law and A-law.
float32 audio is mono in [-1, 1].

    r = Resampler(16000, 24000)
    out = r.process(chunk)      # any chunk size; state carries across calls
    tail = r.flush()            # the filter's last samples at the end of a stream
    resample(x, 16000, 24000)   # one shot, delay-compensated, len = ceil(len(x) * 24000 / 16000)
"""

from __future__ import annotations

import math

import numpy as np
import soxr

# The microphone's audio inside the server, whatever the transport's rate: the input buffer, the
# VAD's windows, the echo gate, a turn's audio and what the end-of-turn model hears.
INPUT_RATE_HZ = 16000
MODEL_RATE_HZ = 24000  # code2wav's output rate (Qwen3-Omni); a chunk may say `sample_rate_hz`
PCM16_SCALE = 32768.0  # int16 full scale: x / 32768 in, x * 32768 clipped to int16 out


class Resampler:
    """A streaming resampler from `src_hz` to `dst_hz`: libsoxr's high quality
    (`soxr.ResampleStream`, quality HQ), in C and linear in time, so a client's 6 MB append
    costs milliseconds of the event loop, not seconds. Its output is aligned with its input but
    held back by the filter's look-ahead (8 ms at 24 or 48 -> 16 kHz, 39 ms to 8 kHz) until
    more input or `flush` comes. Not thread-safe; one per stream."""

    def __init__(self, src_hz: int, dst_hz: int) -> None:
        if src_hz <= 0 or dst_hz <= 0:
            raise ValueError(f"sample rates must be positive, got {src_hz} -> {dst_hz}")
        self.src_hz, self.dst_hz = src_hz, dst_hz
        self._stream = None
        if src_hz != dst_hz:
            self._stream = soxr.ResampleStream(src_hz, dst_hz, 1, dtype="float32", quality="HQ")

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32).reshape(-1)
        if self._stream is None:
            return x.copy()
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        """What the filter still holds, at the end of a stream; the resampler then starts
        afresh (for a next stream)."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._stream.clear()
        return tail


def resample(x: np.ndarray, src_hz: int, dst_hz: int) -> np.ndarray:
    """Resample a whole signal, aligned with the input, `ceil(len(x) * dst / src)` samples."""
    x = np.asarray(x, np.float32).reshape(-1)
    if src_hz == dst_hz:
        return x.copy()
    want = math.ceil(len(x) * dst_hz / src_hz)
    y = soxr.resample(x, src_hz, dst_hz, quality="HQ").astype(np.float32, copy=False)
    if len(y) < want:
        y = np.concatenate([y, np.zeros(want - len(y), np.float32)])
    return y[:want]


# ---- pcm16 ---------------------------------------------------------------------------------


def int16_to_float(a: np.ndarray) -> np.ndarray:
    """int16 samples (or any integers in its range) -> float32 in [-1, 1)."""
    return (np.asarray(a, np.float32) / PCM16_SCALE).astype(np.float32)


def float_to_int16(x: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, rounded, clipped."""
    return np.rint(np.clip(np.asarray(x, np.float32) * PCM16_SCALE, -32768, 32767)).astype(np.int16)


def pcm16_to_float(data: bytes | np.ndarray) -> np.ndarray:
    """Little-endian signed 16-bit samples -> float32 in [-1, 1)."""
    a = np.frombuffer(data, "<i2") if isinstance(data, bytes | bytearray | memoryview) else data
    return int16_to_float(a)


def float_to_pcm16(x: np.ndarray) -> bytes:
    """float32 -> little-endian signed 16-bit bytes, clipped."""
    return float_to_int16(x).astype("<i2").tobytes()


# ---- G.711 (ITU-T G.711 segment law; tables built once) ----------------------------------


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << (seg - 1)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


def _ulaw_encode_table() -> np.ndarray:
    s = np.arange(-32768, 32768, dtype=np.int32) >> 2  # 14-bit
    mask = np.where(s < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(s), 8159) + 33
    seg = np.zeros_like(mag)
    for i in range(8):  # segment: how many of the ends 63, 127, ... 8191 lie below mag
        seg = np.where(mag >= (64 << i), i + 1, seg)
    code = (np.minimum(seg, 7) << 4) | ((mag >> (seg + 1)) & 0x0F)
    code = np.where(seg >= 8, 0x7F, code)
    return (code ^ mask).astype(np.uint8)


def _alaw_encode_table() -> np.ndarray:
    s = np.arange(-32768, 32768, dtype=np.int32) >> 3  # 13-bit
    sign = np.where(s >= 0, 0xD5, 0x55)
    mag = np.where(s >= 0, s, -s - 1)
    mag = np.minimum(mag, 0xFFF)
    seg = np.zeros_like(mag)
    for i in range(7):
        seg = np.where(mag >= (32 << i), i + 1, seg)
    shift = np.where(seg < 2, 1, seg)
    code = (seg << 4) | ((mag >> shift) & 0x0F)
    return (code ^ sign).astype(np.uint8)


_ULAW_DEC = _ulaw_decode_table()
_ALAW_DEC = _alaw_decode_table()
_ULAW_ENC = _ulaw_encode_table()
_ALAW_ENC = _alaw_encode_table()


def ulaw_encode(x: np.ndarray) -> bytes:
    return _ULAW_ENC[float_to_int16(x).astype(np.int32) + 32768].tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    return int16_to_float(_ULAW_DEC[np.frombuffer(data, np.uint8)])


def alaw_encode(x: np.ndarray) -> bytes:
    return _ALAW_ENC[float_to_int16(x).astype(np.int32) + 32768].tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    return int16_to_float(_ALAW_DEC[np.frombuffer(data, np.uint8)])
