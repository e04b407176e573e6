"""Sample formats and rates: a streaming polyphase resampler, pcm16 <-> float32, G.711 mu-law and
A-law. numpy only; float32 audio is mono in [-1, 1].

    r = Resampler(16000, 24000)
    out = r.process(chunk)      # any chunk size; state carries across calls
    tail = r.flush()            # the filter's last samples at the end of a stream
    resample(x, 16000, 24000)   # one shot, delay-compensated, len = ceil(len(x) * 24000 / 16000)
"""

from __future__ import annotations

import math

import numpy as np

_ZERO_CROSSINGS = 16  # filter half-length in zero crossings of the narrower band: ~-60 dB stop band


class Resampler:
    """A causal windowed-sinc polyphase resampler from `src_hz` to `dst_hz` for a stream.

    It delays its output by `delay` output samples (under 1 ms at the rates used here). Not
    thread-safe; one per stream. The state is the last `taps - 1` input samples.
    """

    def __init__(self, src_hz: int, dst_hz: int) -> None:
        if src_hz <= 0 or dst_hz <= 0:
            raise ValueError(f"sample rates must be positive, got {src_hz} -> {dst_hz}")
        g = math.gcd(src_hz, dst_hz)
        self.src_hz, self.dst_hz = src_hz, dst_hz
        self.up, self.down = dst_hz // g, src_hz // g
        L, M = self.up, self.down
        if L == M == 1:
            self.taps, self.delay = 1, 0.0
            return
        stride = max(L, M)  # the upsampled signal's samples per zero crossing of the filter
        half = _ZERO_CROSSINGS * stride
        n = np.arange(-half, half + 1)
        h = np.sinc(n / stride) * np.kaiser(len(n), 8.0) / stride * L
        self.taps = math.ceil(len(h) / L)
        h = np.concatenate([h, np.zeros(self.taps * L - len(h))])
        # phase p, tap j: h[p + j*L]; output n reads input i = (n*M)//L - j with phase (n*M) % L.
        self._phases = h.reshape(self.taps, L).T.astype(np.float32)
        self.delay = half / M  # group delay, in output samples
        self._hist = np.zeros(self.taps - 1, np.float32)
        self._consumed = 0  # input samples seen
        self._made = 0  # output samples made

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32).reshape(-1)
        if self.up == self.down == 1:
            return x.copy()
        L, M = self.up, self.down
        buf = np.concatenate([self._hist, x])
        base = self._consumed - (self.taps - 1)  # absolute input index of buf[0]
        self._consumed += len(x)
        # Every output n whose newest input (n*M)//L has arrived.
        end = (self._consumed * L + M - 1) // M
        n = np.arange(self._made, end)
        self._made = end
        self._hist = buf[len(buf) - (self.taps - 1) :].copy()
        if not len(n):
            return np.zeros(0, np.float32)
        newest = (n * M) // L - base
        idx = newest[:, None] - np.arange(self.taps)[None, :]
        return np.einsum("ij,ij->i", buf[idx], self._phases[(n * M) % L]).astype(np.float32)

    def flush(self) -> np.ndarray:
        """The output still held in the filter (feeds zeros); the resampler can go on after."""
        if self.up == self.down == 1:
            return np.zeros(0, np.float32)
        return self.process(np.zeros(self.taps, np.float32))


def resample(x: np.ndarray, src_hz: int, dst_hz: int) -> np.ndarray:
    """Resample a whole signal, aligned with the input (the filter delay removed)."""
    x = np.asarray(x, np.float32).reshape(-1)
    if src_hz == dst_hz:
        return x.copy()
    r = Resampler(src_hz, dst_hz)
    want = math.ceil(len(x) * dst_hz / src_hz)
    skip = round(r.delay)
    pad = np.zeros(math.ceil((skip + 1) * src_hz / dst_hz) + r.taps, np.float32)
    y = np.concatenate([r.process(x), r.process(pad)])
    return y[skip : skip + want]


# ---- pcm16 ---------------------------------------------------------------------------------


def pcm16_to_float(data: bytes | np.ndarray) -> np.ndarray:
    """Little-endian signed 16-bit samples -> float32 in [-1, 1)."""
    a = np.frombuffer(data, "<i2") if isinstance(data, bytes | bytearray | memoryview) else data
    return (np.asarray(a, np.float32) / 32768.0).astype(np.float32)


def float_to_pcm16(x: np.ndarray) -> bytes:
    """float32 -> little-endian signed 16-bit bytes, clipped."""
    a = np.clip(np.asarray(x, np.float32) * 32768.0, -32768, 32767)
    return np.rint(a).astype("<i2").tobytes()


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


def _to_i16(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(np.asarray(x, np.float32) * 32768.0, -32768, 32767)).astype(np.int16)


def ulaw_encode(x: np.ndarray) -> bytes:
    return _ULAW_ENC[_to_i16(x).astype(np.int32) + 32768].tobytes()


def ulaw_decode(data: bytes) -> np.ndarray:
    return (_ULAW_DEC[np.frombuffer(data, np.uint8)] / 32768.0).astype(np.float32)


def alaw_encode(x: np.ndarray) -> bytes:
    return _ALAW_ENC[_to_i16(x).astype(np.int32) + 32768].tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    return (_ALAW_DEC[np.frombuffer(data, np.uint8)] / 32768.0).astype(np.float32)
