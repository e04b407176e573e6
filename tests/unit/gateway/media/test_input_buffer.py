import numpy as np

from realtime_omni.gateway.media.audio import INPUT_RATE_HZ
from realtime_omni.gateway.media.input_buffer import AudioCredit, InputBuffer


def test_slices_by_absolute_index_across_chunks_and_after_trim() -> None:
    buf = InputBuffer()
    for i in range(4):
        buf.push(np.full(100, i, np.float32), INPUT_RATE_HZ)
    assert (buf.start, buf.end) == (0, 400)
    assert buf.slice(150, 250).tolist() == [1.0] * 50 + [2.0] * 50
    buf.trim(250)  # drops the chunks that end before it, keeps the one it falls in
    assert buf.start == 200
    assert buf.slice(0, 400).tolist() == [2.0] * 100 + [3.0] * 100
    buf.clear()
    assert (buf.start, buf.end) == (400, 400) and len(buf.slice(0, 400)) == 0


def test_int16_and_other_rates_become_16khz_float() -> None:
    buf = InputBuffer()
    got = buf.push(np.full(4800, 16384, np.int16), 48000)  # 100 ms at 48 kHz
    assert got.dtype == np.float32
    assert abs(buf.end - 1600) <= 140  # the resampler holds back its look-ahead (8 ms)
    assert np.allclose(got[len(got) // 2], 0.5, atol=0.01)


def test_old_audio_is_dropped_past_the_limit() -> None:
    buf = InputBuffer(max_ms=100)  # 1,600 samples
    for _ in range(10):
        buf.push(np.zeros(800, np.float32), INPUT_RATE_HZ)
    assert buf.end == 8000
    assert buf.end - buf.start <= 1600 + 800  # whole chunks go: at most one chunk over
    assert len(buf.slice(0, buf.end)) == buf.end - buf.start


def test_audio_credit_allows_a_burst_then_a_multiple_of_real_time() -> None:
    c = AudioCredit(burst_s=10.0, speed=4.0)
    assert c.take(8.0, now=100.0) and not c.take(3.0, now=100.0)  # 2 s left
    assert c.take(2.0, now=100.0)
    assert not c.take(4.5, now=101.0) and c.take(4.0, now=101.0)  # 1 s: 4 s of audio
    assert not c.take(0.1, now=101.0)
    assert c.take(10.0, now=200.0) and not c.take(0.1, now=200.0)  # never above the burst
    assert not AudioCredit().take(750.0, now=0.0)  # 750 s of noise at once
