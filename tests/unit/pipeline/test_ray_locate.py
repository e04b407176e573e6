"""RayPlacement.locate asks an actor again while Ray restarts it, and gives up at its deadline
or once closed. A fake `ray` stands in (the real cluster runs in tests/integration/test_ray.py,
where the race this covers cannot be forced)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from realtime_omni.pipeline import ray_placement
from realtime_omni.pipeline.ray_placement import RayPlacement


class ActorError(Exception):
    pass


def placement(failures: int, timeout_s: float) -> tuple[RayPlacement, list[int]]:
    asked = [0]

    def get(ref: Any) -> Any:
        asked[0] += 1
        if asked[0] <= failures:
            raise ActorError("the actor is restarting")
        return ref

    p = object.__new__(RayPlacement)
    p.ray = SimpleNamespace(get=get, exceptions=SimpleNamespace(RayActorError=ActorError))
    node = SimpleNamespace(remote=lambda: ("node-b", "10.0.0.2"))
    p.actors = {"talker_ar#0": SimpleNamespace(node=node)}
    p.ready_timeout_s, p.closed = timeout_s, False
    return p, asked


def test_locate_asks_again_while_the_actor_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_placement, "LOCATE_RETRY_S", 0.001)
    p, asked = placement(failures=3, timeout_s=5)
    assert p.locate("talker_ar#0") == ("node-b", "10.0.0.2")
    assert asked[0] == 4


def test_locate_gives_up_at_its_deadline_or_once_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_placement, "LOCATE_RETRY_S", 0.001)
    p, asked = placement(failures=10**9, timeout_s=0.05)
    with pytest.raises(ActorError):
        p.locate("talker_ar#0")
    assert asked[0] > 1
    p, asked = placement(failures=10**9, timeout_s=5)
    p.closed = True
    with pytest.raises(ActorError):
        p.locate("talker_ar#0")
    assert asked[0] == 1
