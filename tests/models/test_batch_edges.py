"""What a batch can break beyond tokens and frames: a request in the row and blocks an abort
freed, a request held for backpressure while the others step, a history item deleted or
edited under a kept cache. Each request must give what it gives alone (or what a full prefill
gives)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import SYSTEM, conversation
from tests.models.test_sessions import turn, user

GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 8, "talker_max_tokens": 16}


def outputs(p: InProcess, rid: str) -> tuple[list[int], np.ndarray]:
    out = p.outputs[rid]
    return [o["token_id"] for o in out["decode"]], np.concatenate(
        [o["codes"] for o in out["code2wav"]]
    )


def alone(payload: dict[str, Any]) -> tuple[list[int], np.ndarray]:
    p = InProcess(tiny_config())
    p.submit("x", payload)
    p.run()
    return outputs(p, "x")


def test_a_request_in_the_row_and_blocks_an_abort_freed_gives_what_it_gives_alone(
    tiny_dir: Path,
) -> None:
    c = {**conversation("image"), **GREEDY}
    p = InProcess(tiny_config())
    p.submit("a", {**conversation("audio"), **GREEDY, "max_tokens": 40})
    p.submit("b", {**conversation("text"), **GREEDY})
    while len(p.outputs["a"]["decode"]) < 5:
        p.step()
    thinker = p.stages["thinker"].executor
    row, blocks = thinker.reqs["a"].row, list(thinker.cache.table[thinker.reqs["a"].row])
    p.abort("a")
    p.submit("c", c)
    while "c" not in thinker.reqs or thinker.reqs["c"].row is None:
        p.step()
    assert thinker.reqs["c"].row == row  # the aborted request's row...
    assert set(thinker.cache.table[row]) & set(blocks)  # ...and its blocks
    p.run()
    ids, codes = outputs(p, "c")
    want_ids, want_codes = alone(c)
    assert ids == want_ids and len(ids) > 0
    np.testing.assert_array_equal(codes, want_codes)


def test_a_held_request_waits_while_the_others_step_and_then_gives_what_it_gives_alone(
    tiny_dir: Path,
) -> None:
    a, b = {**conversation("text"), **GREEDY}, {**conversation("audio"), **GREEDY}
    p = InProcess(tiny_config())
    p.submit("a", a)
    p.submit("b", b)
    talker = p.stages["talker_ar"]
    while "a" not in talker.executor.reqs or talker.executor.reqs["a"].spoken < 2:
        p.step()
    talker.set_held({"a"})
    spoken = talker.executor.reqs["a"].spoken
    b_before = talker.executor.reqs["b"].spoken
    for _ in range(10):
        p.step()
    assert talker.executor.reqs["a"].spoken == spoken  # held: not one frame
    assert talker.executor.reqs["b"].spoken > b_before  # the other went on
    talker.set_held(set())
    p.run()
    for rid, payload in (("a", a), ("b", b)):
        ids, codes = outputs(p, rid)
        want_ids, want_codes = alone(payload)
        assert ids == want_ids
        np.testing.assert_array_equal(codes, want_codes)


def test_a_deleted_or_edited_history_item_gives_what_a_full_prefill_gives(
    tiny_dir: Path,
) -> None:
    kept, fresh = InProcess(tiny_config()), InProcess(tiny_config())
    history = [SYSTEM, user("Point 1.")]
    first = turn(kept, "t1", history, session_id="s")
    history += [{"role": "assistant", "content": first["text"]}, user("Point 2.")]
    second = turn(kept, "t2", history, session_id="s")
    history += [{"role": "assistant", "content": second["text"]}, user("Point 3.")]
    deleted = [SYSTEM, *history[3:]]  # the first exchange deleted
    edited = [SYSTEM, user("Point one, edited."), *history[2:]]
    for i, h in enumerate((deleted, edited)):
        got = turn(kept, f"d{i}", h, session_id="s")
        ref = turn(fresh, f"d{i}", h)  # no session: a full prefill
        assert got["ids"] == ref["ids"] and got["ids"]
        np.testing.assert_array_equal(got["codes"], ref["codes"])
        assert got["cached"] < second["cached"] + second["prefilled"]  # less of it was reused
