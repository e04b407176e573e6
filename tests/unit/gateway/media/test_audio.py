import numpy as np
import pytest

from realtime_omni.gateway.media import audio

RATES = [
    (16000, 24000),
    (24000, 16000),
    (48000, 16000),
    (8000, 16000),
    (24000, 48000),
    (24000, 8000),
    (22050, 16000),
    (16000, 16000),
]


@pytest.mark.parametrize(("src", "dst"), RATES)
def test_resample_keeps_a_tone(src: int, dst: int) -> None:
    x = np.sin(2 * np.pi * 440 * np.arange(src) / src).astype(np.float32)
    y = audio.resample(x, src, dst)
    assert len(y) == dst
    ref = np.sin(2 * np.pi * 440 * np.arange(dst) / dst)
    assert np.abs(y[200:-200] - ref[200:-200]).max() < 1e-3


@pytest.mark.parametrize(("src", "dst"), RATES)
def test_streaming_equals_one_call(src: int, dst: int) -> None:
    x = np.random.default_rng(0).standard_normal(src // 2).astype(np.float32)
    a = audio.Resampler(src, dst)
    parts = [a.process(x[i : i + 317]) for i in range(0, len(x), 317)]
    whole = audio.Resampler(src, dst).process(x)
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5)


def test_downsampling_removes_what_cannot_be_represented() -> None:
    x = np.sin(2 * np.pi * 7000 * np.arange(48000) / 48000).astype(np.float32)  # above 4 kHz
    y = audio.resample(x, 48000, 8000)
    assert np.abs(y[100:-100]).max() < 0.01


def test_pcm16_round_trip() -> None:
    s = np.arange(-32768, 32768, 7, dtype=np.int16)
    f = audio.pcm16_to_float(s.tobytes())
    assert f.dtype == np.float32 and f.min() == -1.0
    assert audio.float_to_pcm16(f) == s.tobytes()
    assert (
        audio.float_to_pcm16(np.array([2.0, -2.0], np.float32))
        == np.array([32767, -32768], "<i2").tobytes()
    )


# Reference values from the ITU-T G.711 tables (the same as Python's old audioop module).
def test_ulaw_known_codes() -> None:
    x = np.array([0, 1000, -1000, 32767, -32768], np.float32) / 32768
    assert audio.ulaw_encode(x) == bytes([0xFF, 0xCE, 0x4E, 0x80, 0x00])
    assert list(np.rint(audio.ulaw_decode(bytes([0xFF, 0x80, 0x00])) * 32768)) == [0, 32124, -32124]


def test_alaw_known_codes() -> None:
    x = np.array([0, 1000, -1000, 32767, -32768], np.float32) / 32768
    assert audio.alaw_encode(x) == bytes([0xD5, 0xFA, 0x7A, 0xAA, 0x2A])
    assert list(np.rint(audio.alaw_decode(bytes([0xD5, 0xAA, 0x2A])) * 32768)) == [8, 32256, -32256]


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
def test_g711_round_trip_error_is_small(law: str) -> None:
    enc, dec = getattr(audio, f"{law}_encode"), getattr(audio, f"{law}_decode")
    x = np.sin(2 * np.pi * 300 * np.arange(8000) / 8000).astype(np.float32) * 0.5
    y = dec(enc(x))
    assert len(enc(x)) == len(x)
    assert np.abs(y - x).max() < 0.02  # segment law: error grows with amplitude, ~3% at most
    assert dec(bytes(range(256))).shape == (256,)


def test_int16_scaling_is_one_scale_both_ways() -> None:
    from realtime_omni.gateway.media.audio import PCM16_SCALE, float_to_int16, int16_to_float

    ints = np.array([-32768, -1, 0, 1, 32767], np.int16)
    assert np.array_equal(float_to_int16(int16_to_float(ints)), ints)  # exact round trip
    assert int16_to_float(ints)[0] == -1.0 and PCM16_SCALE == 32768.0
    assert float_to_int16(np.array([1.5, -1.5], np.float32)).tolist() == [32767, -32768]
