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
    Resume,
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
    assert kinds(out) == ["SpeechStart", "TurnEnd"]
    start, end = out
    assert isinstance(start, SpeechStart) and isinstance(end, TurnEnd)
    assert start.audio_start_ms == 15 * 32 - 300  # the prefix padding before the first window
    assert end.item_id == start.item_id and end.audio_start_ms == start.audio_start_ms
    assert end.audio_end_ms == 41 * 32 and end.respond
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
    assert kinds(feed(taker, [0.0] * 16)) == ["TurnEnd"]  # not discarded


def test_semantic_vad_asks_the_model_once_the_speech_pauses_and_a_fresh_yes_ends_the_turn() -> None:
    td = replace(TurnDetection(), eagerness="high")
    taker = TurnTaker(td, semantic=True)
    out = feed(taker, [0.9] * 10 + [0.0] * 7)  # the 7th silent window: 224 ms
    assert kinds(out) == ["SpeechStart", "AskEndOfTurn"]
    ask = out[-1]
    assert isinstance(ask, AskEndOfTurn) and ask.audio_end_ms == 17 * 32
    assert taker.end_of_turn(ask.ask, 0.2) == []  # not complete: the VAD's silence decides
    (end,) = taker.end_of_turn(ask.ask, 0.9)
    assert isinstance(end, TurnEnd) and end.audio_end_ms == 17 * 32
    assert taker.end_of_turn(ask.ask, 0.9) == []  # the turn is over: a late answer is stale


def test_semantic_vad_without_a_model_is_the_silence_rule() -> None:
    td = replace(TurnDetection(), eagerness="high")
    out = feed(TurnTaker(td, semantic=False), [0.9] * 10 + [0.0] * 20)
    assert kinds(out) == ["SpeechStart", "TurnEnd"]


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
