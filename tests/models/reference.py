"""The serial oracle: greedy `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)`
on the tiny model, and the request payloads that describe the same prompts to the pipeline."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

SYSTEM = {"role": "system", "content": "You are a helpful voice assistant."}


def chirp(seconds: float = 1.0, sr: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (0.5 * np.sin(2 * np.pi * (200 * t + 400 * t * t))).astype(np.float32)


def test_image(h: int = 64, w: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 4) % 256, (y * 4) % 256, ((x + y) * 2) % 256], axis=-1)
    return img.astype(np.uint8)


def conversation(kind: str) -> dict[str, Any]:
    """A request payload: system prompt plus one user turn with `kind` in text, audio, image,
    audio_image."""
    parts: list[dict[str, Any]] = []
    payload: dict[str, Any] = {}
    if "audio" in kind:
        parts.append({"type": "audio", "audio": "audio0"})
        payload["audio0"] = chirp()
    if "image" in kind:
        parts.append({"type": "image", "image": "image0"})
        payload["image0"] = test_image()
    text = {
        "text": "Hello, how is the weather today?",
        "audio": None,
        "image": "What do you see in this image?",
        "audio_image": "Describe the audio and the image.",
    }[kind]
    if text:
        parts.append({"type": "text", "text": text})
    payload["messages"] = [SYSTEM, {"role": "user", "content": parts}]
    return payload


@cache
def load_full(d: Path) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from realtime_omni.models.qwen3_omni.processor import load_processor
    from realtime_omni.models.qwen3_omni.tiny import patch_config

    torch.set_num_threads(1)  # as the stage processes: the same kernels, the same bits
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(d).eval()
    patch_config(model.config)
    return model, load_processor(d)


def generate(
    d: Path, payload: dict[str, Any], max_tokens: int, max_frames: int, eos: int | None = None
) -> dict:
    """Greedy serial generate: text ids, codes [n, 16] and the waveform; the thinker stops at
    `eos` (default `<|im_end|>`)."""
    import torch

    model, proc = load_full(d)
    msgs = payload["messages"]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    audios = [payload[p["audio"]] for m in msgs if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "audio"]  # fmt: skip
    images = [payload[p["image"]] for m in msgs if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "image"]  # fmt: skip
    kw: dict[str, Any] = {}
    if audios:
        kw["audio"] = audios
    if images:
        kw["images"] = images
    inputs = proc(text=text, return_tensors="pt", **kw)
    captured = {}
    orig = model.code2wav.chunked_decode

    def spy(codes: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        captured["codes"] = codes.clone()
        return orig(codes, *a, **k)

    model.code2wav.chunked_decode = spy
    try:
        seqs, wav = model.generate(
            **inputs,
            speaker="Ethan",
            return_audio=True,
            thinker_max_new_tokens=max_tokens,
            thinker_eos_token_id=model.config.im_end_token_id if eos is None else eos,
            thinker_do_sample=False,
            talker_max_new_tokens=max_frames,
            talker_do_sample=False,
        )
    finally:
        del model.code2wav.chunked_decode
    n = inputs["input_ids"].shape[1]
    codes = captured["codes"][0].T.numpy()  # [frames, 16]
    return {
        "text_ids": seqs[0, n:].tolist(),
        "codes": codes,
        "wav": wav.reshape(-1).numpy(),
    }
