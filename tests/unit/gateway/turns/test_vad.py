import numpy as np

from realtime_omni.gateway.turns.vad import (
    ServerVad,
    SpeechStarted,
    SpeechStopped,
    VadParams,
    Windower,
)


def run(vad: ServerVad, probs: list[float]) -> list[tuple[int, object]]:
    return [(i, ev) for i, p in enumerate(probs) if (ev := vad.feed(p)) is not None]


def test_start_with_prefix_padding_and_stop_after_silence() -> None:
    vad = ServerVad(VadParams(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500))
    probs = [0.0] * 20 + [0.9] * 30 + [0.0] * 20  # speech from window 20 (640 ms)
    events = run(vad, probs)
    assert events[0] == (20, SpeechStarted(audio_start_ms=340, detected_ms=672))
    # silence begins at window 50 (1600 ms); 500 ms later is window 65's end (2112 ms)
    i, ev = events[1]
    assert isinstance(ev, SpeechStopped) and ev.audio_end_ms == 2112 and i == 65
    assert len(events) == 2


def test_short_pause_does_not_end_the_turn() -> None:
    vad = ServerVad(VadParams(silence_duration_ms=500))
    probs = [0.9] * 10 + [0.0] * 10 + [0.9] * 10 + [0.0] * 20  # 320 ms pause < 500 ms
    kinds = [type(ev).__name__ for _, ev in run(vad, probs)]
    assert kinds == ["SpeechStarted", "SpeechStopped"]


def test_hysteresis_band_neither_starts_nor_ends_silence() -> None:
    vad = ServerVad(VadParams(threshold=0.5, silence_duration_ms=96))
    assert run(vad, [0.4] * 10) == []  # below threshold: no start
    assert isinstance(vad.feed(0.6), SpeechStarted)
    assert run(vad, [0.4] * 50) == []  # in the band (0.35..0.5): speech goes on
    events = run(vad, [0.1] * 3)
    assert [type(e).__name__ for _, e in events] == ["SpeechStopped"]


def test_prefix_padding_clamps_at_zero_and_reset_forgets_the_turn() -> None:
    vad = ServerVad()
    ev = vad.feed(1.0)
    assert ev == SpeechStarted(0, 32)
    vad.reset()
    assert not vad.speaking and vad.elapsed_ms == 32


def test_windower_cuts_any_chunks_into_512_sample_windows() -> None:
    w = Windower()
    x = np.arange(2000, dtype=np.float32)
    out = w.push(x[:700]) + w.push(x[700:1100]) + w.push(x[1100:])
    assert [len(a) for a in out] == [512, 512, 512]
    np.testing.assert_array_equal(np.concatenate(out), x[:1536])


def _voice(seconds: float, f0_hz: float, seed: int) -> np.ndarray:
    """A buzzy vowel-like sound with syllable-rate loudness and some noise."""
    t = np.arange(int(seconds * 16000)) / 16000
    x = sum(np.sin(2 * np.pi * f0_hz * k * t) / k for k in range(1, 12))
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    x += np.random.default_rng(seed).normal(0, 0.02, len(t))
    return (0.2 * x / np.abs(x).max()).astype(np.float32)


def test_batched_silero_matches_a_model_per_stream() -> None:
    """Streams judged together, with uneven window counts per pass and a reset, give each the
    probabilities its own silero model gives it alone."""
    import torch
    from silero_vad import load_silero_vad

    from realtime_omni.models.silero_vad import SileroVad

    vad = SileroVad()
    audio = [_voice(1.5, 110, 0), _voice(1.5, 220, 1), _voice(1.5, 165, 2)]
    windows = [Windower().push(a) for a in audio]
    streams = [vad.stream() for _ in audio]
    refs = [load_silero_vad() for _ in audio]

    def alone(i: int, ws: list[np.ndarray]) -> list[float]:
        with torch.inference_mode():
            return [float(refs[i](torch.from_numpy(w), 16000)) for w in ws]

    got: list[list[float]] = [[], [], []]
    want: list[list[float]] = [[], [], []]
    pos = [0, 0, 0]
    for step, counts in enumerate([(1, 3, 2), (4, 0, 1), (2, 5, 3), (6, 4, 8)]):
        if step == 2:  # forget stream 0's past, as a cleared input buffer does
            streams[0].reset()
            refs[0].reset_states()
        batch = []
        for i, n in enumerate(counts):
            batch.append((streams[i], windows[i][pos[i] : pos[i] + n]))
            want[i] += alone(i, batch[-1][1])
            pos[i] += n
        for i, probs in enumerate(vad.judge(batch)):
            got[i] += probs
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w) >= 12
        assert np.allclose(g, w, atol=1e-5), (g, w)
    assert not np.allclose(got[0][:12], got[1][:12], atol=1e-3)  # the streams were told apart


def test_silence_is_judged_without_the_model_and_the_stream_starts_afresh() -> None:
    import torch
    from silero_vad import load_silero_vad

    from realtime_omni.models.silero_vad import SileroVad

    vad = SileroVad()
    voice = Windower().push(_voice(1.0, 140, 3))
    quiet = [np.full(512, 5e-4, np.float32)] * 3  # -66 dBFS
    st = vad.stream()
    (got,) = vad.judge([(st, voice[:10] + quiet + voice[10:])])
    assert got[10:13] == [0.0, 0.0, 0.0]
    fresh = load_silero_vad()
    with torch.inference_mode():
        want = [float(fresh(torch.from_numpy(w), 16000)) for w in voice[10:]]
    assert np.allclose(got[13:], want, atol=1e-5)
