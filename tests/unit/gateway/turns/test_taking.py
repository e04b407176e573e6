"""The turn-taker on lists of window probabilities and a fake clock: no session, no event
loop, no model."""

from __future__ import annotations

from dataclasses import replace

from realtime_omni.gateway.protocol.settings import TurnDetection
from realtime_omni.gateway.turns.policy import TurnParams
from realtime_omni.gateway.turns.taking import (
    Action,
    AskEndOfTurn,
    BargeIn,
    Discard,
    IdleTimeout,
    Pause,
    Prefill,
    Resume,
    Speculate,
    SpeechStart,
    TurnEnd,
    TurnTaker,
)


def feed(taker: TurnTaker, probs: list[float], responding: bool = False) -> list[Action]:
    return [a for p in probs for a in taker.window(p, responding)]


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_speech_then_silence_is_a_turn_with_its_audio_bounds() -> None:
    taker = TurnTaker(TurnDetection())
    out = feed(taker, [0.0] * 15 + [0.9] * 10 + [0.0] * 16)  # 512 ms of silence ends it
    # At 160 ms of silence (preemptive_ms) the answer to the turn so far starts, held back.
    assert kinds(out) == ["SpeechStart", "Speculate", "TurnEnd"]
    start, spec, end = out
    assert isinstance(start, SpeechStart) and isinstance(end, TurnEnd)
    assert isinstance(spec, Speculate) and spec.item_id == start.item_id
    assert start.audio_start_ms == 15 * 32 - 300  # the prefix padding before the first window
    assert spec.audio_start_ms == start.audio_start_ms and spec.audio_end_ms == 30 * 32
    assert end.item_id == start.item_id and end.audio_start_ms == start.audio_start_ms
    assert end.audio_end_ms == 41 * 32 and end.respond
    assert end.held_end_ms == 30 * 32  # the held answer's turn: released as it is
    assert not taker.speaking and taker.turn_item_id is None


def test_without_turn_detection_nothing_is_decided() -> None:
    assert feed(TurnTaker(None), [0.9] * 10 + [0.0] * 30) == []


def test_a_blip_over_the_answer_pauses_it_then_resumes_and_is_no_turn() -> None:
    taker = TurnTaker(TurnDetection())
    out = feed(taker, [0.9] * 3 + [0.0] * 20, responding=True)  # resume_after_ms: 16 windows
    assert kinds(out) == ["SpeechStart", "Pause", "Resume", "Discard"]
    first, last = out[0], out[-1]
    assert isinstance(first, SpeechStart) and isinstance(last, Discard)
    assert last.item_id == first.item_id and last.audio_end_ms == 19 * 32
    assert not taker.paused


def test_speech_over_the_answer_past_min_interruption_barges_in_and_goes_on_as_a_turn() -> None:
    taker = TurnTaker(TurnDetection())  # min_interruption_ms 700: 22 windows
    out = feed(taker, [0.9] * 30, responding=True)
    assert kinds(out) == ["SpeechStart", "Pause", "BargeIn"]
    assert kinds(feed(taker, [0.0] * 16, responding=True)) == ["TurnEnd"]


def test_min_interruption_zero_barges_in_at_once() -> None:
    td = replace(TurnDetection(), turns=TurnParams(min_interruption_ms=0))
    out = feed(TurnTaker(td), [0.9], responding=True)
    assert kinds(out) == ["SpeechStart", "BargeIn"] and isinstance(out[1], BargeIn)


def test_without_interrupt_response_speech_over_the_answer_is_just_a_turn() -> None:
    td = replace(TurnDetection(), interrupt_response=False)
    out = feed(TurnTaker(td), [0.9] * 3 + [0.0] * 16, responding=True)
    assert kinds(out) == ["SpeechStart", "TurnEnd"]


def test_no_audio_at_all_while_paused_resumes_the_answer() -> None:
    taker = TurnTaker(TurnDetection())
    assert isinstance(feed(taker, [0.9], responding=True)[-1], Pause)
    assert taker.paused and taker.resume_after_s == 0.5
    out = taker.quiet(responding=True)
    assert [type(a) for a in out] == [Resume, Discard] and not taker.paused


def test_a_truncate_while_paused_takes_the_speech_for_a_turn() -> None:
    taker = TurnTaker(TurnDetection())
    assert not taker.truncated()
    feed(taker, [0.9] * 3, responding=True)
    assert taker.truncated() and not taker.paused
    assert kinds(feed(taker, [0.0] * 16)) == ["Speculate", "TurnEnd"]  # not discarded


def test_semantic_vad_asks_the_model_once_the_speech_pauses_and_a_fresh_yes_ends_the_turn() -> None:
    td = replace(TurnDetection(), eagerness="high")
    taker = TurnTaker(td, semantic=True)
    out = feed(taker, [0.9] * 10 + [0.0] * 7)  # the 7th silent window: 224 ms
    assert kinds(out) == ["SpeechStart", "Speculate", "AskEndOfTurn"]  # the 5th: 160 ms
    ask = out[-1]
    assert isinstance(ask, AskEndOfTurn) and ask.audio_end_ms == 17 * 32
    assert taker.end_of_turn(ask.ask, 0.2) == []  # not complete: the VAD's silence decides
    (end,) = taker.end_of_turn(ask.ask, 0.9)
    assert isinstance(end, TurnEnd) and end.audio_end_ms == 17 * 32
    assert end.held_end_ms == 15 * 32  # the answer started at the pause is the one released
    assert taker.end_of_turn(ask.ask, 0.9) == []  # the turn is over: a late answer is stale


def test_semantic_vad_without_a_model_is_the_silence_rule() -> None:
    td = replace(TurnDetection(), eagerness="high")
    out = feed(TurnTaker(td, semantic=False), [0.9] * 10 + [0.0] * 20)
    assert kinds(out) == ["SpeechStart", "Speculate", "TurnEnd"]


def test_idle_timeout_on_a_fake_clock() -> None:
    taker = TurnTaker(replace(TurnDetection(), idle_timeout_ms=5000))
    assert taker.answered(100.0) == 105.0
    assert taker.idle(104.9, responding=False) == []
    assert [type(a) for a in taker.idle(105.0, responding=False)] == [IdleTimeout]
    assert taker.idle(106.0, responding=False) == []  # once
    taker.answered(200.0)
    feed(taker, [0.9])  # speech disarms it
    assert taker.idle(205.0, responding=False) == []
    taker.answered(300.0)
    assert taker.idle(305.0, responding=True) == []  # an answer is on anyway
    assert TurnTaker(TurnDetection()).answered(0.0) is None  # off by default


def test_clear_forgets_the_turn_in_progress_and_moves_the_vads_clock() -> None:
    taker = TurnTaker(TurnDetection())
    feed(taker, [0.9] * 5)
    taker.clear(elapsed_ms=1000.0)
    assert not taker.speaking and taker.turn_item_id is None
    (start,) = feed(taker, [0.9])
    assert isinstance(start, SpeechStart) and start.audio_start_ms == 1000 - 300


def test_a_pause_mid_sentence_speculates_and_speech_after_it_abandons_then_speculates_again() -> (
    None
):
    """ "I'd like to book a table for... four people": the answer to the first half is computed
    at the pause and abandoned when they go on; the turn's end releases the second one, which
    heard all of it."""
    taker = TurnTaker(TurnDetection())
    out = feed(taker, [0.9] * 20 + [0.0] * 10 + [0.9] * 20 + [0.0] * 16)
    assert kinds(out) == ["SpeechStart", "Speculate", "Abandon", "Speculate", "TurnEnd"]
    first, second, end = out[1], out[3], out[4]
    assert isinstance(first, Speculate) and isinstance(second, Speculate)
    assert first.audio_end_ms == 25 * 32 and second.audio_end_ms == 55 * 32
    assert isinstance(end, TurnEnd) and end.held_end_ms == second.audio_end_ms


def test_no_speculation_while_an_answer_is_active_or_when_off() -> None:
    out = feed(TurnTaker(TurnDetection()), [0.9] * 3 + [0.0] * 20, responding=True)
    assert "Speculate" not in kinds(out)  # a blip over the answer: judged, never answered
    off = replace(TurnDetection(), turns=TurnParams(preemptive_ms=None))
    out = feed(TurnTaker(off), [0.9] * 10 + [0.0] * 16)
    assert kinds(out) == ["SpeechStart", "TurnEnd"]
    end = out[-1]
    assert isinstance(end, TurnEnd) and end.held_end_ms is None
    manual = replace(TurnDetection(), create_response=False)  # nothing would be answered
    assert "Speculate" not in kinds(feed(TurnTaker(manual), [0.9] * 10 + [0.0] * 16))


def test_prefill_while_speaking_at_the_start_and_at_each_whole_encoder_window() -> None:
    td = replace(TurnDetection(), turns=TurnParams(prefill_while_speaking=True))
    taker = TurnTaker(td)
    out = feed(taker, [0.0] * 10 + [0.9] * 600)  # 19.2 s of speech: two whole 8 s windows
    prefills = [a for a in out if isinstance(a, Prefill)]
    start = out[0]
    assert isinstance(start, SpeechStart)
    assert [p.audio_end_ms for p in prefills] == [
        11 * 32,
        251 * 32,
        501 * 32,
    ]  # 8 s of the turn (padding in) each
    assert all(p.item_id == start.item_id and p.audio_start_ms == 10 * 32 - 300 for p in prefills)
    assert "Prefill" not in kinds(feed(TurnTaker(TurnDetection()), [0.9] * 300))  # off: none
