"""The KV pool under pressure: no running answer dies for a newcomer's sake.

The pools are made small (a few dozen blocks of 16 tokens) so that a few tiny requests (a
33-token prompt and their answers) fill them: newcomers wait or are preempted and recomputed,
and every answer is, token for token and code for code, the one it gives alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import SYSTEM, conversation
from tests.models.test_sessions import GREEDY, turn, user

# 12 blocks: a 120-token answer (10 blocks) and the start of two more.
TIGHT = {"kv_cache_tokens": 192, "admit_margin_tokens": 16}


def _text(max_tokens: int) -> dict[str, Any]:
    return {**conversation("text"), **GREEDY, "max_tokens": max_tokens, "text_only": True}


def _alone(payload: dict[str, Any], **params: dict[str, Any]) -> dict[str, Any]:
    p = InProcess(tiny_config(**params))
    p.submit("x", payload)
    p.run()
    return p.outputs["x"]


def _ids(out: dict[str, Any]) -> list[int]:
    return [o["token_id"] for o in out["decode"]]


def _step_until(p: InProcess, rid: str, stage: str, n: int) -> None:
    while len(p.outputs[rid][stage]) < n:
        p.step()


def test_a_long_answer_completes_as_alone_while_newcomers_are_preempted_and_recomputed(
    tiny_dir: Path,
) -> None:
    long, short = _text(120), _text(60)
    p = InProcess(tiny_config(thinker=TIGHT))
    p.submit("a", long)
    _step_until(p, "a", "decode", 5)
    p.submit("b", short)
    p.submit("c", short)
    p.run()
    thinker = p.stages["thinker"]
    ex: Any = thinker.executor
    assert thinker.failures == []
    assert ex.preemptions >= 2  # the newest paid each time, and came back
    assert _ids(p.outputs["a"]) == _ids(_alone(long))
    want = _ids(_alone(short))
    assert len(want) == 60
    assert _ids(p.outputs["b"]) == want and _ids(p.outputs["c"]) == want  # nothing sent twice
    assert ex.cache.blocks_in_use() == 0 and ex.cache.in_use() == 0


def test_the_talker_preempts_the_newest_and_every_answer_sounds_as_alone(tiny_dir: Path) -> None:
    """Spoken answers through a talker pool of 5 blocks with no margin: a newcomer's prompt
    fills it, so it is preempted again and again and recomputed from its last frame."""
    payload = {**conversation("text"), **GREEDY, "max_tokens": 12, "talker_max_tokens": 30}
    params = {"kv_cache_tokens": 80, "admit_margin_tokens": 0}
    want = _alone(payload)
    p = InProcess(tiny_config(talker_ar=params))
    p.submit("a", payload)
    _step_until(p, "a", "code2wav", 1)
    p.submit("b", payload)
    p.run()
    talker: Any = p.stages["talker_ar"].executor
    assert p.stages["talker_ar"].failures == []
    assert talker.preemptions >= 5
    for rid in ("a", "b"):
        got = np.concatenate([o["codes"] for o in p.outputs[rid]["code2wav"]])
        np.testing.assert_array_equal(got, np.concatenate([o["codes"] for o in want["code2wav"]]))
    assert talker.cache.blocks_in_use() == 0


def test_an_answer_that_outgrows_the_whole_pool_fails_saying_so(tiny_dir: Path) -> None:
    """Alone in a talker pool of 3 blocks and still out of them: preempting it would only start
    it over (for ever), so it fails, and says why."""
    payload = {**conversation("text"), **GREEDY, "max_tokens": 12, "talker_max_tokens": 30}
    params = {"kv_cache_tokens": 48, "admit_margin_tokens": 0}
    p = InProcess(tiny_config(talker_ar=params), expect_failures=True)
    p.submit("a", payload)
    p.run()
    assert list(p.failed) == ["a"] and "outgrew the whole KV pool (3 blocks" in p.failed["a"]
    talker: Any = p.stages["talker_ar"].executor
    assert talker.preemptions == 0 and talker.cache.blocks_in_use() == 0


def test_a_request_that_waits_too_long_is_refused_alone_and_an_abort_leaves_nothing(
    tiny_dir: Path,
) -> None:
    long = _text(120)
    p = InProcess(tiny_config(thinker={**TIGHT, "admit_timeout_s": 0.1}), expect_failures=True)
    p.submit("a", long)
    _step_until(p, "a", "decode", 100)  # a holds 9 of 12 blocks, 10 for its last 12 tokens
    p.submit("b", _text(120))  # needs 4 blocks with its margin: it waits
    p.submit("c", _text(120))  # and so does c, for longer than 0.1 s (10 steps)
    for _ in range(3):
        p.step()
    p.abort("b")  # aborted while it waits: nothing of it stays behind
    p.run()
    assert list(p.failed) == ["c"]
    assert "waited" in p.failed["c"] and "admit_timeout_s" in p.failed["c"]
    assert _ids(p.outputs["a"]) == _ids(_alone(long))
    ex: Any = p.stages["thinker"].executor
    assert set(ex.reqs) == set() and ex.cache.blocks_in_use() == 0


def test_an_error_in_one_prefill_fails_that_request_only(tiny_dir: Path) -> None:
    payload = _text(20)
    p = InProcess(tiny_config(), expect_failures=True)
    ex: Any = p.stages["thinker"].executor
    chunk = ex._prefill_chunk

    def failing(rid: str, r: Any, n: int) -> Any:
        if rid == "b":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return chunk(rid, r, n)

    ex._prefill_chunk = failing
    p.submit("a", payload)
    p.submit("b", payload)
    p.submit("c", payload)
    p.run()
    assert list(p.failed) == ["b"]
    assert "prefill failed: RuntimeError: CUDA out of memory" in p.failed["b"]
    want = _ids(_alone(payload))
    assert _ids(p.outputs["a"]) == want and _ids(p.outputs["c"]) == want
    assert ex.cache.blocks_in_use() == 0 and ex.cache.in_use() == 0


def test_a_prompt_that_can_never_fit_is_refused_at_once_and_evicts_nothing(tiny_dir: Path) -> None:
    params = {"kv_cache_tokens": 160, "admit_margin_tokens": 0}
    p = InProcess(tiny_config(thinker=params), expect_failures=True)
    turn(p, "t1", [SYSTEM, user("Point 1.")], session_id="s")
    ex: Any = p.stages["thinker"].executor
    assert "s" in ex.sessions
    long = [SYSTEM, user("Tell me everything about the weather in every town you know. " * 12)]
    p.submit("big", {"messages": long, **GREEDY})
    p.run()
    assert list(p.failed) == ["big"]
    assert "more than the whole pool (10 blocks of 16 tokens)" in p.failed["big"]
    assert "s" in ex.sessions and ex.sessions.evictions == 0


def test_a_session_evicted_for_blocks_gets_a_full_prefill_with_the_same_answer(
    tiny_dir: Path,
) -> None:
    # 8 blocks: the kept turn's 3 and its tensors' charge (the tiny model's embeddings are
    # wider than its KV: 4 blocks' worth) leave too few for another turn without evicting it
    p = InProcess(tiny_config(thinker={"kv_cache_tokens": 128, "admit_margin_tokens": 0}))
    fresh = InProcess(tiny_config())
    history = [SYSTEM, user("Point 1.")]
    first = turn(p, "t1", history, session_id="s")
    thinker = p.stages["thinker"].executor
    assert "s" in thinker.sessions  # type: ignore[attr-defined]
    turn(p, "other", [SYSTEM, user("Something else entirely, please.")])
    assert "s" not in thinker.sessions and thinker.sessions.evictions == 1  # type: ignore[attr-defined]
    history += [{"role": "assistant", "content": first["text"]}, user("Point 2.")]
    got = turn(p, "t2", history, session_id="s")
    ref = turn(fresh, "t2", history)
    assert got["cached"] == 0 and got["ids"] == ref["ids"]
    np.testing.assert_array_equal(got["codes"], ref["codes"])


def test_a_talker_request_waits_for_blocks_with_no_deadline(tiny_dir: Path) -> None:
    """A talker request comes with its answer's first token: its text already runs. Waiting
    for the running answers' blocks for as long as they take (here an hour on the talker's
    clock, as a busy machine's 20 s once did) must not fail it."""
    payload = {**conversation("text"), **GREEDY, "max_tokens": 12, "talker_max_tokens": 30}
    params = {"kv_cache_tokens": 80, "admit_margin_tokens": 32}
    p = InProcess(tiny_config(talker_ar=params), expect_failures=True)
    talker: Any = p.stages["talker_ar"].executor
    p.submit("a", payload)
    _step_until(p, "a", "code2wav", 1)
    p.submit("b", payload)  # its prompt and margin do not fit beside a's: it waits
    _step_until(p, "b", "decode", 1)
    now = talker.clock
    talker.clock = lambda: now() + 3600
    p.run()
    assert p.failed == {} and p.stages["talker_ar"].failures == []
    assert len(p.outputs["b"]["code2wav"]) == len(p.outputs["a"]["code2wav"]) > 0
    assert talker.cache.blocks_in_use() == 0
