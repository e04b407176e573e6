"""Stage processes forked from the fork server (runtime.fork_server, the default): started and
restarted as its forks, with the exit codes and signals `subprocess.Popen` would give; off, each
is a child of the coordinator's own."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from realtime_omni.pipeline.forkserver import ForkServer
from realtime_omni.pipeline.worker import ARGS_ENV
from tests.conftest import run, simulated_config, timeout, until

FAST = 0.2


def parent_of(pid: int | None) -> int:
    assert pid is not None
    return psutil.Process(pid).ppid()


def test_stage_processes_are_forks_of_the_fork_server_and_come_back_as_forks() -> None:
    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            assert coord.supervisor.forks is not None
            server = coord.supervisor.forks.proc.pid
            processes = coord.graph.local_processes()
            assert {parent_of(coord.pid_of(p)) for p in processes} == {server}
            victim = "talker_ar#0"
            old = coord.supervisor.procs[victim]
            dead = old.pid
            os.kill(dead, signal.SIGKILL)
            while victim not in coord.down and coord.pid_of(victim) == dead:
                await asyncio.sleep(0.005)  # seen within the monitor's 50 ms
            stream = await coord.submit({"max_tokens": 3})  # waits for the restart
            assert await stream.collect()  # served by the restarted process
            again = coord.pid_of(victim)
            assert again not in (None, dead)
            assert parent_of(again) == server
            assert old.returncode == -signal.SIGKILL  # as the fork server reaped it
        assert not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"

    run(body())


def test_without_the_fork_server_each_stage_process_is_a_child_of_ours() -> None:
    async def body() -> None:
        cfg = parse_config(simulated_config(FAST, fork_server=False))
        async with Coordinator(cfg) as coord:
            assert coord.supervisor.forks is None
            pids = [coord.pid_of(p) for p in coord.graph.local_processes()]
            assert {parent_of(pid) for pid in pids} == {os.getpid()}

    run(body())


def test_a_forked_process_reports_its_exit_as_popen_would() -> None:
    server = ForkServer(["realtime_omni.pipeline.worker"])
    try:
        server.wait_ready(timeout(60))
        bad = server.spawn({ARGS_ENV: "not json"})  # the worker cannot read its arguments
        assert bad.wait(timeout(10)) == 1
        assert bad.poll() == 1
    finally:
        server.close()
    assert server.proc.returncode is not None


def test_a_fork_server_that_cannot_import_a_module_still_forks() -> None:
    server = ForkServer(["no_such_module_anywhere"])
    try:
        server.wait_ready(timeout(30))
        assert server.spawn({ARGS_ENV: "not json"}).wait(timeout(10)) == 1
    finally:
        server.close()


async def first_output_s(coord: Coordinator) -> float:
    """Seconds from a new request's submit to its first output; the rest is read to its end."""
    t0 = time.monotonic()
    stream = await coord.submit({"max_tokens": 3})
    first = None
    async for _ in stream:
        if first is None:
            first = time.monotonic() - t0
    assert first is not None
    return first


def test_the_fork_server_killed_its_stages_serve_on_and_a_new_one_forks_the_next() -> None:
    """The fork server SIGKILLed (as the OOM killer might): its stage processes are not taken
    for dead (they watch the coordinator, not it) and serve the next call; a new server is
    started, and a stage killed after it comes back as its fork, the next call's first output
    within 3 s of the kill. Before, the stages exited with their parent, their restarts went to
    the dead server (BrokenPipeError) and every later call waited for ever."""

    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            first = coord.supervisor.forks
            assert first is not None
            pids = {p: coord.pid_of(p) for p in coord.graph.local_processes()}
            os.kill(first.proc.pid, signal.SIGKILL)
            forks = coord.supervisor
            await until(
                lambda: forks.forks is not None and forks.forks is not first,
                "a new fork server",
            )
            assert forks.forks is not None
            server = forks.forks.proc.pid
            assert await first_output_s(coord) < timeout(3)
            assert not coord.down and coord.ready
            assert {p: coord.pid_of(p) for p in pids} == pids  # none restarted
            victim = "talker_ar#0"
            t0 = time.monotonic()
            os.kill(pids[victim] or 0, signal.SIGKILL)
            await until(lambda: victim in coord.down, "the death seen")
            await first_output_s(coord)
            assert time.monotonic() - t0 < timeout(3)  # 0.3 s on the 2-core machine
            again = coord.pid_of(victim)
            assert again not in (None, pids[victim])
            assert parent_of(again) == server

    run(body())


def test_a_stage_killed_with_the_fork_server_comes_back_within_3_s() -> None:
    """The fork server and a stage killed together (memory pressure takes both): the stage's
    restart waits for the new server (a fresh interpreter beside it, importing the same on the
    same cores, took longer: 3.1 s) and the next call is served."""

    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            first = coord.supervisor.forks
            assert first is not None
            victim = "talker_ar#0"
            dead = coord.pid_of(victim)
            t0 = time.monotonic()
            os.kill(first.proc.pid, signal.SIGKILL)
            os.kill(dead or 0, signal.SIGKILL)
            await until(lambda: victim in coord.down, "the death seen")
            await first_output_s(coord)
            # 2.2-2.5 s on the 2-core machine with a test suite beside it (a new server's
            # imports, then the fork's load): two processes lost, so above the one-process
            # budget of 3 s, which the test above holds.
            assert time.monotonic() - t0 < timeout(5)
            assert coord.pid_of(victim) != dead
            forks = coord.supervisor.forks
            assert forks is not None and forks is not first
            assert parent_of(coord.pid_of(victim)) == forks.proc.pid
            assert not coord.down

    run(body())


@pytest.mark.parametrize("fork_server", [True, False])
def test_stage_processes_start_without_the_servers_credentials(
    fork_server: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway's API keys and a provider's token stay in the server: neither a stage's
    environment nor the fork server's (its forks' initial one) holds them; the Curve key's
    variable, which TCP edges need, and the rest (PATH) are kept."""
    secrets = {"REALTIME_OMNI_API_KEYS": "sk-one", "TWILIO_AUTH_TOKEN": "tw", "SIP_PASSWORD": "x"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REALTIME_OMNI_CURVE_SECRET", "kept")

    async def body() -> None:
        cfg = parse_config(simulated_config(FAST, fork_server=fork_server))
        assert cfg.runtime.curve_secret_env == "REALTIME_OMNI_CURVE_SECRET"
        async with Coordinator(cfg) as coord:
            pids = [coord.pid_of(p) for p in coord.graph.local_processes()]
            if coord.supervisor.forks is not None:
                pids.append(coord.supervisor.forks.proc.pid)
            for pid in pids:
                env = psutil.Process(pid).environ()
                assert not set(secrets) & set(env), (pid, sorted(set(secrets) & set(env)))
                assert env["REALTIME_OMNI_CURVE_SECRET"] == "kept" and env["PATH"]

    run(body())
