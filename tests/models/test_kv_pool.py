"""A full KV pool: kept sessions go first, then the new request is refused by name, and the
requests already running go on as if alone.

The thinker's pool is made small (`kv_cache_tokens: 64`, four blocks of 16) so that one tiny
request (a 33-token prompt and its answer: three blocks) nearly fills it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import SYSTEM, conversation
from tests.models.test_sessions import GREEDY, turn, user

SMALL = {"kv_cache_tokens": 64}


def test_a_full_pool_refuses_the_new_request_by_name_and_the_running_one_goes_on(
    tiny_dir: Path,
) -> None:
    payload = {**conversation("text"), **GREEDY}
    alone = InProcess(tiny_config())
    alone.submit("a", payload)
    alone.run()
    p = InProcess(tiny_config(thinker=SMALL))
    p.submit("a", payload)
    while not p.outputs["a"]["decode"]:
        p.step()
    p.submit("b", payload)
    with pytest.raises(AssertionError, match=r"thinker: KV cache full \(3 of 4 blocks"):
        p.run()
    thinker = p.stages["thinker"]
    assert [rid for rid, _ in thinker.failures] == ["b"]
    assert "kv_cache_tokens" in thinker.failures[0][1]  # the error says what to change
    thinker.failures.clear()
    p.abort("b")
    p.run()
    for stage in ("decode", "code2wav"):
        got, want = p.outputs["a"][stage], alone.outputs["a"][stage]
        assert len(got) == len(want) > 0
    assert [o["token_id"] for o in p.outputs["a"]["decode"]] == [
        o["token_id"] for o in alone.outputs["a"]["decode"]
    ]
    cache = thinker.executor.cache  # type: ignore[attr-defined]
    assert cache.blocks_in_use() == 0 and cache.in_use() == 0


def test_a_session_evicted_for_blocks_gets_a_full_prefill_with_the_same_answer(
    tiny_dir: Path,
) -> None:
    p = InProcess(tiny_config(thinker=SMALL))
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
