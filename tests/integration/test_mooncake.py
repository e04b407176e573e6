"""Edges through Mooncake's transfer engine: real engines in real processes, over its TCP
protocol on this machine (the `mooncake` extra)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import yaml

from realtime_omni.errors import PayloadTooLarge, RequestError
from realtime_omni.pipeline import messages as m
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from realtime_omni.pipeline.graph import Edge
from realtime_omni.pipeline.relay import Inlet, Outlet
from tests.conftest import ROOT, run
from tests.integration.test_pipeline import all_slots_free, check_complete
from tests.integration.test_placement import curve_key, two_hosts  # noqa: F401

pytest.importorskip("mooncake.engine", reason="the mooncake extra is not installed")

EDGE = Edge("thinker", "talker_ar", "stream", "mooncake", slots=2, slot_bytes=1 << 20)


def hidden(rows: int, seed: int) -> np.ndarray:
    """Rows of bf16 hidden states, width 2048, as the thinker sends the talker."""
    values = np.random.default_rng(seed).standard_normal((rows, 2048), np.float32)
    return values.astype(ml_dtypes.bfloat16)


def sender(conn: Connection) -> None:
    """Another process's end of the edge: sends what the parent asks for, releases on ack."""
    outlet = Outlet(EDGE, "thinker#0", 0, 1, inline_max_bytes=4096)
    try:
        while (ask := conn.recv()) is not None:
            if ask[0] == "ack":
                outlet.pool.release(ask[1])
                continue
            _, rows, seed = ask
            lease = outlet.acquire(f"r{seed}", "talker_ar#0")
            assert lease is not None
            payload = {"hidden": hidden(rows, seed), "index": seed}
            try:
                msg, frames = outlet.pack(f"r{seed}", lease, payload, {}, shared=False)
            except PayloadTooLarge as e:
                conn.send(("too large", str(e)))
                continue
            conn.send((m.encode(msg), [bytes(f) for f in frames]))
    finally:
        outlet.close()


@pytest.fixture
def far_end() -> Iterator[tuple[Connection, Any]]:
    """The pipe to a `sender` in a spawned process, and that process."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=sender, args=(there,), daemon=True)
    child.start()
    try:
        yield here, child
    finally:
        child.kill()
        child.join(10)


def test_an_edge_through_mooncake_moves_payloads_between_processes(far_end) -> None:
    here, child = far_end
    inlet = Inlet()
    try:
        for seed, rows in enumerate([130, 784, 130, 1]):  # 520 KB, 3 MB: too large; 4 KB
            here.send(("send", rows, seed))
            reply = here.recv()
            if rows == 784:
                assert reply[0] == "too large" and "slot_bytes" in reply[1]
                continue
            msg = m.decode(reply[0])
            assert isinstance(msg, m.DataReady)
            # A payload over inline_max_bytes is read through Mooncake even though the peer
            # shares no memory with the sender (`shared=False`); a small one rides inline.
            assert msg.transport == ("mooncake" if rows > 1 else "inline")
            assert msg.meta["index"] == seed
            payload = inlet.open(msg, [b"", *reply[1]])
            assert payload["hidden"].dtype == ml_dtypes.bfloat16
            assert payload["hidden"].tobytes() == hidden(rows, seed).tobytes()
            # The slot comes back on the ack; the pool lends it again first, for the next one.
            here.send(("ack", msg.lease))
        here.send(None)
        child.join(10)
        assert child.exitcode == 0
        assert inlet.mooncake.scratch is not None  # it read through its engine
    finally:
        inlet.close()


def test_a_payload_whose_sender_died_before_it_was_read_fails_clearly(far_end) -> None:
    here, child = far_end
    inlet = Inlet()
    try:
        here.send(("send", 130, 7))
        msg = m.decode(here.recv()[0])
        assert isinstance(msg, m.DataReady) and msg.transport == "mooncake"
        child.kill()
        child.join(10)
        with pytest.raises(RequestError, match="Mooncake read from"):
            inlet.open(msg, [])
    finally:
        inlet.close()


@pytest.mark.usefixtures("curve_key")
def test_the_simulated_graph_runs_with_its_remote_talker_behind_mooncake(tmp_path) -> None:
    cfg, command = two_hosts(tmp_path, inline_max_bytes=256)
    edges = {(e["src"], e["dst"]): e for e in cfg.setdefault("edges", [])}
    for key in [("thinker", "talker_ar"), ("talker_ar", "code2wav"), ("code2wav", "client")]:
        if key not in edges:
            edges[key] = {"src": key[0], "dst": key[1]}
            cfg["edges"].append(edges[key])
        edges[key]["transport"] = "mooncake"
    (tmp_path / "two-hosts.yaml").write_text(yaml.safe_dump(cfg))

    async def body() -> None:
        remote = subprocess.Popen(command, cwd=ROOT)
        try:
            async with Coordinator(parse_config(cfg)) as coord:
                assert coord.graph.edge("thinker", "talker_ar").transport == "mooncake"
                streams = [await coord.submit({"max_tokens": 12}) for _ in range(4)]
                for s in streams:
                    check_complete(await s.collect(), 12)
                assert coord.inlet.mooncake.scratch is not None  # code2wav's audio came that way
                await all_slots_free(coord)
        finally:
            remote.kill()
            remote.wait()

    run(body(), limit_s=90)


def test_mooncake_between_stages_of_one_process_is_refused() -> None:
    from realtime_omni.errors import ConfigError
    from tests.conftest import simulated_config

    cfg = simulated_config()
    for name in ("thinker", "talker_ar"):
        cfg["stages"][name]["process"] = "gpu0"
    cfg["edges"] = [{"src": "thinker", "dst": "talker_ar", "transport": "mooncake"}]
    with pytest.raises(ConfigError, match="share a process"):
        parse_config(cfg)


def test_a_mooncake_edge_without_the_engine_fails_at_start_with_the_fix(monkeypatch) -> None:
    from realtime_omni.errors import ConfigError

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'realtime-omni\[mooncake\]'"):
        Outlet(EDGE, "thinker#0", 0, 1, inline_max_bytes=4096, host="127.0.0.3")
