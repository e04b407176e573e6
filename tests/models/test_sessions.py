"""A conversation's turns continue the thinker's kept KV cache, with the result of a full
prefill: after an answer as generated, after an answer cut by a barge-in, after eviction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import SYSTEM, chirp

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 6, "talker_max_tokens": 12}


def pipeline(**thinker: Any) -> InProcess:
    return InProcess(tiny_config(thinker=thinker))


def turn(p: InProcess, rid: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    p.submit(rid, {"messages": messages, "audio0": chirp(), **GREEDY, **extra})
    p.run()
    out = p.outputs[rid]
    return {
        "ids": [o["token_id"] for o in out["decode"]],
        "text": "".join(o["text"] for o in out["decode"]),
        "codes": np.concatenate([o["codes"] for o in out["code2wav"]]),
        "cached": out["decode"][0]["cached_tokens"],
        "prefilled": out["decode"][0]["prefill_tokens"],
    }


def user(text: str, audio: bool = False) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "audio", "audio": "audio0"}] if audio else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def test_ten_turns_with_kept_caches_match_a_full_prefill_every_turn(tiny_dir: Path) -> None:
    """Spoken and typed turns, a barge-in at turn 5 (the answer kept as far as heard), the
    thinker and talker restarted after turn 7: every turn gives the tokens and codec frames of a
    full prefill of the same history, and so does a session evicted after every turn."""
    kept = pipeline()
    fresh = pipeline()
    evicting = InProcess(
        tiny_config(thinker={"session_cache_tokens": 1}, talker_ar={"session_cache_tokens": 1})
    )
    history = [SYSTEM]
    previous = 0  # the tokens the previous turn's prompt and answer put in the thinker's cache
    for i in range(1, 11):
        history.append(user(f"Point {i}.", audio=i % 2 == 1))
        if i == 5:  # the person talks over the answer after two tokens
            for p in (kept, fresh, evicting):
                p.submit(f"t{i}", {"messages": history, "audio0": chirp(), **GREEDY,
                                   "max_tokens": 30, "session_id": "s"})  # fmt: skip
            for p in (kept, fresh, evicting):
                while len(p.outputs[f"t{i}"]["decode"]) < 2:
                    p.step()
                p.abort(f"t{i}")
            texts = {"".join(o["text"] for o in p.outputs[f"t{i}"]["decode"][:2])
                     for p in (kept, fresh, evicting)}  # fmt: skip
            assert len(texts) == 1
            history.append({"role": "assistant", "content": texts.pop()})
            previous = 0
            continue
        got = turn(kept, f"t{i}", history, session_id="s")
        ref = turn(fresh, f"t{i}", history)  # no session: a full prefill
        ev = turn(evicting, f"t{i}", history, session_id="s")
        assert got["ids"] == ref["ids"] == ev["ids"] and got["ids"], i
        np.testing.assert_array_equal(got["codes"], ref["codes"])
        np.testing.assert_array_equal(ev["codes"], ref["codes"])
        assert ref["cached"] == 0 and ev["cached"] == 0
        if i in (1, 8):  # the first turn, and the first after the restart
            assert got["cached"] == 0
        else:  # everything up to the previous answer (or what was heard of it) was kept
            assert got["cached"] >= previous and got["prefilled"] < ref["prefilled"] / 2
        previous = got["cached"] + got["prefilled"]
        history.append({"role": "assistant", "content": got["text"]})
        if i == 7:
            kept.restart("thinker")
            kept.restart("talker_ar")
    talker = kept.stages["talker_ar"].executor
    assert list(talker.sessions) == ["s"]  # type: ignore[attr-defined]


def test_a_turn_after_a_barge_in_continues_from_what_was_heard(tiny_dir: Path) -> None:
    kept, fresh = pipeline(), pipeline()
    history = [SYSTEM, user("Tell me a story.", audio=True)]
    kept.submit("a", {"messages": history, "audio0": chirp(), **GREEDY, "max_tokens": 40,
                      "session_id": "s"})  # fmt: skip
    while len(kept.outputs["a"]["decode"]) < 4:
        kept.step()
    heard = "".join(o["text"] for o in kept.outputs["a"]["decode"][:2])
    kept.abort("a")  # the person talked over it after two tokens
    history = [*history, {"role": "assistant", "content": heard}, user("Wait, stop.")]
    got = turn(kept, "b", history, session_id="s")
    ref = turn(fresh, "b", history)
    assert got["ids"] == ref["ids"]
    np.testing.assert_array_equal(got["codes"], ref["codes"])
    assert got["cached"] > 0 and got["prefilled"] < ref["prefilled"]
    assert kept.stages["thinker"].executor.cache.in_use() == 1  # type: ignore[attr-defined]


def test_the_audio_encoder_encodes_each_clip_of_a_conversation_once(tiny_dir: Path) -> None:
    """Turn 2 carries turn 1's clip again and a new one: only the new one is encoded, and the
    turn's tokens and frames are those of a pipeline that encodes both afresh."""
    kept, fresh = pipeline(), pipeline()
    encoded: list[int] = []
    ex = kept.stages["audio_encoder"].executor
    encode = ex._encode_windows  # type: ignore[attr-defined]
    ex._encode_windows = lambda todo: encoded.append(len(todo)) or encode(todo)  # type: ignore[attr-defined]
    one = [SYSTEM, user("First.", audio=True)]
    got = turn(kept, "a", one, session_id="s")
    two = [*one, {"role": "assistant", "content": got["text"]}]
    payload = {"messages": [*two, {"role": "user", "content": [
        {"type": "audio", "audio": "audio1"}, {"type": "text", "text": "And this?"}]}],
        "audio0": chirp(), "audio1": chirp(0.6), **GREEDY}  # fmt: skip
    kept.submit("b", {**payload, "session_id": "s"})
    kept.run()
    fresh.submit("b", payload)
    fresh.run()
    assert encoded == [1, 1]  # turn 1: its clip; turn 2: the new clip only
    for name in ("decode", "code2wav"):
        a, b = kept.outputs["b"][name], fresh.outputs["b"][name]
        key = "token_id" if name == "decode" else "codes"
        assert [str(o[key]) for o in a] == [str(o[key]) for o in b]
