"""What simulated stages read of a conversation payload, so they charge what real stages compute:
the user turn's audio as the audio encoder's windows, and the prompt as blocks of tokens.

No model and no tokenizer. The turn's audio (the last user message's audio parts) is counted as
Qwen3-Omni counts it: 100 mel frames a second, 13 tokens per 100 frames, windows of
`window_frames` (800 frames, 8 s: the tower's attention windows, `models/qwen3_omni/encoders.py`),
each named by a digest of its samples. The rest of the prompt is the config's fixed request: the
conversation before the turn's audio (`context` tokens), then an image (`image` tokens; the
camera frame joins the last user message after its audio), as the simulated config describes it.

A real thinker reuses a session's kept row up to the first input that differs
(`models/qwen3_omni/cache.py`, `KeptSessions.take`); `shared_tokens` applies that rule to blocks.
The context block stands for the earlier turns, which a kept row holds in the real stage, so
any request of a session with a kept prefix shares it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

HOP_SAMPLES = 160  # 16 kHz samples per mel frame
CHUNK_FRAMES = 100  # the tower's convolution chunk (2 x n_window)
TOKENS_PER_CHUNK = 13
Block = tuple[str, int]  # (a digest or a name, tokens)


def audio_tokens(frames: int) -> int:
    """Tokens the audio tower makes of `frames` mel frames (transformers'
    `_get_feat_extract_output_lengths`)."""
    rest = frames % CHUNK_FRAMES
    tail = (((rest - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1 if rest else 0
    return tail + frames // CHUNK_FRAMES * TOKENS_PER_CHUNK


def turn_windows(payload: dict[str, Any], window_frames: int) -> list[Block] | None:
    """The audio of the payload's last user message, window by window; None for a payload
    without `messages` (a synthetic request: the stages charge their fixed figures)."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return None
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else None
    windows: list[Block] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict) or part.get("type") != "audio":
            continue
        if (audio := payload.get(part.get("audio", ""))) is None:
            continue  # a part without its array: the real preprocessing refuses it
        samples = np.asarray(audio)
        frames = len(samples) // HOP_SAMPLES
        for a in range(0, frames, window_frames):
            n = min(window_frames, frames - a)
            piece = samples[a * HOP_SAMPLES : (a + n) * HOP_SAMPLES]
            windows.append((hashlib.blake2b(piece.tobytes(), digest_size=8).hexdigest(), n))
    return [(digest, audio_tokens(n)) for digest, n in windows]


def has_image(payload: dict[str, Any]) -> bool:
    """The conversation carries an image (a camera frame, or an image item) that is not left out:
    a prefill-only request leaves out what follows its turn's audio, as the real preprocessing."""
    for m in payload.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(c, dict) and c.get("type") == "image" for c in content
        ):
            return not payload.get("prefill_only") or m is not payload["messages"][-1]
    return False


def prompt_blocks(windows: list[Block], context: int, image: int) -> list[Block]:
    """The prompt: the conversation before the turn's audio, the audio, an image (0: none)."""
    blocks: list[Block] = [("context", context), *windows]
    return [*blocks, ("image", image)] if image else blocks


def shared_tokens(kept: list[Block], blocks: list[Block]) -> int:
    """Tokens at the start of `blocks` that `kept` (what a session's row holds) computed
    already: whole blocks while they are the same, and a block `kept` holds only the start of.
    At least one token is left to compute, as the real thinker leaves one for the logits."""
    shared = 0
    for (a, n), (b, m) in zip(kept, blocks, strict=False):
        if a != b:
            break
        shared += min(n, m)
        if n != m:
            break
    return min(shared, sum(m for _, m in blocks) - 1)


def truncated(blocks: list[Block], tokens: int) -> list[Block]:
    """The first `tokens` tokens of `blocks` (the last one cut short)."""
    out: list[Block] = []
    for name, n in blocks:
        if tokens <= 0:
            break
        out.append((name, min(n, tokens)))
        tokens -= n
    return out
