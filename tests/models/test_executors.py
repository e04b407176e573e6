"""Executor-level tests in this process: abort frees a request's KV cache, a wrong
`model.path` is a clear ConfigError."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.executor import StageContext


def ctx(stage: str, model: dict, **params: object) -> StageContext:
    return StageContext(stage=stage, device="cpu", params=dict(params), model=model,
                        downstream=["decode", "talker_ar"])  # fmt: skip


def test_abort_mid_stream_frees_the_kv_cache(tiny_dir: Path) -> None:
    """After abort the request's cache and its key/value tensors are gone (no reference left
    anywhere), and the other request in flight is untouched."""
    import torch

    from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor

    ex = ThinkerExecutor(ctx("thinker", {"path": str(tiny_dir)}))
    tok = ex_tokenizer(tiny_dir)
    prompt = tok("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    keep = ex.reqs  # the per-request state dict
    ex.add_request("a", {"preprocessing": {"input_ids": np.array(prompt), "max_tokens": 50}})
    ex.add_request("b", {"preprocessing": {"input_ids": np.array(prompt), "max_tokens": 50}})
    for _ in range(6):
        ex.step()
    cache_a = weakref.ref(ex.reqs["a"].cache)
    layer = ex.reqs["a"].cache.layers[0].keys
    assert isinstance(layer, torch.Tensor) and layer.shape[-2] >= len(prompt)
    keys_a = weakref.ref(layer)
    del layer
    ex.abort("a")
    gc.collect()
    assert "a" not in keep and cache_a() is None and keys_a() is None
    assert "b" in keep  # the other request goes on
    ex.abort("b")
    assert not ex.reqs


def ex_tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("bad", ["missing", "empty"])
def test_wrong_model_path_is_a_clear_config_error(tmp_path: Path, bad: str) -> None:
    from realtime_omni.models.qwen3_omni.code2wav import Code2WavExecutor

    path = tmp_path / "nope" if bad == "missing" else tmp_path
    with pytest.raises(
        ConfigError, match=r"model\.path = .*(no such directory|not a Qwen3-Omni).*Fix"
    ):
        Code2WavExecutor(ctx("code2wav", {"path": str(path)}))
