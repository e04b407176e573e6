"""The seven-stage simulated Qwen3-Omni graph in seven real processes, over real ZMQ sockets and
real shared memory."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from realtime_omni.errors import (
    ConfigError,
    OmniError,
    RequestAborted,
    RequestError,
    StageDied,
    StartupError,
)
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from realtime_omni.pipeline.shm import OWNER, SHM_DIR, list_segments
from realtime_omni.pipeline.worker import MAX_DRAIN
from tests.conftest import ROOT, freeze, run, simulated_config, timeout, until
from tests.integration.executors import SpinExecutor

FAST = 0.2  # simulated step times at a fifth: the graph's shape matters here, not its speed


def check_complete(outputs: dict[str, list[dict]], tokens: int) -> None:
    """Every token reached decode once, in order; the audio covers every talker frame, in order."""
    assert [o["index"] for o in outputs["decode"]] == list(range(tokens))
    audio = outputs["code2wav"]
    assert [o["index"] for o in audio] == list(range(len(audio)))
    frames = sum(o["items"] for o in audio)
    assert frames == 2 * tokens  # per_input: 2 frames per text token
    assert all(o["pcm"].shape == (o["items"], 1920) for o in audio)
    times = [o["token_time"] for o in audio]
    assert times == sorted(times)


async def all_slots_free(coord: Coordinator) -> None:
    stats = await coord.stats()
    for proc, s in stats.items():
        assert s.free_slots == s.total_slots, proc
        assert not any(s.active_requests.values()), (proc, s.active_requests)
    assert coord.outlet.pool.free == coord.outlet.pool.n


def test_twenty_concurrent_requests_complete_in_order() -> None:
    async def body() -> None:
        start_segments = len(list_segments(os.getpid()))
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            assert len(coord.graph.local_processes()) == 7
            pids = {coord.pid_of(p) for p in coord.graph.processes()}
            assert len(pids) == 7 and all(psutil.pid_exists(p) for p in pids if p)
            # What start-up made is frozen, kept out of the collector's full passes.
            assert all(s.gc_frozen > 10_000 for s in (await coord.stats()).values())

            async def one(i: int) -> None:
                stream = await coord.submit({"max_tokens": 5 + i % 7}, request_id=f"r{i}")
                check_complete(await stream.collect(), 5 + i % 7)

            await asyncio.gather(*(one(i) for i in range(20)))
            await until(lambda: coord.in_flight == 0, "every stage done with every request")
            await all_slots_free(coord)
            await burst_then_request(coord)
            await unread_outputs_come_back_on_close(coord)
        assert len(list_segments(os.getpid())) == start_segments
        procs = coord.supervisor.procs.values()
        assert all(proc.poll() is not None for proc in procs)  # exited, reaped

    run(body())


async def burst_then_request(coord: Coordinator) -> None:
    """A burst of messages beyond what one wake-up drains all gets handled, and the inbox
    still wakes the coordinator afterwards."""
    n = 2 * MAX_DRAIN + 1
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(coord.graph.endpoint(m.CLIENT, 0, coord.ipc_dir))
    for i in range(n):
        sock.send(m.encode(m.Heartbeat(f"probe#{i}", 0)))
    sock.close(linger=int(timeout(10) * 1000))  # a closed socket still delivers what it queued
    beats = coord.supervisor.last_beat
    await until(lambda: sum(p.startswith("probe#") for p in beats) == n, "burst")
    await asyncio.sleep(0.2)  # idle: the next messages must wake the loop again
    stream = await coord.submit({"max_tokens": 3})
    check_complete(await stream.collect(), 3)


async def unread_outputs_come_back_on_close(coord: Coordinator) -> None:
    """A reader that stopped: the request ends in every stage, but its unread outputs hold
    their credits until the stream is closed."""
    stream = await coord.submit({"max_tokens": 2})
    await until(lambda: stream.closed and coord.in_flight == 0, "the request ended")
    stats = await coord.stats()
    assert (
        stats["decode#0"].free_slots["decode->client"]
        < stats["decode#0"].total_slots["decode->client"]
    )
    stream.close()
    stream.close()
    assert [o async for o in stream] == []
    await all_slots_free(coord)


def test_slow_consumer_makes_the_senders_wait_with_flat_memory() -> None:
    async def body() -> None:
        cfg = simulated_config(0.05)
        async with Coordinator(parse_config(cfg)) as coord:
            procs = [psutil.Process(coord.pid_of(p)) for p in coord.graph.processes()]
            stream = await coord.submit({"max_tokens": 400})
            await stream.__anext__()
            await asyncio.sleep(timeout(1.0))  # read nothing: everything upstream must stall
            rss_before = sum(p.memory_info().rss for p in procs)
            stats = await coord.stats()

            # The request holds its share of the client edge, code2wav holds its inputs
            # unacknowledged (its share of the talker's edge), and so on up.
            def held(proc: str, src: str, dst: str) -> int:
                e = coord.graph.edge(src, dst)
                assert stats[proc].free_slots[e.key] == e.slots - e.request_slots
                return e.request_slots

            to_client = held("code2wav#0", "code2wav", "client")
            held("talker_ar#0", "talker_ar", "code2wav")
            thinker = stats["thinker#0"]
            assert any(thinker.free_slots[k] < thinker.total_slots[k] for k in thinker.free_slots)
            text_to_client = coord.graph.edge("decode", "client").request_slots
            assert stream._queue.qsize() <= to_client + text_to_client
            # What waits is counted: code2wav's next chunk for want of credit, and the talker's
            # frames it holds unacknowledged (its inputs, not taken while it is held).
            assert stats["code2wav#0"].queued_out["code2wav->client"] >= 1
            assert stats["code2wav#0"].queued_in["talker_ar->code2wav"] >= 1
            await asyncio.sleep(timeout(1.0))
            stats2 = await coord.stats()
            assert stats2["thinker#0"].free_slots == stats["thinker#0"].free_slots
            rss_after = sum(p.memory_info().rss for p in procs)
            assert rss_after - rss_before < 8 << 20
            count = 1
            async for _ in stream:  # now drain it: the request completes
                count += 1
            assert count == 400 + 1 + (800 - 1 + 3) // 4
            await all_slots_free(coord)
            done = await coord.stats()
            assert not any(n for st in done.values() for n in st.queued_in.values())
            assert not any(n for st in done.values() for n in st.queued_out.values())

    run(body())


def test_a_request_nobody_reads_does_not_stall_the_others() -> None:
    cfg = simulated_config(FAST)
    cfg["edges"] = [
        {**e, "request_slots": 2} if e["dst"] in ("client", "code2wav") else e for e in cfg["edges"]
    ]

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            stalled = await coord.submit({"max_tokens": 300})
            await stalled.__anext__()
            await asyncio.sleep(timeout(0.5))  # it fills its share of the edges and is held
            stats = await coord.stats()
            assert stats["code2wav#0"].free_slots["code2wav->client"] == 32 - 2
            others = [await coord.submit({"max_tokens": 12}) for _ in range(3)]
            for s in others:
                check_complete(await asyncio.wait_for(s.collect(), timeout(20)), 12)
            stats = await coord.stats()  # the stalled request still holds only its share
            assert stats["code2wav#0"].free_slots["code2wav->client"] == 32 - 2
            assert stats["talker_ar#0"].free_slots["talker_ar->code2wav"] == 64 - 2
            await coord.abort(stalled.request_id)
            await all_slots_free(coord)

    run(body())


def test_abort_mid_stream_is_acknowledged_by_every_stage() -> None:
    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            others = [await coord.submit({"max_tokens": 30}) for _ in range(2)]
            stream = await coord.submit({"max_tokens": 200})
            async for out in stream:
                if out.stage == "code2wav":
                    break
            t0 = time.monotonic()
            await coord.abort(stream.request_id)
            took = time.monotonic() - t0
            with pytest.raises(RequestAborted):
                await stream.__anext__()
            for s in others:  # the other requests are untouched
                check_complete(await s.collect(), 30)
            await all_slots_free(coord)
            assert took < timeout(2.0)
            await coord.abort(stream.request_id)  # aborting twice is harmless

    run(body())


def test_aborting_a_request_that_ended_with_outputs_unread_gives_their_credits_back() -> None:
    """A consumer that reads part of an answer and then aborts it, when the answer had already
    ended in every stage: the abort has nothing to stop, but the outputs left unread hold
    credits of the edges to the caller (benchmarks/soak.py's caller, under load, left one
    behind this way)."""

    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            # Two tokens: their outputs fit in the shares of the edges to the caller, so the
            # request ends in every stage with none of them read.
            stream = await coord.submit({"max_tokens": 2})
            await until(lambda: coord.in_flight == 0, "the request ended in every stage")
            await stream.__anext__()
            await coord.abort(stream.request_id)
            await all_slots_free(coord)
            with pytest.raises(StopAsyncIteration):  # the caller reads no more of it
                await stream.__anext__()

    run(body())


def test_an_abort_is_acknowledged_while_a_long_step_runs() -> None:
    """The thinker's prefill takes 4 s; the abort must not wait for it to end."""
    cfg = simulated_config()
    cfg["stages"]["thinker"]["params"]["first_step_ms"] = 4000

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            stream = await coord.submit({"max_tokens": 5})
            await asyncio.sleep(0.5)  # preprocessing and encoders done: the prefill runs
            t0 = time.monotonic()
            await coord.abort(stream.request_id)
            took = time.monotonic() - t0
            assert took < 1.5, f"the abort waited {took:.2f} s, as if for the step to end"
            await all_slots_free(coord)

    run(body())


def test_a_submit_cancelled_while_waiting_for_entry_credit_leaves_nothing() -> None:
    """One entry credit: request a is in its long preprocessing step, b's input waits in the
    stage's inbox holding the credit, so c's submit waits for it, and is cancelled there."""
    cfg = simulated_config()
    cfg["stages"]["preprocessing"]["params"]["first_step_ms"] = 1500
    cfg["stages"]["preprocessing"]["max_batch"] = 1
    cfg["edges"].append({"src": "client", "dst": "preprocessing", "slots": 1})

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            a = await coord.submit({"max_tokens": 2}, request_id="a")
            await asyncio.sleep(0.2)  # a's input taken: its step runs
            b = await coord.submit({"max_tokens": 2}, request_id="b")
            c = asyncio.create_task(coord.submit({"max_tokens": 2}, request_id="c"))
            await asyncio.sleep(0.3)
            assert not c.done(), "c found a credit: the test shows nothing"
            c.cancel()
            with pytest.raises(asyncio.CancelledError):
                await c
            assert coord.in_flight == 2
            for stream in (a, b):
                await coord.abort(stream.request_id)
            assert coord.in_flight == 0
            await all_slots_free(coord)

    run(body())


def test_sigkill_of_a_stage_fails_its_requests_and_the_stage_comes_back() -> None:
    async def body() -> None:
        start_segments = len(list_segments(os.getpid()))
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            # Both requests are still using the talker when it dies.
            done = await coord.submit({"max_tokens": 60})
            await done.__anext__()
            victim = await coord.submit({"max_tokens": 60})
            async for out in victim:
                if out.stage == "code2wav":
                    break
            old_pid = coord.pid_of("talker_ar#0")
            t0 = time.monotonic()
            assert coord.ready
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(StageDied, match="talker_ar"):
                async for _ in victim:
                    pass
            assert time.monotonic() - t0 < timeout(1.0)
            assert not coord.ready  # /readyz says 503 while the stage restarts
            with pytest.raises(StageDied):  # `done` was still using the talker too
                await done.collect()
            after = await coord.submit({"max_tokens": 8})
            check_complete(await after.collect(), 8)
            assert coord.pid_of("talker_ar#0") != old_pid
            assert coord.ready
            await all_slots_free(coord)

            # A request that finished with the killed stage goes on while it restarts.
            survivor = await coord.submit({"max_tokens": 40})
            await survivor.__anext__()  # a decode output: preprocessing is done with it
            os.kill(coord.pid_of("preprocessing#0"), signal.SIGKILL)
            outs = await survivor.collect()
            assert len(outs["decode"]) == 39
            again = await coord.submit({"max_tokens": 8})
            check_complete(await again.collect(), 8)
            await all_slots_free(coord)
        assert len(list_segments(os.getpid())) == start_segments

    run(body(), limit_s=90)


def test_a_failing_request_does_not_hurt_the_others() -> None:
    cfg = simulated_config(FAST)
    cfg["stages"]["thinker"]["executor"] = "tests.integration.executors:FlakyExecutor"

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            good = await coord.submit({"max_tokens": 10})
            bad = await coord.submit({"max_tokens": 10, "fail_at": "thinker"})
            with pytest.raises(RequestError, match="asked to fail here"):
                await bad.collect()
            check_complete(await good.collect(), 10)
            await asyncio.sleep(timeout(0.2))  # the background abort of `bad`
            await all_slots_free(coord)

    run(body())


def test_an_abort_a_stage_never_acknowledges_in_time_is_named_and_forgotten() -> None:
    """The talker's process hangs (SIGSTOP) while it holds a request, for longer than
    `abort_timeout_s` but not the heartbeat timeout: the abort raises naming it, the request is
    forgotten, the talker's acknowledgement when it wakes is ignored, and the next request runs
    through every stage."""
    cfg = simulated_config(FAST, abort_timeout_s=0.3, heartbeat_timeout_s=30.0)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            stream = await coord.submit({"max_tokens": 200})
            async for out in stream:
                if out.stage == "code2wav":  # the talker holds the request
                    break
            talker = coord.pid_of("talker_ar#0")
            await freeze(talker)
            try:
                with pytest.raises(OmniError, match=r"not acknowledged within 0.3 s by: .*talker"):
                    await coord.abort(stream.request_id)
                assert stream.request_id not in coord.requests
            finally:
                os.kill(talker, signal.SIGCONT)
            check_complete(await (await coord.submit({"max_tokens": 4})).collect(), 4)
            await all_slots_free(coord)

    run(body())


def test_a_stage_is_stepped_when_its_executor_said_with_no_message_to_wake_it() -> None:
    """An executor's `wake_in` (a paced step falling due): the loop waits that long for it,
    not until the next message or heartbeat (here 5 s apart)."""
    cfg = simulated_config(FAST, heartbeat_interval_s=5.0, heartbeat_timeout_s=30.0)
    cfg["stages"]["preprocessing"]["executor"] = "tests.integration.executors:LaterExecutor"
    cfg["stages"]["preprocessing"]["params"]["after_s"] = 0.3

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            t = time.monotonic()
            check_complete(await (await coord.submit({"max_tokens": 4})).collect(), 4)
            assert time.monotonic() - t < 3.0  # 0.3 s and the rest, or 5 s without wake_in

    run(body())


def test_the_step_log_tells_a_stage_on_a_cpu_from_one_waiting() -> None:
    """`Stats.step_cpu`: every step of a stage that spins `SPIN_CPU_S` of CPU time a step is
    logged with at least that; the thinker, which sleeps through its steps, took little of its
    step time (a simulated stage with steps of a few milliseconds spends a fifth or more of
    them in Python: not those). Both hold however loaded the machine: CPU time spun is the
    same, and a sleeping stage's share only falls when its steps take longer."""
    cfg = simulated_config(FAST)
    cfg["stages"]["talker_ar"]["executor"] = "tests.integration.executors:SpinExecutor"

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            for _ in range(2):
                check_complete(await (await coord.submit({"max_tokens": 6})).collect(), 6)
            stats = await coord.stats()
        share, cpu = {}, {}
        for st in stats.values():
            for stage, log in st.steps.items():
                assert len(st.step_cpu[stage]) == len(log)
                wall = sum(d for _, d in log)
                share[stage] = sum(st.step_cpu[stage]) / wall if wall else 0.0
                cpu[stage] = st.step_cpu[stage]
        assert cpu["talker_ar"] and min(cpu["talker_ar"]) >= 0.9 * SpinExecutor.SPIN_CPU_S, cpu
        assert share["talker_ar"] <= 1.0 and share["thinker"] < 0.15, share

    run(body())


def test_a_stage_that_cannot_start_is_named() -> None:
    cfg = simulated_config(FAST)
    cfg["stages"]["code2wav"]["executor"] = "tests.integration.executors:BrokenExecutor"

    async def body() -> None:
        with pytest.raises(StartupError, match=r"code2wav.*no weights for code2wav"):
            await Coordinator(parse_config(cfg)).start()

    start_segments = len(list_segments(os.getpid()))
    run(body())
    assert len(list_segments(os.getpid())) == start_segments


def test_a_coordinator_keeps_its_ipc_dir_to_its_owner(tmp_path: Path) -> None:
    """`runtime.ipc_dir` holds the stages' ipc:// sockets: whoever can connect to them talks to
    the stages. Before, only the gateway made it 0700; a Coordinator built directly (as the
    benchmarks build it) made it with the umask, open to every user."""
    cfg = simulated_config(FAST)
    cfg["runtime"] = {**cfg.get("runtime", {}), "ipc_dir": str(tmp_path / "ipc")}
    open_dir = tmp_path / "shared"
    open_dir.mkdir(mode=0o755)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            assert stat.S_IMODE((tmp_path / "ipc").stat().st_mode) == 0o700
            assert any(p.is_socket() for p in (tmp_path / "ipc").iterdir())
            check_complete(await (await coord.submit({"max_tokens": 3})).collect(), 3)
        cfg["runtime"]["ipc_dir"] = str(open_dir)  # one open to others is refused, not used
        with pytest.raises(ConfigError, match="chmod 700"):
            await Coordinator(parse_config(cfg)).start()
        # and the refused start left nothing taken: this process's owner lock is free again
        assert not (SHM_DIR / f"{OWNER}{os.getpid()}").exists()

    old = os.umask(0o022)
    try:
        run(body())
    finally:
        os.umask(old)


def test_segments_left_by_a_killed_server_are_cleaned_at_the_next_start(tmp_path) -> None:
    script = tmp_path / "server.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            import numpy as np
            sys.path.insert(0, {str(ROOT)!r})
            from realtime_omni.pipeline.config import parse_config
            from realtime_omni.pipeline.coordinator import Coordinator
            from tests.conftest import simulated_config

            async def main():
                coord = Coordinator(parse_config(simulated_config(0.1)))
                await coord.start()
                audio = np.zeros(64000, np.float32)  # big enough for a shm slot
                stream = await coord.submit({{"max_tokens": 4, "audio": audio}})
                await stream.collect()
                print("ready", flush=True)
                await asyncio.sleep(3600)

            asyncio.run(main())
            """
        )
    )
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == b"ready"
        # the fork server and the stage processes forked from it
        children = psutil.Process(server.pid).children(recursive=True)
        assert len(list_segments(server.pid)) > 0
        # Any coordinator that starts on this machine (another test's, in the other worker)
        # sweeps a dead owner's segments: ours waits for the dead server's lock, so that its
        # segments, which the kill left, are seen left, and the sweep below is the one that
        # removes them.
        lock = os.open(SHM_DIR / f"{OWNER}{server.pid}", os.O_RDWR)
        holder = threading.Thread(target=fcntl.flock, args=(lock, fcntl.LOCK_EX))
        holder.start()  # blocks while the server holds it
        try:
            server.kill()
            server.wait()
            holder.join(timeout(5))
            psutil.wait_procs(children, timeout=timeout(5))  # they notice their parent is gone
            assert not any(c.is_running() and c.status() != "zombie" for c in children)
            assert list_segments(server.pid)  # the coordinator's own segment stays behind
        finally:
            os.close(lock)  # the dead server's segments are stale now

        async def body() -> None:
            async with Coordinator(parse_config(simulated_config(FAST))):
                assert list_segments(server.pid) == []

        run(body())
    finally:
        server.kill()


def test_stage_processes_take_the_configured_niceness() -> None:
    cfg = simulated_config(time_scale=0.1, stage_nice=7)
    base = os.nice(0)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            procs = list(coord.supervisor.procs.values())
            assert len(procs) == 7
            assert {psutil.Process(p.pid).nice() for p in procs} == {min(19, base + 7)}
            check_complete(await (await coord.submit({"max_tokens": 3})).collect(), 3)

    run(body())


def test_an_output_msgpack_refuses_fails_its_request_and_gives_its_credit_back() -> None:
    """Outputs with a numpy scalar in their metadata fail their request; the credit each held
    comes back, so after more such requests than the edge has credits the next one is served
    and an abort is acknowledged (before, eight of them stalled the edge for good)."""
    cfg = simulated_config(FAST)
    cfg["stages"]["thinker"]["executor"] = "tests.integration.executors:ScalarMetaExecutor"
    for stage in ("decode", "talker_ar"):
        cfg["stages"][stage]["max_batch"] = 2
    cfg["edges"] = [e for e in cfg["edges"] if e["src"] != "thinker"] + [
        {"src": "thinker", "dst": "decode", "slots": 2},
        {"src": "thinker", "dst": "talker_ar", "slots": 2},
    ]

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            for _ in range(5):
                stream = await coord.submit({"max_tokens": 3, "bad_meta": True})
                with pytest.raises(RequestError, match="float32"):
                    await asyncio.wait_for(stream.collect(), timeout(10))
            check_complete(await (await coord.submit({"max_tokens": 3})).collect(), 3)
            stream = await coord.submit({"max_tokens": 500})
            await asyncio.sleep(0.3)
            await asyncio.wait_for(coord.abort(stream.request_id), timeout(5))
            await all_slots_free(coord)

    run(body())


def test_forged_garbled_and_truncated_messages_neither_kill_nor_block_a_stage() -> None:
    """Random bytes, truncated messages, messages short of the frames they announce, and
    well-formed ones naming stages, edges and peers that do not exist, sent to a stage's inbox:
    the process logs and drops them, stays up, and the pipeline serves the next request."""
    import random

    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            assert coord.ipc_dir is not None
            proc = "thinker#0"
            epochs = dict(coord.epochs)  # a restarted process would have a new one
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(coord.graph.endpoint(proc, coord.epochs[proc], coord.ipc_dir))
            rng = random.Random(7)
            ref = m.ArrayRef("x", "float32", (4,), 1, 0, 16)
            pre = ("preprocessing", "thinker", "preprocessing#0", 0, {})
            valid = [
                m.DataReady("f1", "nope", "thinker", "nope#0", 0, {}, [], {}, "inline"),
                m.DataReady("f2", "preprocessing", "ghost", "preprocessing#0", 0, {}, [], {}, ""),
                m.DataReady("f3", *pre, [ref], {}, "inline"),  # announces a frame it lacks
                m.DataReady("f4", *pre, [ref], {}, "shm", segment="../../etc/passwd"),
                m.StreamEnd("f5", "ghost", "thinker", {}),
                m.DataAck("thinker", "ghost", 99),
                m.Abort("never-seen"),
            ]
            frames = [m.encode(v) for v in valid]
            frames += [rng.randbytes(rng.randrange(1, 200)) for _ in range(100)]
            frames += [f[: rng.randrange(1, len(f))] for f in frames[: len(valid)] * 5]
            for f in frames:
                sock.send(f)
            sock.close()
            ctx.term()
            await asyncio.sleep(timeout(1.0))
            assert all(p.poll() is None for p in coord.supervisor.procs.values())
            assert coord.epochs == epochs
            check_complete(await (await coord.submit({"max_tokens": 3})).collect(), 3)
            await all_slots_free(coord)
            assert coord.epochs == epochs

    run(body())


def test_a_dead_replica_does_not_cut_short_the_abort_of_a_request_on_another() -> None:
    """Request b's talker replica is frozen (SIGSTOP), so b's abort waits for its ack; then
    request a's replica is killed. b's abort must still wait for its own replica (before, the
    death took the talker off every abort's wait and b's abort returned unacknowledged)."""
    cfg = simulated_config(FAST)
    talker = cfg["stages"]["talker_ar"]
    talker["replicas"] = 2
    # A slow talker: the thinker has handed over all 4 tokens (and been acked) long before the
    # talker is done, so once it is frozen only the talker owes b's abort an ack.
    talker["params"].update(first_step_ms=20, step_ms=200, per_request_ms=0)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            a = await coord.submit({"max_tokens": 4})
            b = await coord.submit({"max_tokens": 4})
            ra, rb = (coord.requests[s.request_id].route["talker_ar"] for s in (a, b))
            assert ra != rb, "both requests on one replica: the test shows nothing"
            frozen = coord.supervisor.procs[f"talker_ar#{rb}"]
            await asyncio.sleep(0.3)  # both streaming
            await freeze(frozen.pid)
            try:
                aborting = asyncio.create_task(coord.abort(b.request_id))
                await asyncio.sleep(0.3)
                assert not aborting.done()
                os.kill(coord.supervisor.procs[f"talker_ar#{ra}"].pid, signal.SIGKILL)
                await asyncio.sleep(0.5)  # the death is seen within 50 ms
                assert not aborting.done(), "b's abort returned before its replica acked"
            finally:
                os.kill(frozen.pid, signal.SIGCONT)
            await asyncio.wait_for(aborting, timeout(5))

    run(body())


def test_stage_processes_log_json_lines_when_asked(capfd, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("REALTIME_OMNI_LOG_FORMAT", "json")

    async def body() -> None:
        async with Coordinator(parse_config(simulated_config(FAST))) as coord:
            assert coord.ipc_dir is not None
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(
                coord.graph.endpoint("thinker#0", coord.epochs["thinker#0"], coord.ipc_dir)
            )
            sock.send(b"\xc1 garbage")
            sock.close()
            ctx.term()
            await asyncio.sleep(timeout(0.5))

    run(body())
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]
    assert any(r["process"] == "thinker#0" and r["level"] == "warning" and "dropped" in
               r["message"] for r in records), lines  # fmt: skip


def test_a_warm_spare_takes_over_a_killed_stage_at_once() -> None:
    """With warm_spares, a SIGKILLed stage's loaded spare takes its place (its pid, a new
    epoch), the next request is served without waiting for a start-up, and a new spare loads
    behind it; slots and segments are whole afterwards."""
    cfg = simulated_config(FAST, warm_spares=True)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            await asyncio.wait_for(coord.supervisor.spare_ready["talker_ar#0"], timeout(30))
            spare_epoch, spare = coord.supervisor.spares["talker_ar#0"]
            os.kill(coord.pid_of("talker_ar#0"), signal.SIGKILL)
            t0 = time.monotonic()
            while "talker_ar#0" not in coord.down and coord.pid_of("talker_ar#0") != spare.pid:
                await asyncio.sleep(0.005)
                assert time.monotonic() - t0 < timeout(2)
            after = await coord.submit({"max_tokens": 6})  # waits while the spare takes over
            check_complete(await after.collect(), 6)
            took = time.monotonic() - t0
            assert coord.pid_of("talker_ar#0") == spare.pid
            assert coord.epochs["talker_ar#0"] == spare_epoch
            assert took < timeout(2.0), took  # no stage start-up in it
            await asyncio.wait_for(coord.supervisor.spare_ready["talker_ar#0"], timeout(30))
            assert coord.supervisor.spares["talker_ar#0"][1].pid != spare.pid
            again = await coord.submit({"max_tokens": 6})
            check_complete(await again.collect(), 6)
            await all_slots_free(coord)

    run(body(), limit_s=90)


def test_a_request_no_stage_answers_fails_at_its_deadline_with_the_cause() -> None:
    """The thinker frozen (SIGSTOP: alive to the death watch, deaf to everything): a request
    fails once runtime.first_output_timeout_s passed without an output, naming the stages it
    waited on, and one waiting for a request slot meanwhile fails too, naming the limit.
    Before, both waited for ever."""
    cfg = simulated_config(FAST, first_output_timeout_s=1.0, max_requests=1, abort_timeout_s=1.0)

    async def body() -> None:
        async with Coordinator(parse_config(cfg)) as coord:
            frozen = coord.pid_of("thinker#0") or 0
            await freeze(frozen)
            try:
                t0 = time.monotonic()
                stuck = await coord.submit({"max_tokens": 4})
                with pytest.raises(RequestError, match="held its limit of 1 requests"):
                    await coord.submit({"max_tokens": 4})
                with pytest.raises(RequestError, match=r"no output within 1 s .*'thinker'"):
                    await stuck.collect()
                assert time.monotonic() - t0 < timeout(3)
            finally:
                os.kill(frozen, signal.SIGCONT)
            await until(lambda: coord.in_flight == 0, "the stuck request forgotten")
            check_complete(await (await coord.submit({"max_tokens": 4})).collect(), 4)

    run(body())
