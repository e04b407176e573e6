"""Placement: stages sharing a process, replicas, and a stage on another host over TCP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import yaml

from realtime_omni.errors import StageDied
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from tests.conftest import ROOT, free_port_block, run, simulated_config, timeout, until
from tests.integration.test_pipeline import all_slots_free, check_complete

FAST = 0.2


def test_stages_sharing_a_process_hand_over_by_reference() -> None:
    cfg = simulated_config(FAST)
    for name in ("thinker", "decode", "talker_ar", "code2wav"):
        cfg["stages"][name]["process"] = "gpu0"

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            assert coord.graph.edge("thinker", "talker_ar").transport == "reference"
            assert len(coord.graph.processes()) == 4
            streams = [await coord.submit({"max_tokens": 12}) for _ in range(4)]
            for s in streams:
                check_complete(await s.collect(), 12)
            stream = await coord.submit({"max_tokens": 200})
            async for out in stream:
                if out.stage == "code2wav":
                    break
            await coord.abort(stream.request_id)
            await all_slots_free(coord)

    run(body())


def test_replicas_share_the_load_and_a_request_stays_on_one() -> None:
    cfg = simulated_config(FAST)
    cfg["stages"]["talker_ar"]["replicas"] = 2

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            assert "talker_ar#1" in coord.graph.processes()
            streams = [await coord.submit({"max_tokens": 10}) for _ in range(6)]
            routes = [coord.requests[s.request_id].route["talker_ar"] for s in streams]
            assert sorted(set(routes)) == [0, 1]
            for s in streams:
                check_complete(await s.collect(), 10)
            await all_slots_free(coord)

    run(body())


def two_hosts(tmp_path, **runtime) -> tuple[dict, list[str]]:  # type: ignore[no-untyped-def]
    """The simulated graph with the talker on host box-b (127.0.0.1 here), and the command that
    starts it there."""
    cfg = simulated_config(FAST, base_port=free_port_block(10), **runtime)
    cfg["hosts"] = {"box-b": {"address": "127.0.0.1"}}
    cfg["stages"]["talker_ar"]["host"] = "box-b"
    path = tmp_path / "two-hosts.yaml"
    path.write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "realtime_omni.cli", "stage", "--config", str(path),
               "--process", "talker_ar#0"]  # fmt: skip
    return cfg, command


@pytest.fixture
def curve_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """The deployment's CurveZMQ key in the environment (the stage processes inherit it)."""
    from realtime_omni.pipeline.sockets import keygen

    key = keygen()
    monkeypatch.setenv("REALTIME_OMNI_CURVE_SECRET", key)
    return key


def test_a_stage_on_another_host_runs_over_tcp(tmp_path, curve_key) -> None:
    cfg = simulated_config(FAST, base_port=free_port_block(10), heartbeat_timeout_s=1.0)
    cfg["hosts"] = {"box-b": {"address": "127.0.0.1"}}
    cfg["stages"]["talker_ar"]["host"] = "box-b"
    path = tmp_path / "two-hosts.yaml"
    path.write_text(yaml.safe_dump(cfg))
    command = [
        sys.executable,
        "-m",
        "realtime_omni.cli",
        "stage",
        "--config",
        str(path),
        "--process",
        "talker_ar#0",
    ]

    async def body() -> None:
        remote = subprocess.Popen(command, cwd=ROOT)
        try:
            async with Coordinator(parse_config(cfg)) as coord:
                assert coord.graph.edge("thinker", "talker_ar").transport == "tcp"
                assert coord.graph.endpoint("talker_ar#0", 0, tmp_path).startswith("tcp://")
                check_complete(await (await coord.submit({"max_tokens": 10})).collect(), 10)

                stream = await coord.submit({"max_tokens": 300})
                async for out in stream:
                    if out.stage == "code2wav":
                        break
                os.kill(remote.pid, signal.SIGKILL)  # the other host goes away
                remote.wait()
                with pytest.raises(StageDied, match="talker_ar"):
                    await stream.collect()

                remote = subprocess.Popen(command, cwd=ROOT)  # and comes back
                again = await asyncio.wait_for(coord.submit({"max_tokens": 10}), timeout(30))
                check_complete(await again.collect(), 10)
                await all_slots_free(coord)
        finally:
            remote.kill()
            remote.wait()

    run(body(), limit_s=90)


def test_a_remote_stage_in_a_step_longer_than_the_heartbeat_timeout_stays_alive(
    tmp_path, curve_key
) -> None:
    """The remote talker's first step takes 2.5 s, the heartbeat timeout is 1 s: it beats from
    its control thread during the step, so it is not declared dead (before, it was, and every
    request through it failed with StageDied)."""
    cfg, command = two_hosts(tmp_path, heartbeat_timeout_s=1.0)
    cfg["stages"]["talker_ar"]["params"]["first_step_ms"] = 2500
    (tmp_path / "two-hosts.yaml").write_text(yaml.safe_dump(cfg))

    async def body() -> None:
        remote = subprocess.Popen(command, cwd=ROOT)
        try:
            async with Coordinator(parse_config(cfg)) as coord:
                check_complete(await (await coord.submit({"max_tokens": 4})).collect(), 4)
                assert not coord.down
                await all_slots_free(coord)
        finally:
            remote.kill()
            remote.wait()

    run(body(), limit_s=60)


def test_over_tcp_only_holders_of_the_curve_key_reach_a_stage(
    tmp_path, curve_key, monkeypatch
) -> None:
    """A stranger who reaches a stage's TCP port without the key sends Shutdown (and garbage):
    nothing is delivered, the pipeline serves on. Without a key, a TCP config does not start."""
    import zmq

    from realtime_omni.errors import ConfigError
    from realtime_omni.pipeline import messages as m

    cfg, command = two_hosts(tmp_path)

    async def body() -> None:
        remote = subprocess.Popen(command, cwd=ROOT)
        try:
            async with Coordinator(parse_config(cfg)) as coord:
                ctx = zmq.Context()
                for proc in ("talker_ar#0", "thinker#0"):
                    for keys in (None, zmq.curve_keypair()):  # no Curve; a key of its own
                        sock = ctx.socket(zmq.PUSH)
                        sock.setsockopt(zmq.LINGER, 0)
                        if keys is not None:
                            sock.setsockopt(
                                zmq.CURVE_SERVERKEY, zmq.curve_public(curve_key.encode())
                            )
                            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
                            sock.setsockopt(zmq.CURVE_SECRETKEY, b"x" * 40)
                        sock.connect(coord.graph.endpoint(proc, 0, tmp_path))
                        sock.send(m.encode(m.Shutdown()), zmq.NOBLOCK)
                        sock.close()
                ctx.term()
                await asyncio.sleep(timeout(1.0))
                assert remote.poll() is None and not coord.down
                check_complete(await (await coord.submit({"max_tokens": 5})).collect(), 5)
        finally:
            remote.kill()
            remote.wait()

    run(body(), limit_s=60)
    monkeypatch.delenv("REALTIME_OMNI_CURVE_SECRET")
    with pytest.raises(ConfigError, match="REALTIME_OMNI_CURVE_SECRET is not set"):
        run(Coordinator(parse_config(cfg)).start())


def test_a_sessions_turns_stay_on_the_replica_that_keeps_its_cache() -> None:
    cfg = simulated_config(FAST)
    cfg["stages"]["talker_ar"]["replicas"] = 2

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:

            async def turn(session: str) -> int:
                stream = await coord.submit({"max_tokens": 4, "session_id": session})
                replica = coord.requests[stream.request_id].route["talker_ar"]
                check_complete(await stream.collect(), 4)
                return replica

            a, b = await asyncio.gather(turn("sess_a"), turn("sess_b"))
            assert a != b  # two sessions at once share the load
            # later turns, with the other session busy meanwhile, go back where each started
            assert [await turn("sess_a") for _ in range(3)] == [a] * 3
            # another caller busy on `a`: the least busy replica is the other, yet `a` keeps it.
            # (A new session goes to the least busy replica, a tie to either: the caller is the
            # one of two sessions started together that went to `a`.)
            x1, x2 = await asyncio.gather(turn("sess_x1"), turn("sess_x2"))
            assert x1 != x2
            busy = await coord.submit(
                {"max_tokens": 40, "session_id": "sess_x1" if x1 == a else "sess_x2"}
            )
            assert coord.requests[busy.request_id].route["talker_ar"] == a
            assert await turn("sess_a") == a
            await busy.collect()
            # its replica restarted: the cache is gone, so the least busy replica takes it
            pid = coord.pid_of(f"talker_ar#{a}")
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await until(lambda: coord.pid_of(f"talker_ar#{a}") != pid, "the restart begun")
            await until(lambda: not coord.degraded, "the replica back", within_s=30)
            hogs: list = []  # busy work until some of it is on replica `a`, none more elsewhere
            while not any(coord.requests[h.request_id].route["talker_ar"] == a for h in hogs):
                hogs.append(await coord.submit({"max_tokens": 40, "session_id": f"h{len(hogs)}"}))
            assert await turn("sess_a") == 1 - a  # not back to `a`: its new incarnation is empty
            for h in hogs:
                await h.collect()
            await all_slots_free(coord)

    run(body())


def test_a_lost_replica_leaves_the_pipeline_ready_and_degraded() -> None:
    """One of two talker replicas lost and not back (restart_stages off stands in for a node
    Ray has not restarted yet): new calls are served by the other, so the pipeline stays ready
    (`/readyz` 200: a load balancer keeps the gateway) and says which process is down. Both
    lost: not ready. Before, `ready` stayed false from the first loss on."""
    cfg = simulated_config(FAST, restart_stages=False)
    cfg["stages"]["talker_ar"]["replicas"] = 2

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            assert coord.ready and coord.degraded == {}
            os.kill(coord.pid_of("talker_ar#1") or 0, signal.SIGKILL)
            await until(lambda: "talker_ar#1" in coord.down, "the death seen")
            assert coord.ready
            assert coord.degraded == {"talker_ar#1": "down, not restarted"}
            stream = await coord.submit({"max_tokens": 4})
            assert coord.requests[stream.request_id].route["talker_ar"] == 0
            check_complete(await stream.collect(), 4)
            os.kill(coord.pid_of("talker_ar#0") or 0, signal.SIGKILL)
            await until(lambda: "talker_ar#0" in coord.down, "the second death seen")
            assert not coord.ready
            assert list(coord.degraded) == ["talker_ar#0", "talker_ar#1"]

    run(body())
