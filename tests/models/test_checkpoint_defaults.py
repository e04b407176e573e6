"""A checkpoint's generation_config and chat_template.json are what the stages use."""

from __future__ import annotations

import json
from pathlib import Path

from realtime_omni.pipeline.executor import StageContext


def checkpoint(tiny_dir: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint with its own generation_config.json and a chat_template.json only."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in tiny_dir.iterdir():
        if f.name not in ("generation_config.json", "chat_template.jinja"):
            (d / f.name).symlink_to(f)
    gen = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
           "eos_token_id": [1902, 7], "talker_temperature": 0.5}  # fmt: skip
    (d / "generation_config.json").write_text(json.dumps(gen))
    template = (tiny_dir / "chat_template.jinja").read_text()
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "{#- ours -#}" + template}))
    return d


def ctx(stage: str, d: Path) -> StageContext:
    return StageContext(stage, "cpu", {}, {"path": str(d)}, ["decode", "talker_ar"])


def test_sampling_defaults_and_stop_tokens_come_from_generation_config(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from realtime_omni.models.qwen3_omni.talker import TalkerExecutor
    from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor

    d = checkpoint(tiny_dir, tmp_path)
    thinker = ThinkerExecutor(ctx("thinker", d))
    assert thinker.default_sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert thinker.stop_ids == {1902, 7}
    assert TalkerExecutor(ctx("talker_ar", d)).default_sampling["temperature"] == 0.5
    plain = ThinkerExecutor(ctx("thinker", tiny_dir))  # says nothing of sampling: greedy
    assert plain.default_sampling["temperature"] == 0 and plain.stop_ids == {1902}


def test_the_chat_template_of_chat_template_json_is_used(tiny_dir: Path, tmp_path: Path) -> None:
    from realtime_omni.models.qwen3_omni.processor import load_processor

    proc = load_processor(checkpoint(tiny_dir, tmp_path))
    assert proc.chat_template.startswith("{#- ours -#}")
