"""The turn policy on probability traces, the VAD in front of it as the session runs them."""

from __future__ import annotations

from realtime_omni.gateway.turns.policy import Decision, TurnParams, TurnPolicy
from realtime_omni.gateway.turns.vad import ServerVad

W = 32.0  # ms per window


def run(trace: list[float], bot: bool = True, params: TurnParams | None = None) -> list[tuple]:
    """(window index, decision) for each decision the trace brings; a DISCARD resets the VAD,
    as the session does when it drops the blip."""
    vad, policy, out = ServerVad(), TurnPolicy(params), []
    for i, p in enumerate(trace):
        for d in policy.feed(p, vad.feed(p), bot_speaking=bot):
            out.append((i, d))
            if d is Decision.DISCARD:
                vad.reset()
    return out


def ms(n: float) -> int:
    return round(n / W)


def test_a_backchannel_over_the_bot_pauses_then_resumes_and_is_dropped() -> None:
    trace = [0.0] * 10 + [0.9] * ms(300) + [0.05] * 30  # "mhm": 300 ms
    got = run(trace)
    assert got[0] == (10, Decision.PAUSE)  # the very window speech was detected
    assert [d for _, d in got[1:]] == [Decision.RESUME, Decision.DISCARD]
    resumed_at = got[1][0]
    assert (resumed_at - (10 + ms(300)) + 1) * W >= TurnParams().resume_after_ms


def test_speech_over_the_bot_past_min_interruption_is_a_barge_in() -> None:
    trace = [0.0] * 5 + [0.9] * ms(1500) + [0.0] * 30  # "wait, stop, I have a question"
    got = run(trace)
    assert got[0] == (5, Decision.PAUSE)
    assert got[1][1] == Decision.BARGE_IN and len(got) == 2
    need = TurnParams().min_interruption_ms
    assert (got[1][0] - 5 + 1) * W >= need and (got[1][0] - 5) * W < need + W


def test_short_gaps_inside_an_interruption_do_not_resume_it() -> None:
    # four 200 ms bursts with 150 ms gaps: 800 ms of speech, never long silent
    burst, gap = [0.9] * ms(200), [0.1] * ms(150)
    got = run([0.0] * 3 + burst + gap + burst + gap + burst + gap + burst + [0.0] * 20)
    assert [d for _, d in got] == [Decision.PAUSE, Decision.BARGE_IN]


def test_windows_between_the_thresholds_are_neither_speech_nor_silence() -> None:
    got = run([0.0] * 3 + [0.9] * 3 + [0.4] * 40)  # 96 ms of speech, then undecided
    assert [d for _, d in got] == [Decision.PAUSE]  # still paused, waiting


def test_without_the_bot_speaking_the_policy_stays_out_of_the_way() -> None:
    assert run([0.0] * 3 + [0.9] * 40 + [0.0] * 30, bot=False) == []


def test_min_interruption_zero_is_the_old_immediate_barge_in() -> None:
    got = run([0.0] * 3 + [0.9] * 2 + [0.0] * 30, params=TurnParams(min_interruption_ms=0))
    assert got == [(3, Decision.BARGE_IN)]


def test_a_cough_then_real_speech_is_one_interruption_once_it_is_long_enough() -> None:
    cough = [0.95] * ms(150)
    got = run([0.0] * 3 + cough + [0.0] * ms(700) + [0.9] * ms(1000))
    kinds = [d for _, d in got]
    assert kinds == [Decision.PAUSE, Decision.RESUME, Decision.DISCARD, Decision.PAUSE,
                     Decision.BARGE_IN]  # fmt: skip


def silero_trace(texts: list[str], gap_s: float = 0.0) -> list[float]:
    """silero-vad's window probabilities of espeak-ng speech: a trace recorded from the model,
    with `gap_s` of silence before and after each text."""
    import numpy as np
    import pytest

    from realtime_omni.clients.webrtc import espeak
    from realtime_omni.gateway.media.audio import resample
    from realtime_omni.gateway.turns.vad import Windower
    from realtime_omni.models.silero_vad import SileroVad

    vad = SileroVad()
    stream = vad.stream()
    parts = []
    for text in texts:
        spoken = espeak(text)
        if spoken is None:
            pytest.skip("espeak-ng is not installed")
        pad = np.zeros(int(16000 * gap_s), np.float32)
        parts += [pad, resample(spoken[0], spoken[1], 16000), pad]
    windows = Windower().push(np.concatenate(parts))
    import asyncio

    return asyncio.run(stream.probs(windows))


def test_recorded_backchannels_over_the_bot_resume_it_and_an_interruption_cuts_it() -> None:
    for word in ["mhm", "uh-huh", "yeah", "okay", "right"]:
        got = [d for _, d in run([0.0] * 5 + silero_trace([word], 0.6))]
        assert Decision.BARGE_IN not in got, (word, got)
        assert got[-2:] == [Decision.RESUME, Decision.DISCARD], (word, got)
    got = [d for _, d in run([0.0] * 5 + silero_trace(["Wait, stop, I have a question."], 0.6))]
    assert got == [Decision.PAUSE, Decision.BARGE_IN]
