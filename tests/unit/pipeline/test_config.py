"""Config loading and validation: every problem is a ConfigError naming field, value and fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.config import PipelineConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[3]
SIMULATED = ROOT / "configs" / "simulated-qwen3-omni.yaml"


def st(**kw: Any) -> dict[str, Any]:
    return {"executor": "simulated", **kw}


def cfg(stages: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    """A valid two-stage config `a -> b` (b terminal), with `stages`/top-level keys replaced."""
    data: dict[str, Any] = {
        "name": "t",
        "entry": "a",
        "stages": stages or {"a": st(next=["b"]), "b": st(terminal=True)},
    }
    data.update(top)
    return data


def error_of(data: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


TWO_HOSTS = {"h1": {"address": "10.0.0.1"}, "h2": {"address": "10.0.0.2"}}

# (id, config, field, value as it appears, a fragment of the fix)
CASES = [
    (
        "unknown-next",
        cfg({"a": st(next=["b", "nope"]), "b": st(terminal=True)}),
        "stages.a.next[1]",
        "'nope'",
        "use one of: a, b",
    ),
    (
        "unknown-stream_to",
        cfg({"a": st(next=["b"], stream_to=["nope"]), "b": st(terminal=True)}),
        "stages.a.stream_to[0]",
        "'nope'",
        "use one of: a, b",
    ),
    (
        "unknown-wait_for",
        cfg({"a": st(next=["b"]), "b": st(terminal=True, wait_for=["nope"])}),
        "stages.b.wait_for[0]",
        "'nope'",
        "use a subset of: a",
    ),
    (
        "wait_for-stream-source",
        cfg({"a": st(stream_to=["b"]), "b": st(terminal=True, wait_for=["a"])}),
        "stages.b.wait_for[0]",
        "'a'",
        "use a subset of: none",
    ),
    (
        "unknown-edge-stage",
        cfg(edges=[{"src": "a", "dst": "nope", "slots": 4}]),
        "edges[0]",
        "'a->nope'",
        "name a pair from some stage's next/stream_to",
    ),
    (
        "edge-not-in-graph",
        cfg(edges=[{"src": "b", "dst": "a"}]),
        "edges[0]",
        "'b->a'",
        "client->entry or terminal->client",
    ),
    (
        "edge-client-to-non-entry",
        cfg(edges=[{"src": "client", "dst": "b"}]),
        "edges[0]",
        "'client->b'",
        "client->entry",
    ),
    (
        "edge-overridden-twice",
        cfg(edges=[{"src": "a", "dst": "b"}, {"src": "a", "dst": "b"}]),
        "edges[1]",
        "'a->b'",
        "merge the two entries",
    ),
    (
        "cycle",
        cfg(
            {
                "a": st(next=["b"]),
                "b": st(next=["c"]),
                "c": st(next=["b"], terminal=True),
            }
        ),
        "stages",
        "'b -> c -> b'",
        "remove one edge of the cycle",
    ),
    (
        "unreachable",
        cfg({"a": st(next=["b"]), "b": st(terminal=True), "c": st(terminal=True)}),
        "stages.c",
        "'c'",
        "add it to some reachable stage's next or stream_to",
    ),
    (
        "no-terminal",
        cfg({"a": st(next=["b"]), "b": st()}),
        "stages.*.terminal",
        "False",
        "set terminal: true",
    ),
    ("entry-not-a-stage", cfg(entry="x"), "entry", "'x'", "use one of: a, b"),
    (
        "process-on-two-hosts",
        cfg(
            {
                "a": st(next=["b"], process="p", host="h1"),
                "b": st(terminal=True, process="p", host="h2"),
            },
            hosts=TWO_HOSTS,
        ),
        "stages.b.host",
        "'h2'",
        "stages in one process must name the same host",
    ),
    (
        "process-with-two-replica-counts",
        cfg({"a": st(next=["b"], process="p", replicas=2), "b": st(terminal=True, process="p")}),
        "stages.b.replicas",
        "1",
        "stages in one process must have the same replicas",
    ),
    (
        "undeclared-host",
        cfg({"a": st(next=["b"], host="gpu9"), "b": st(terminal=True)}),
        "stages.a.host",
        "'gpu9'",
        "add hosts.gpu9.address",
    ),
    (
        "bad-device-name",
        cfg({"a": st(next=["b"], device="gpu0"), "b": st(terminal=True)}),
        "stages.a.device",
        "'gpu0'",
        "use cpu or cuda:N",
    ),
    (
        "bad-device-no-index",
        cfg({"a": st(next=["b"]), "b": st(terminal=True, device="cuda")}),
        "stages.b.device",
        "'cuda'",
        "use cpu or cuda:N",
    ),
    (
        "feeds-itself",
        cfg({"a": st(next=["a", "b"]), "b": st(terminal=True)}),
        "stages.a.next[0]",
        "'a'",
        "remove the edge",
    ),
    (
        "listed-twice",
        cfg({"a": st(next=["b", "b"]), "b": st(terminal=True)}),
        "stages.a.next",
        "['b', 'b']",
        "list each downstream stage once",
    ),
    (
        "next-and-stream_to",
        cfg({"a": st(next=["b"], stream_to=["b"]), "b": st(terminal=True)}),
        "stages.a",
        "['b']",
        "keep each downstream stage in one of the two lists",
    ),
    (
        "reference-across-processes",
        cfg(edges=[{"src": "a", "dst": "b", "transport": "reference"}]),
        "edges[0].transport",
        "'reference'",
        "use reference only between stages sharing a process",
    ),
    (
        "reference-from-client",
        cfg(edges=[{"src": "client", "dst": "a", "transport": "reference"}]),
        "edges[0].transport",
        "'reference'",
        "use reference only between stages sharing a process",
    ),
    (
        "shm-across-hosts",
        cfg(
            {"a": st(next=["b"]), "b": st(terminal=True, host="h1")},
            hosts=TWO_HOSTS,
            edges=[{"src": "a", "dst": "b", "transport": "shm"}],
        ),
        "edges[0].transport",
        "'shm'",
        "use tcp (or auto) across hosts",
    ),
    (
        "cuda_ipc-with-cpu-end",
        cfg(
            {"a": st(next=["b"], device="cuda:0"), "b": st(terminal=True)},
            edges=[{"src": "a", "dst": "b", "transport": "cuda_ipc"}],
        ),
        "edges[0].transport",
        "'cuda_ipc'",
        "use shm (or auto) for edges with a CPU end",
    ),
    (
        "cuda_ipc-to-client",
        cfg(
            {"a": st(next=["b"], device="cuda:0"), "b": st(terminal=True, device="cuda:0")},
            edges=[{"src": "b", "dst": "client", "transport": "cuda_ipc"}],
        ),
        "edges[0].transport",
        "'cuda_ipc'",
        "use shm (or auto) for edges with a CPU end",
    ),
    (
        "bad-stage-name",
        cfg({"a": st(next=["client"]), "client": st(terminal=True)}),
        "stages",
        "'client'",
        "use letters, digits, _ and -",
    ),
    (
        "bad-executor-name",
        cfg({"a": st(next=["b"], executor="no such"), "b": st(terminal=True)}),
        "stages.a.executor",
        "'no such'",
        "'package.module:Class'",
    ),
]


@pytest.mark.parametrize(
    ("data", "field", "value", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_validation_error_names_field_value_and_fix(
    data: dict[str, Any], field: str, value: str, fix: str
) -> None:
    msg = error_of(data)
    assert f"{field} = {value}:" in msg
    assert "Fix:" in msg
    assert fix in msg.split("Fix:", 1)[1]


def test_the_minimal_config_is_valid() -> None:
    # The base of every case above must itself be valid, or the cases prove nothing.
    c = parse_config(cfg())
    assert isinstance(c, PipelineConfig)
    assert c.stages["a"].next == ["b"]
    assert c.stages["b"].terminal


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:12"])
def test_good_devices_are_accepted(device: str) -> None:
    c = parse_config(cfg({"a": st(next=["b"], device=device), "b": st(terminal=True)}))
    assert c.stages["a"].device == device


def test_cycle_message_shows_the_whole_cycle_path() -> None:
    data = cfg(
        {
            "a": st(next=["b"]),
            "b": st(stream_to=["c"]),
            "c": st(next=["d"]),
            "d": st(next=["b"], terminal=True),
        }
    )
    assert "'b -> c -> d -> b'" in error_of(data)


def test_unknown_stage_field_names_the_field_and_value() -> None:
    msg = error_of(cfg({"a": st(next=["b"], stram_to=["b"]), "b": st(terminal=True)}))
    assert "'stages.a.stram_to'" in msg
    assert "['b']" in msg
    assert "Extra inputs are not permitted" in msg


def test_unknown_top_level_field_names_the_field_and_value() -> None:
    msg = error_of(cfg(edge=[]))
    assert "'edge' = []" in msg
    assert "Extra inputs are not permitted" in msg


def test_unknown_stage_field_message_gives_a_fix() -> None:
    msg = error_of(cfg({"a": st(next=["b"], stram_to=["b"]), "b": st(terminal=True)}))
    assert "Fix:" in msg
    assert "stream_to" in msg.split("Fix:", 1)[1]


def test_out_of_range_value_names_the_field() -> None:
    msg = error_of(cfg(edges=[{"src": "a", "dst": "b", "slots": 0}]))
    assert "'edges.0.slots' = 0" in msg


def test_several_pydantic_problems_are_counted() -> None:
    msg = error_of(cfg({"a": st(next=["b"], replicas=0, threads=0), "b": st(terminal=True)}))
    assert "(and 1 more problems)" in msg


def test_top_level_must_be_a_mapping() -> None:
    assert "the top level must be a mapping, got list" in error_of([1, 2])


def test_duplicate_in_stream_to_names_the_stream_to_field() -> None:
    stages = {"a": st(next=["b"], stream_to=["c", "c"]), "b": st(terminal=True), "c": st()}
    msg = error_of(cfg(stages))
    assert "stages.a.stream_to = ['c', 'c']" in msg


def test_simulated_config_loads() -> None:
    c = load_config(SIMULATED)
    assert c.name == "simulated-qwen3-omni"
    assert c.entry == "preprocessing"
    assert set(c.stages) == {
        "preprocessing",
        "image_encoder",
        "audio_encoder",
        "thinker",
        "decode",
        "talker_ar",
        "code2wav",
    }
    assert {n for n, s in c.stages.items() if s.terminal} == {"decode", "code2wav"}
    assert c.stages["thinker"].stream_to == ["decode", "talker_ar"]
    assert (c.edges[0].src, c.edges[0].dst, c.edges[0].slot_bytes) == (
        "preprocessing",
        "image_encoder",
        2408448,
    )


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert repr(str(path)) in msg
    assert "does not exist" in msg
    assert "pass a YAML file path" in msg


def test_a_folder_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)


def test_invalid_yaml_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nentry: a\nstages: {a: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "not valid YAML" in msg
    assert "line" in msg


def test_empty_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match="top level must be a mapping, got NoneType"):
        load_config(path)


def test_errors_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nentry: x\nstages: {a: {executor: simulated, terminal: true}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: entry = 'x'")


@pytest.mark.parametrize("name", ["qwen3-omni-1gpu.yaml", "qwen3-omni-2gpu.yaml"])
def test_gpu_configs_fit_the_longest_audio_a_turn_carries(name: str) -> None:
    """A turn carries at most the gateway's entry payload of float32 16 kHz audio; its mel
    (128 bins, 100 frames a second) and its embeddings (Qwen3-Omni's audio encoder gives 130
    per 1,000 frames: 13 a second, 2,048 bf16 each) must fit their edges' slots."""
    import math

    from realtime_omni.gateway.app import GatewayConfig
    from realtime_omni.pipeline.graph import Graph

    seconds = (GatewayConfig().entry_slot_bytes - 64 * 1024) / 4 / 16000
    g = Graph(load_config(ROOT / "configs" / name))
    assert g.edge("preprocessing", "audio_encoder").slot_bytes >= 128 * math.ceil(100 * seconds) * 4
    assert g.edge("audio_encoder", "thinker").slot_bytes >= math.ceil(13 * seconds) * 2048 * 2
