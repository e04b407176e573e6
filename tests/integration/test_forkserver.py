"""Stage processes forked from the fork server (runtime.fork_server, the default): started and
restarted as its forks, with the exit codes and signals `subprocess.Popen` would give; off, each
is a child of the coordinator's own."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil

from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from realtime_omni.pipeline.forkserver import ForkServer
from realtime_omni.pipeline.worker import ARGS_ENV
from tests.conftest import run, simulated_config, timeout

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
