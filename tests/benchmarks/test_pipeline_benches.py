"""benchmarks/abort.py, concurrency.py, first_audio.py, gc_pause.py, kv_pressure.py and
vocoder_shapes.py run end to end with a handful of requests (or passes) and write their JSON
(its shape is checked, not its numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from realtime_omni.pipeline.shm import list_segments
from tests.conftest import ROOT, timeout


def bench(script: str, *args: str, limit_s: float) -> tuple[dict, str]:
    """Run a benchmark script; gives its JSON and its stdout."""
    out = Path(args[-1])
    proc = subprocess.Popen(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout(limit_s))
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert list_segments(proc.pid) == []  # its coordinator's segments are named after its pid
    return json.loads(out.read_text()), stdout


def test_abort_benchmark_smoke(tmp_path: Path) -> None:
    args = ("--requests", "6", "--concurrency", "2", "--json", str(tmp_path / "abort.json"))
    data, stdout = bench("abort.py", *args, limit_s=120)
    (run,) = data["runs"]
    assert run["requests"] == 6 and run["concurrency"] == 2
    ack, baseline = run["abort_ack_ms"], run["baseline_stats_rtt_ms"]
    assert 0 < ack["p50"] <= ack["p99"] <= ack["max"] and 0 < baseline["p50"] <= baseline["p99"]
    assert run["before"] == run["after"] | {"rss_mb": run["before"]["rss_mb"]}
    assert "leak check: clean" in stdout


def test_first_audio_benchmark_smoke(tmp_path: Path) -> None:
    args = ("--configs", "simulated", "--requests", "1", "--max-tokens", "4")
    data, stdout = bench("first_audio.py", *args, "--json", str(tmp_path / "fa.json"), limit_s=180)
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"streaming", "serial"}
    for mode, r in runs.items():
        assert r["config"] == "simulated" and r["requests"] == 1
        assert 0 < r["compute_floor_ms"] < r["first_audio_ms_p50"] <= r["total_ms_p50"], mode
        assert r["overhead_ms_p50"] == r["first_audio_ms_p50"] - r["compute_floor_ms"]
    # Serial gives its audio in one piece at the end, after every talker frame was made.
    serial = runs["serial"]
    assert serial["first_audio_ms_p50"] == pytest.approx(serial["total_ms_p50"], rel=0.05)
    assert runs["streaming"]["first_audio_ms_p50"] < runs["serial"]["first_audio_ms_p50"]
    assert "serial / streaming first audio" in stdout


def test_gc_pause_benchmark_smoke(tmp_path: Path) -> None:
    args = ("--process", "speech", "--passes", "1", "--json", str(tmp_path / "gc.json"))
    data, stdout = bench("gc_pause.py", *args, limit_s=120)
    assert set(data) == {"objects", "frozen", "full_pass_ms", "frozen_pass_ms"}
    assert 10_000 < data["frozen"] <= data["objects"]
    assert data["full_pass_ms"] > 0 and data["frozen_pass_ms"] > 0
    assert "start-up frozen" in stdout


def test_concurrency_benchmark_smoke(tmp_path: Path) -> None:
    """Simulated config, 1 and 4 streams: the batched rows beat the unbatched ones at 4 streams
    (a simulated batch step costs less than four single steps, by the cost model)."""
    args = ("--configs", "simulated", "--streams", "1,4", "--max-tokens", "4")
    data, stdout = bench("concurrency.py", *args, "--json", str(tmp_path / "c.json"), limit_s=180)
    rows = {(r["batched"], r["streams"]): r for r in data["rows"]}
    assert set(rows) == {(True, 1), (True, 4), (False, 1), (False, 4)}
    for r in rows.values():
        assert set(r) == {"config", "batched", "streams", "frames_per_s", "worst_rtf",
                          "first_audio_ms_p50", "first_audio_ms_p99", "worst_stall_ms",
                          "stages"}  # fmt: skip
        assert r["worst_stall_ms"] >= 0
        # The stages' step logs over the run: every model stage stepped, none for longer than
        # the run, and none on a CPU for longer than it stepped.
        for stage in ("thinker", "talker_ar", "code2wav"):
            t = r["stages"][stage]
            assert t["steps"] > 0 and 0 < t["busy"] <= 1.05, (stage, t)
            assert 0 <= t["cpu"] <= t["busy"], (stage, t)
        assert r["config"] == "simulated" and r["frames_per_s"] > 0 and r["worst_rtf"] > 0
        assert 0 < r["first_audio_ms_p50"] <= r["first_audio_ms_p99"]
    assert rows[(True, 4)]["frames_per_s"] > rows[(False, 4)]["frames_per_s"]
    assert "batched / max_batch 1 frames/s" in stdout and "stage time" in stdout


@pytest.mark.slow
def test_conversation_benchmark_smoke(tmp_path: Path) -> None:
    """Three turns of the tiny model: with kept caches the later turns prefill less than the
    whole history, without them they prefill it all."""
    args = ("--turns", "3", "--max-tokens", "4", "--json", str(tmp_path / "conv.json"))
    data, stdout = bench("conversation.py", *args, limit_s=240)
    rows = {(r["kept"], r["turn"]): r for r in data["rows"]}
    assert set(rows) == {(k, t) for k in (True, False) for t in (1, 2, 3)}
    for (kept, turn), r in rows.items():
        whole = rows[(False, turn)]["prefill_tokens"]
        if kept and turn > 1:
            assert r["cached_tokens"] > 0 and r["prefill_tokens"] < whole
            assert r["cached_tokens"] + r["prefill_tokens"] == whole
        else:
            assert r["cached_tokens"] == 0
        assert r["first_audio_ms"] > 0
    assert "turn 3 / turn 1 first audio" in stdout


@pytest.mark.slow
def test_batch_steps_benchmark_at_real_widths_with_random_weights(tmp_path: Path) -> None:
    """The real-size config path of benchmarks/batch_steps.py (the one gpu_check.sh runs), on
    the CPU: the published config (real_width.PUBLISHED) with one layer per part and few
    experts, random weights built on the device, the tiny token ids; every stage steps at
    batch 2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import batch_steps

    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny

    small = {"num_hidden_layers": 1, "num_experts": 8, "vocab_size": 4096}
    d = batch_steps.real_size_dir(ensure_tiny(0), tmp_path / "real", scale=small)
    cfg = json.loads((d / "config.json").read_text())
    talker = cfg["talker_config"]
    for part in (talker["text_config"], talker["code_predictor_config"], cfg["code2wav_config"]):
        part["num_hidden_layers"] = 1
        part.pop("layer_types", None)
    talker["text_config"]["num_experts"] = 8
    talker["accept_hidden_layer"] = 1  # the thinker has one layer here
    (d / "config.json").write_text(json.dumps(cfg))
    got = batch_steps.measure({"path": str(d), "dtype": "float32"}, "cpu", 2, 2)
    assert set(got) == {"thinker", "talker_ar", "code2wav"} and all(v > 0 for v in got.values())
    assert cfg["thinker_config"]["text_config"]["hidden_size"] == 2048
    assert cfg["thinker_config"]["audio_config"]["output_dim"] == 2048  # the defaults say 3,584
    assert cfg["talker_config"]["text_config"]["num_experts_per_tok"] == 6  # the defaults, 8
    assert (
        cfg["im_end_token_id"]
        == json.loads((ensure_tiny(0) / "config.json").read_text())["im_end_token_id"]
    )


def test_vocoder_shapes_benchmark_times_each_variant(tmp_path: Path) -> None:
    args = ("--rows", "1,2", "--frames", "2", "--rounds", "1", "--json", str(tmp_path / "v.json"))
    data, stdout = bench("vocoder_shapes.py", *args, limit_s=120)
    assert [r["variant"] for r in data["rows"]] == ["onednn-1024", "onednn", "native"]
    assert all(r["first_ms"] > 0 and r["known_ms"] > 0 for r in data["rows"])
    assert "known shapes" in stdout


def test_soak_benchmark_leaves_nothing_behind(tmp_path: Path) -> None:
    """400 requests, 30 % aborted at random, a stage process SIGKILLed every 150: every
    request completed, was aborted or met the killed process, and afterwards credits, held
    requests, segments, file descriptors and threads are where they started."""
    args = ("--requests", "400", "--kill-every", "150", "--json", str(tmp_path / "soak.json"))
    data, stdout = bench("soak.py", *args, limit_s=180)
    out = data["outcomes"]
    assert out["error"] == 0 and sum(out.values()) == 400, data["errors"]
    assert out["completed"] > 100 and out["aborted"] > 50 and data["kills"] == 2
    for key in ("in_flight", "slots_lent", "requests_held", "segments", "threads"):
        assert data["after"][key] == data["before"][key], key
    assert data["after"]["fds"] <= data["before"]["fds"] + 2
    assert "soak: clean" in stdout


def test_gateway_soak_benchmark_leaves_nothing_behind(tmp_path: Path) -> None:
    """benchmarks/soak_gateway.py, briefly: polite callers' turns complete (or fail saying a
    stage died) beside misbehaving callers and a stage SIGKILLed, each request past a bound (a
    form's parts, an image's pixels, audio faster than real time, an offer's m= lines) is
    refused with its own error, and the server's sessions, credits, threads, fds and segments
    are back after each round."""
    args = ("--seconds", "6", "--rounds", "2", "--kill-every", "1.5", "--polite", "2")
    json_at = str(tmp_path / "s.json")
    data, stdout = bench("soak_gateway.py", *args, "--rude", "1", "--json", json_at, limit_s=150)
    assert "soak_gateway: clean" in stdout, stdout
    assert data["turns"] >= 2 and data["completed"] + data["failed_clearly"] == data["turns"], data
    assert data["rude_errors"] > 0 and data["polite_errors"] == 0, data
    assert data["kills"] == 2 and len(data["segments"]) == 3, data
    assert data["not_refused"] == 0 and set(data["refused"]) == {"form", "pixels", "fast", "offer"}
    assert all(n >= 1 for n in data["refused"].values()), data


def test_kv_pressure_benchmark_kills_no_running_answer(tmp_path: Path) -> None:
    """benchmarks/kv_pressure.py, briefly: 6 callers at once into pools for one answer each
    stage; its JSON has exactly the documented keys, and every answer started completes."""
    args = ("--callers", "6", "--answers", "1", "--arrive-s", "0.5", "--max-tokens", "12")
    args += ("--no-baseline",)
    data, stdout = bench("kv_pressure.py", *args, "--json", str(tmp_path / "kv.json"), limit_s=120)
    assert set(data) == {"answers_started", "answers_completed", "running_answers_killed",
                         "refused", "waited_ms_p99", "evictions"}  # fmt: skip
    assert data["running_answers_killed"] == 0 and data["refused"] == 0, stdout
    assert data["answers_started"] == data["answers_completed"] == 6, stdout
    assert "no running answer killed, every admitted answer completes: True" in stdout
