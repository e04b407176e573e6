"""The memory plan (models/qwen3_omni/memory_plan.py, `realtime-omni check --gpu`): each shipped
GPU config fits the card its first line names, the 2-GPU config as it shipped before issue 43
does not fit two H100s, an unset KV pool gets what its card leaves, and the figures in the
configs' comments are the plan's. Meta tensors only: no GPU, no weights (a few seconds a
config, each step measured once for the module)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from realtime_omni.cli import main
from realtime_omni.errors import ConfigError
from realtime_omni.models.qwen3_omni import memory_plan as mp
from realtime_omni.models.qwen3_omni.cache import BLOCK_TOKENS, pool_blocks
from realtime_omni.models.qwen3_omni.real_width import PUBLISHED
from realtime_omni.models.qwen3_omni.step_memory import measure
from realtime_omni.pipeline.config import parse_config
from tests.conftest import ROOT

CONFIGS = ROOT / "configs"
# Each shipped GPU config, the card its first line names, and that card's --gpu name.
SHIPPED = {
    "qwen3-omni-2gpu.yaml": ("two H100 80 GB", "h100-80"),
    "qwen3-omni-1gpu.yaml": ("one H200 141 GB", "h200-141"),
}


def config(name: str, **stages: dict[str, Any]) -> dict[str, Any]:
    """A shipped config as a dict, with stages' fields replaced (None: removed)."""
    data = yaml.safe_load((CONFIGS / name).read_text())
    for stage, fields in stages.items():
        for key, value in fields.items():
            target = data["stages"][stage]
            if key == "params":
                target = target["params"]
                for k, v in value.items():
                    target.pop(k, None) if v is None else target.__setitem__(k, v)
            elif value is None:
                target.pop(key, None)
            else:
                target[key] = value
    return data


def old_2gpu() -> dict[str, Any]:
    """configs/qwen3-omni-2gpu.yaml before issue 43: a 50 GiB thinker pool on cuda:0 beside the
    thinker, the encoders (at the default max_batch, 32) and code2wav."""
    return config(
        "qwen3-omni-2gpu.yaml",
        thinker={"params": {"kv_cache_gib": 50}},
        image_encoder={"max_batch": None},
        audio_encoder={"max_batch": None},
    )


def write(tmp_path: Path, data: dict[str, Any]) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def plan_of(data: dict[str, Any], card: str) -> list[mp.DevicePlan]:
    return mp.plan(parse_config(data), mp.CARDS[card], card)


def stage(plans: list[mp.DevicePlan], name: str) -> mp.StagePlan:
    return next(s for d in plans for s in d.stages if s.stage == name)


def gib(n: int) -> str:
    return f"{n / mp.GIB:.2f}"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_gpu_config_names_its_card_and_fits_it(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    card_words, card = SHIPPED[name]
    first = (CONFIGS / name).read_text().splitlines()[0]
    assert card_words in first, first
    assert main(["check", "--config", str(CONFIGS / name), "--gpu", card]) == 0
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" not in out and err == ""
    devices = {s.device for s in parse_config(config(name)).stages.values()} - {"cpu"}
    assert out.count(f": {card}, ") == len(devices)  # a table for each


def test_the_old_2gpu_config_is_refused_on_two_h100s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--config", write(tmp_path, old_2gpu()), "--gpu", "h100-80"]) == 1
    out, err = capsys.readouterr()
    dev = next(d for d in plan_of(old_2gpu(), "h100-80") if d.device == "cuda:0")
    assert dev.spare < -50 * mp.GIB  # the pool alone is over by its size
    assert err.startswith("realtime-omni: cuda:0 (h100-80, 79.65 GiB): short by ")
    assert f"short by {gib(-dev.spare)} GiB" in err
    assert "thinker 50.00 GiB" in err  # the stage whose pool to change
    assert "cuda:1" not in err  # the talker's GPU fits
    assert "cuda:0: h100-80, 79.65 GiB" in out and "DOES NOT FIT" in out


def test_gpu_memory_plans_any_card(capsys: pytest.CaptureFixture[str]) -> None:
    one = str(CONFIGS / "qwen3-omni-1gpu.yaml")
    assert main(["check", "--config", one, "--gpu-memory", "80"]) == 1  # one GPU needs an H200
    out, err = capsys.readouterr()
    assert "cuda:0: 80 GiB card, 80.00 GiB" in out
    assert "cuda:0 (80 GiB card, 80.00 GiB): short by " in err and "thinker" in err
    assert main(["check", "--config", one, "--gpu-memory", "200"]) == 0
    assert main(["check", "--config", one, "--gpu-memory", "0"]) == 2  # refused, with the fix


def test_check_without_a_card_prints_the_graph_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--config", str(CONFIGS / "tiny.yaml")]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("process front x1: ") and "GiB" not in out
    assert main(["check", "--config", str(CONFIGS / "tiny.yaml"), "--gpu", "l40s-48"]) == 0
    assert "no stage on a CUDA device" in capsys.readouterr().out


def test_an_unset_pool_gets_what_its_card_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both pools of the one-GPU config unset: together they take what the card leaves (to a
    block), each in proportion to its bytes a token; a card 8 GiB larger gives them 8 GiB more,
    less its larger reserve and their larger steps; and `pool_blocks` on CUDA, given the
    config, sizes the thinker's pool by the plan for the card's total memory."""
    unset = {"params": {"kv_cache_gib": None}}
    data = config("qwen3-omni-1gpu.yaml", thinker=unset, talker_ar=unset)
    card = mp.CARDS["h200-141"]
    (dev,) = mp.plan(parse_config(data), card)
    thinker, talker = stage([dev], "thinker"), stage([dev], "talker_ar")
    assert thinker.kv_planned and talker.kv_planned
    blocks = (thinker.kv_per_token + talker.kv_per_token) * BLOCK_TOKENS
    assert 0 <= dev.spare < blocks
    ratio = thinker.kv / talker.kv
    assert abs(ratio - thinker.kv_per_token / talker.kv_per_token) < 0.01
    (bigger,) = mp.plan(parse_config(data), card + 8 * mp.GIB)
    grown = stage([bigger], "thinker").kv + stage([bigger], "talker_ar").kv - thinker.kv - talker.kv
    steps, reserve = bigger.steps - dev.steps, bigger.reserve - dev.reserve
    assert steps >= 0 and abs(grown - (8 * mp.GIB - reserve - steps)) < blocks

    cfg = parse_config(data)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (card // 3, card))
    text = _text_config()
    got = pool_blocks({}, text, torch.bfloat16, torch.device("cuda:0"), "thinker", cfg)
    assert got == thinker.kv // (thinker.kv_per_token * BLOCK_TOKENS)
    with pytest.raises(ConfigError, match="short by"):  # a card too small for the weights
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 60 * mp.GIB))
        pool_blocks({}, text, torch.bfloat16, torch.device("cuda:0"), "thinker", cfg)


def _text_config() -> Any:
    from realtime_omni.models.qwen3_omni.real_width import build_config

    return build_config(None).thinker_config.text_config


def test_the_configs_comments_carry_the_plans_figures() -> None:
    """Every figure in the GPU configs' comments, as the plan and the published config give it."""

    def per_token(part: str) -> int:
        text = (PUBLISHED["thinker_config"] if part == "thinker" else PUBLISHED["talker_config"])[
            "text_config"
        ]
        return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 2

    def pool(gib_: int, part: str) -> str:
        block = per_token(part) * BLOCK_TOKENS
        return f"{gib_} GiB is {gib_ * mp.GIB // block * BLOCK_TOKENS:,} tokens"

    two = comments("qwen3-omni-2gpu.yaml")
    new2, old2 = plan_of(config("qwen3-omni-2gpu.yaml"), "h100-80"), plan_of(old_2gpu(), "h100-80")
    unset = {"params": {"kv_cache_gib": None}}
    free2 = plan_of(config("qwen3-omni-2gpu.yaml", thinker=unset), "h100-80")
    cuda0 = next(d for d in new2 if d.device == "cuda:0")
    for enc in ("image_encoder", "audio_encoder"):
        expected = f"{gib(stage(new2, enc).step)} GiB a step ({gib(stage(old2, enc).step)} at 32)"
        assert expected in two, expected
    for expected in [
        f"({per_token('thinker') // 1024} KiB a token at these sizes): {pool(6, 'thinker')}",
        f"beside {gib(sum(s.weights for s in cuda0.stages))} GiB of weights",
        f"the plan gives it {gib(stage(free2, 'thinker').kv)} GiB on an H100",
    ]:
        assert expected in two, expected

    one = comments("qwen3-omni-1gpu.yaml")
    new1 = plan_of(config("qwen3-omni-1gpu.yaml"), "h200-141")
    free1 = plan_of(config("qwen3-omni-1gpu.yaml", thinker=unset, talker_ar=unset), "h200-141")
    for expected in [
        f"{gib(sum(s.weights for d in new1 for s in d.stages))} GiB of weights",
        pool(44, "thinker"),
        f"{per_token('talker') // 1024} KiB a token: {pool(9, 'talker')}",
        f"{gib(stage(free1, 'thinker').kv)} GiB for the thinker and "
        f"{gib(stage(free1, 'talker_ar').kv)} for the talker",
    ]:
        assert expected in one, expected
    for enc in ("image_encoder", "audio_encoder"):
        expected = f"{gib(stage(new1, enc).step)} GiB a step ({gib(stage(old2, enc).step)} at 32)"
        assert expected in one, expected


def comments(name: str) -> str:
    """The config's text, a comment running on over its lines as one."""
    return re.sub(r"\n\s*#\s*", " ", (CONFIGS / name).read_text())


def test_peak_bytes_counts_what_ops_make_while_it_lives() -> None:
    """A tensor made, a view of it (nothing more), one freed before the next: the peak is the
    two that lived together; what existed before counts nothing."""
    before = torch.empty(10_000, device="meta")

    def run() -> None:
        a = torch.empty(1000, device="meta")  # 4,000 B
        view = a.view(10, 100)
        b = a * 2  # 4,000 B while a lives
        del b, view
        before.add_(1)  # in place on a storage made before
        c = torch.empty(500, device="meta")  # 2,000 B beside a
        del a, c

    assert measure(run) == 8000


def test_a_checkpoint_here_gives_the_weights_from_its_headers(tmp_path: Path) -> None:
    """With `model.path` a checkpoint on this machine (the tiny model's, float32), each stage's
    weights are its part's tensors as `load_part` holds them, read from the shard headers, and
    the steps are measured at its own config's sizes."""
    from realtime_omni.models.qwen3_omni.tiny import ensure_tiny
    from realtime_omni.models.qwen3_omni.weights import load_part

    d = ensure_tiny(0)
    data = config("qwen3-omni-1gpu.yaml")
    data["model"] = {"path": str(d), "dtype": "float32"}
    (dev,) = mp.plan(parse_config(data), 2 * mp.GIB)
    assert dev.source == f"the checkpoint at {d}"
    for s in dev.stages:
        assert s.part is not None
        module = load_part(d, s.part, "cpu", torch.float32)
        held = sum(p.numel() * p.element_size() for p in module.parameters())
        extra = s.weights - held  # the talker's code predictor copies its fused weights
        assert extra == 0 if s.part != "talker" else 0 < extra < held, s.stage
        assert s.step > 0
