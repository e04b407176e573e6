"""The resume extension's rules (`transports/resume.py`): tokens bound to their owner, good once,
good after a drop only for the window (a fake clock); the replay of sent events and audio."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

from realtime_omni.gateway.session.driver import Session
from realtime_omni.gateway.transports.resume import (
    REPLAY_SHARE,
    TAIL_S,
    Replay,
    ResumeRefused,
    Resumes,
    ResumeTokens,
)
from tests.conftest import until
from tests.unit.gateway.fakes import FakeCoord


def refused(tokens: ResumeTokens, token: str, owner: str, now: float) -> str:
    with pytest.raises(ResumeRefused) as e:
        tokens.take(token, owner, now)
    return e.value.code


def test_a_token_resumes_its_session_once() -> None:
    tokens = ResumeTokens(window_s=30)
    token = tokens.issue("sess_a", "key:1")
    tokens.dropped("sess_a", now=100.0)
    assert tokens.take(token, "key:1", now=110.0) == "sess_a"
    assert refused(tokens, token, "key:1", 111.0) == "resume_token_invalid"  # used
    assert len(tokens) == 0


def test_a_token_is_its_owners_and_a_refusal_keeps_it() -> None:
    tokens = ResumeTokens(window_s=30)
    token = tokens.issue("sess_a", "secret:abc")
    tokens.dropped("sess_a", now=0.0)
    assert refused(tokens, token, "secret:other", 1.0) == "resume_token_not_yours"
    assert refused(tokens, token, "key:1", 1.0) == "resume_token_not_yours"
    assert tokens.take(token, "secret:abc", 2.0) == "sess_a"  # the owner's still works


def test_after_a_drop_a_token_is_good_for_the_window_only() -> None:
    tokens = ResumeTokens(window_s=30)
    token = tokens.issue("sess_a", "open")
    tokens.dropped("sess_a", now=1000.0)
    assert refused(tokens, token, "open", 1030.5) == "resume_token_expired"
    assert refused(tokens, token, "open", 1031.0) == "resume_token_invalid"  # forgotten
    late = tokens.issue("sess_b", "open")
    tokens.dropped("sess_b", now=1000.0)
    assert tokens.take(late, "open", 1030.0) == "sess_b"  # the window's last instant


def test_an_attached_sessions_token_does_not_expire_and_a_new_one_voids_the_old() -> None:
    tokens = ResumeTokens(window_s=30)
    old = tokens.issue("sess_a", "open")
    assert tokens.take(old, "open", now=1e6) == "sess_a"  # no drop seen: a take-over
    first = tokens.issue("sess_a", "open")
    second = tokens.issue("sess_a", "open")
    assert refused(tokens, first, "open", 0.0) == "resume_token_invalid"
    tokens.forget("sess_a")  # the session ended
    assert refused(tokens, second, "open", 0.0) == "resume_token_invalid"
    assert refused(tokens, "rt_made_up", "open", 0.0) == "resume_token_invalid"


def test_replay_gives_the_events_after_the_last_one_seen() -> None:
    r = Replay(max_events=3)
    for i in range(5):
        r.sent(f"ev{i}", json.dumps({"event_id": f"ev{i}", "type": "x"}))
    assert [json.loads(t)["event_id"] for t in r.after("ev2") or []] == ["ev3", "ev4"]
    assert r.after("ev4") == []
    assert r.after("ev1") is None  # no longer kept: the client is told, not misled


def test_replay_holds_at_most_its_byte_budget() -> None:
    r = Replay(max_events=512, max_bytes=10_000)
    for i in range(512):  # 512 errors echoing a long id held 512 x the message, by reference
        r.sent(f"ev{i}", "x" * 3000)
    assert r.held_bytes <= 10_000 and len(r.events) == 3
    assert r.after("ev510") == ["x" * 3000] and r.after("ev508") is None
    r.sent("big", "y" * 10_001)  # larger than the budget: kept nowhere, nor what came before
    assert r.held_bytes == 0 and r.after("ev511") is None
    r.sent("next", "z")
    assert r.after("next") == [] and r.held_bytes == 1


def test_a_resumable_session_pays_for_its_replay_out_of_max_session_bytes() -> None:
    async def body() -> None:
        for max_bytes in (32 << 20, 1 << 20):
            s = Session(FakeCoord(chunks=1), max_session_bytes=max_bytes)
            link = Resumes(window_s=30).hold(s, "open")
            assert link is not None
            r, share = link.replay, max_bytes // REPLAY_SHARE
            assert r.max_bytes + r.tail_samples * 4 <= share and r.max_bytes >= share // 2
            assert s.conversation.max_bytes == max_bytes - share
        assert link.replay.tail_samples < int(TAIL_S * s.output_rate)  # a small session's

    asyncio.run(body())


def test_replay_keeps_the_tail_of_an_items_audio() -> None:
    r = Replay(tail_samples=10)
    r.audio("item_a", np.arange(0, 4, dtype=np.float32))
    r.audio("item_b", np.arange(10, 16, dtype=np.float32))
    r.audio("item_b", np.arange(16, 20, dtype=np.float32))
    assert list(r.unheard("item_b", 3)) == [17, 18, 19]
    assert list(r.unheard("item_b", 7)) == [13, 14, 15, 16, 17, 18, 19]
    assert list(r.unheard("item_b", 50)) == list(range(10, 20))  # what is kept, no more
    assert len(r.unheard("item_a", 2)) == 0  # past the bound: gone
    assert len(r.unheard("item_b", 0)) == 0


class _Session:
    def __init__(self, sid: str, owner: str) -> None:
        self.id, self.owner, self.output_rate, self.closed = sid, owner, 24000, False
        self.max_session_bytes = 32 << 20

    def reserve_bytes(self, n: int) -> int:
        return n

    async def close(self) -> None:
        self.closed = True


class _Host:
    def __init__(self) -> None:
        self.sessions: set[Any] = set()
        self.forgotten: list[Any] = []

    def forget(self, s: Any) -> None:
        self.sessions.discard(s)
        self.forgotten.append(s)


def test_parked_sessions_end_after_the_window_or_give_way_oldest_first() -> None:
    async def body() -> None:
        now = [0.0]
        host, resumes = _Host(), Resumes(window_s=0.05, clock=lambda: now[0])
        a, b, c = (_Session(f"sess_{x}", "secret:s") for x in "abc")
        host.sessions |= {a, b, c}
        links = [resumes.hold(s, s.owner) for s in (a, b, c)]  # type: ignore[arg-type]
        assert all(link is not None for link in links)
        la, lb, lc = (link for link in links if link is not None)
        resumes.park(host, lb)  # type: ignore[arg-type]
        now[0] = 1.0
        resumes.park(host, la)  # type: ignore[arg-type]
        assert resumes.give_way(host, owner="secret:other") is False
        assert resumes.give_way(host, owner="secret:s") is True  # b waited longest
        assert b not in host.sessions and c in host.sessions and a in host.sessions
        await until(lambda: set(host.forgotten) == {a, b}, "a's window ends, b gave way")
        assert a.closed and b.closed and not c.closed
        assert [k.session for k in resumes.parked] == []
        with pytest.raises(ResumeRefused):
            await resumes.take(la.token, "secret:s")
        token = lc.token

        async def connection() -> None:  # c's connection, told to leave, leaves
            await lc.leave.wait()
            lc.free.set()

        leaving = asyncio.create_task(connection())
        taken = await resumes.take(token, "secret:s")  # a take-over
        await leaving
        assert taken is lc and not lc.leave.is_set() and lc.token not in ("", token)
        await resumes.close()

    async def with_free_connection() -> None:
        await asyncio.wait_for(body(), 5)

    asyncio.run(with_free_connection())


def test_the_limits_count_a_parked_session_until_a_new_one_needs_its_place() -> None:
    from realtime_omni.gateway.app import Gateway
    from realtime_omni.gateway.auth import Grant
    from realtime_omni.gateway.config import GatewayConfig, RealtimeConfig
    from realtime_omni.pipeline.config import load_config
    from tests.conftest import ROOT

    async def body() -> None:
        config = GatewayConfig(max_sessions=2, vad=False, realtime=RealtimeConfig())
        gw = Gateway(load_config(ROOT / "configs" / "tiny.yaml"), config, object())
        secret = Grant("secret", {}, owner="secret:s")
        a, b = (_Session(f"sess_{x}", "secret:s") for x in "ab")
        gw.sessions |= {a, b}  # type: ignore[arg-type]
        la = gw.resumes.hold(a, a.owner)  # type: ignore[arg-type]
        gw.resumes.hold(b, b.owner)  # type: ignore[arg-type]
        refused = gw.refusal(secret)
        assert refused is not None and refused[1] == "client_secret_session_limit"
        refused = gw.refusal(Grant("key", owner="key:1"))
        assert refused is not None and refused[1] == "too_many_sessions"
        assert la is not None
        gw.resumes.park(gw, la)  # type: ignore[arg-type]
        assert gw.refusal(secret) is None  # a's session gave way
        assert a not in gw.sessions and b in gw.sessions
        await gw.resumes.close()
        assert a.closed and not b.closed

    asyncio.run(body())
