"""Graph derivation: transports, client edges, wait_for, overrides, processes, endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.config import load_config, parse_config
from realtime_omni.pipeline.graph import Graph, group_of
from realtime_omni.pipeline.messages import CLIENT

ROOT = Path(__file__).resolve().parents[3]
SIMULATED = ROOT / "configs" / "simulated-qwen3-omni.yaml"


def st(**kw: Any) -> dict[str, Any]:
    return {"executor": "simulated", **kw}


def graph(stages: dict[str, Any], entry: str = "a", **top: Any) -> Graph:
    return Graph(parse_config({"name": "t", "entry": entry, "stages": stages, **top}))


@pytest.fixture(scope="module")
def sim() -> Graph:
    return Graph(load_config(SIMULATED))


def test_auto_transports() -> None:
    g = graph(
        {
            "a": st(next=["b"], process="p"),  # b shares the process
            "b": st(next=["c"], process="p"),  # c: own process, both cpu
            "c": st(next=["d"]),  # d: cpu -> cuda
            "d": st(next=["e"], device="cuda:0"),  # e: cuda -> cuda, another process
            "e": st(next=["f"], device="cuda:1"),  # f: another host, cuda too
            "f": st(device="cuda:0", host="h1", terminal=True),
        },
        hosts={"h1": {"address": "10.0.0.1"}},
    )
    got = {e.key: e.transport for e in g.edges}
    assert got == {
        "client->a": "shm",
        "a->b": "reference",
        "b->c": "shm",
        "c->d": "shm",
        "d->e": "cuda_ipc",
        "e->f": "tcp",
        "f->client": "tcp",
    }


def test_edges_across_hosts_can_go_through_mooncake() -> None:
    g = graph(
        {
            "a": st(next=["b"]),
            "b": st(next=["c"], host="h1"),
            "c": st(host="h1", terminal=True),
        },
        hosts={"h1": {"address": "10.0.0.1"}},
        runtime={"cross_host_transport": "mooncake"},
    )
    got = {e.key: e.transport for e in g.edges}
    # Within a host, shared memory still; the client is on the coordinator's machine.
    assert got == {"client->a": "shm", "a->b": "mooncake", "b->c": "shm", "c->client": "mooncake"}


def test_cuda_stages_in_one_process_hand_over_by_reference() -> None:
    g = graph(
        {
            "a": st(next=["b"], process="gpu", device="cuda:0"),
            "b": st(process="gpu", device="cuda:0", terminal=True),
        }
    )
    assert g.edge("a", "b").transport == "reference"
    assert g.edge("b", CLIENT).transport == "shm"  # the client is a CPU end


def test_explicit_transport_wins_over_auto() -> None:
    g = graph(
        {"a": st(next=["b"]), "b": st(terminal=True)},
        edges=[{"src": "a", "dst": "b", "transport": "inline"}],
    )
    assert g.edge("a", "b").transport == "inline"
    assert g.edge(CLIENT, "a").transport == "shm"


def test_tcp_on_one_host_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"a->b transport = 'tcp'.*Fix: tcp is for edges across"):
        graph(
            {"a": st(next=["b"]), "b": st(terminal=True)},
            edges=[{"src": "a", "dst": "b", "transport": "tcp"}],
        )


def test_client_edges(sim: Graph) -> None:
    from_client = [e for e in sim.edges if e.src == CLIENT]
    assert [(e.dst, e.kind) for e in from_client] == [("preprocessing", "once")]
    to_client = sorted((e.src, e.kind) for e in sim.edges if e.dst == CLIENT)
    assert to_client == [("code2wav", "stream"), ("decode", "stream")]
    assert sim.terminals == ("decode", "code2wav")
    assert [e.src for e in sim.in_edges[CLIENT]] == ["decode", "code2wav"]
    assert [e.dst for e in sim.out_edges[CLIENT]] == ["preprocessing"]


def test_edge_kinds(sim: Graph) -> None:
    assert sim.edge("preprocessing", "thinker").kind == "once"
    assert sim.edge("thinker", "talker_ar").kind == "stream"
    assert sim.edge("preprocessing", "talker_ar").kind == "once"
    with pytest.raises(KeyError):
        sim.edge("thinker", "preprocessing")


def test_wait_for_defaults_to_every_next_source(sim: Graph) -> None:
    assert sim.wait_for["preprocessing"] == (CLIENT,)
    assert set(sim.wait_for["thinker"]) == {"preprocessing", "image_encoder", "audio_encoder"}
    # talker_ar gets thinker's stream but waits only for the once-input of preprocessing
    assert sim.wait_for["talker_ar"] == ("preprocessing",)
    assert sim.wait_for["decode"] == ()


def test_explicit_wait_for_is_kept() -> None:
    g = graph(
        {
            "a": st(next=["b", "c"]),
            "b": st(next=["c"]),
            "c": st(wait_for=["b"], terminal=True),
        }
    )
    assert g.wait_for["c"] == ("b",)
    assert graph({"a": st(next=["b"]), "b": st(wait_for=[], terminal=True)}).wait_for["b"] == ()


def test_edge_overrides_of_slots_and_slot_bytes(sim: Graph) -> None:
    rt = sim.cfg.runtime
    e = sim.edge("preprocessing", "image_encoder")
    assert (e.slots, e.slot_bytes) == (rt.default_slots, 2408448)
    e = sim.edge("thinker", "talker_ar")
    assert (e.slots, e.slot_bytes) == (64, rt.default_slot_bytes)
    e = sim.edge("code2wav", CLIENT)
    assert (e.slots, e.slot_bytes) == (32, rt.default_slot_bytes)
    e = sim.edge("preprocessing", "thinker")  # no override
    assert (e.slots, e.slot_bytes) == (rt.default_slots, rt.default_slot_bytes)


def test_runtime_defaults_apply_to_edges_without_override() -> None:
    g = graph(
        {"a": st(next=["b"], max_batch=1), "b": st(terminal=True, max_batch=1)},
        runtime={"default_slots": 3, "default_slot_bytes": 128},
        edges=[{"src": "a", "dst": "b", "slots": 5}],
    )
    assert (g.edge("a", "b").slots, g.edge("a", "b").slot_bytes) == (5, 128)
    assert (g.edge(CLIENT, "a").slots, g.edge(CLIENT, "a").slot_bytes) == (3, 128)


def test_processes_with_replicas() -> None:
    g = graph(
        {
            "a": st(next=["b"], process="front", replicas=2),
            "b": st(next=["c"], process="front", replicas=2, threads=4),
            "c": st(replicas=3, host="h1", device="cuda:1", terminal=True),
        },
        hosts={"h1": {"address": "10.0.0.1"}},
    )
    assert g.processes() == ["front#0", "front#1", "c#0", "c#1", "c#2"]
    assert g.local_processes() == ["front#0", "front#1"]
    assert g.groups["front"].stages == ("a", "b")
    assert g.groups["front"].threads == 4
    assert g.groups["c"].devices == ("cuda:1",)
    assert g.groups["c"].host == "h1"
    assert [group_of(p) for p in g.processes()] == ["front", "front", "c", "c", "c"]
    assert group_of("my#group#2") == "my#group"


def test_ipc_endpoints_carry_the_epoch(tmp_path: Path) -> None:
    g = graph({"a": st(next=["b"]), "b": st(terminal=True)})
    ep = g.endpoint("a#0", 3, tmp_path)
    assert ep == f"ipc://{tmp_path}/a#0.3.sock"
    assert g.endpoint("a#0", 4, tmp_path) != ep
    assert g.endpoint(CLIENT, 7, tmp_path) == f"ipc://{tmp_path}/client.sock"


def test_tcp_endpoints_with_hosts(tmp_path: Path) -> None:
    g = graph(
        {"a": st(next=["b"], replicas=2), "b": st(terminal=True, host="h1")},
        hosts={"h1": {"address": "10.0.0.1"}},
        runtime={"base_port": 50000, "bind_host": "10.0.0.9"},
    )
    assert g.endpoint(CLIENT, 0, tmp_path) == "tcp://10.0.0.9:50000"
    assert g.endpoint("a#0", 0, tmp_path) == "tcp://10.0.0.9:50001"
    assert g.endpoint("a#1", 5, tmp_path) == "tcp://10.0.0.9:50002"
    assert g.endpoint("b#0", 0, tmp_path) == "tcp://10.0.0.1:50003"


def test_a_moved_process_is_reached_at_its_new_address_and_shares_no_memory(
    tmp_path: Path,
) -> None:
    g = graph(
        {"a": st(next=["b"]), "b": st(next=["c"], host="h1"), "c": st(terminal=True, host="h1")},
        hosts={"h1": {"address": "10.0.0.1"}},
        runtime={"base_port": 50000},
    )
    assert g.edge("b", "c").transport == "shm" and g.shares_memory("b#0", "c#0")
    g.moved["c#0"] = "10.0.0.2"  # Ray restarted it on another node
    assert g.endpoint("c#0", 1, tmp_path) == "tcp://10.0.0.2:50003"
    assert g.endpoint("b#0", 0, tmp_path) == "tcp://10.0.0.1:50002"
    assert not g.shares_memory("b#0", "c#0")  # b's payloads for c go inline
    assert not g.shares_memory("c#0", CLIENT)  # nor is it on the coordinator's machine
    g.moved["b#0"] = "10.0.0.2"  # b followed it there
    assert g.shares_memory("b#0", "c#0")


def test_edges_get_credits_for_a_batch() -> None:
    """A streaming edge not set in the config lends `max_batch` requests their share each; one
    set below the batch is refused, naming the fix. Once-edges keep their credits: a
    once-payload holds one only until its request starts."""
    g = graph({"a": st(stream_to=["b"], max_batch=4), "b": st(terminal=True, max_batch=32)})
    assert g.edge("a", "b").slots == 32 * 2  # 8 default slots: 2 per request
    assert g.edge("b", "client").slots == 64  # b batches what it sends to the caller
    assert g.edge("client", "a").slots == 8  # once
    with pytest.raises(ConfigError, match=r"slots = 16: fewer than the 32 requests.*max_batch"):
        graph(
            {"a": st(stream_to=["b"]), "b": st(terminal=True)},
            edges=[{"src": "a", "dst": "b", "slots": 16}],
        )


def test_request_slots_default_to_a_quarter_of_the_edge() -> None:
    g = graph(
        {"a": st(stream_to=["b"]), "b": st(terminal=True, max_batch=2)},
        edges=[
            {"src": "a", "dst": "b", "slots": 64},
            {"src": "b", "dst": "client", "slots": 2, "request_slots": 2},
        ],
    )
    assert g.edge("a", "b").request_slots == 16
    assert g.edge("b", "client").request_slots == 2
    assert g.edge("client", "a").request_slots == 2  # 8 default slots
