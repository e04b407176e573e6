"""Pure functions over prompt token ids that the thinker and the talker must agree on."""

from __future__ import annotations

from typing import Any

import torch


def user_positions(ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    """Positions of the user turns in `ids` [L]: every position whose most recent
    `<|im_start|>` is followed by the `user` token (system and assistant turns are dropped), as
    `generate` selects the talker's prompt."""
    n = ids.shape[0]
    pos = torch.arange(n)
    starts = torch.where(ids == cfg.im_start_token_id, pos, torch.full_like(pos, -1))
    prev = torch.cummax(starts, dim=0).values.clamp_min(0)
    role = ids[(prev + 1).clamp_max(n - 1)]
    return torch.nonzero(role == cfg.user_token_id).flatten()


def assistant_start(ids: torch.Tensor, cfg: Any) -> int:
    """Index of the last `<|im_start|>assistant` pair; the prompt must end with that turn's
    head `<|im_start|> assistant \\n`."""
    hit = (ids[:-1] == cfg.im_start_token_id) & (ids[1:] == cfg.assistant_token_id)
    where = torch.nonzero(hit).flatten()
    if where.numel() == 0 or int(where[-1]) != ids.shape[0] - 3:
        raise ValueError("the prompt must end with '<|im_start|>assistant\\n'")
    return int(where[-1])


def mrope_positions(
    model: Any,
    ids: torch.Tensor,
    grid: torch.Tensor | None,
    audio_lengths: torch.Tensor | None,
    always: bool = False,
) -> torch.Tensor:
    """Position ids [4, 1, L] as generate prepares them: row 0 the text positions (used for the
    mask), rows 1-3 the 3-D rope positions from `model.get_rope_index` (a pure function). The
    talker skips it for text-only prompts (`always=False`), the thinker never does."""
    batch = ids.view(1, -1)
    n = batch.shape[1]
    text = torch.arange(n, device=ids.device).view(1, 1, n)
    if grid is None and audio_lengths is None and not always:
        return torch.cat([text, text.expand(3, 1, n)], dim=0)
    rope, _ = model.get_rope_index(
        batch, grid, None, torch.ones_like(batch), False, audio_lengths, None
    )
    return torch.cat([text, rope.to(text.device)], dim=0)
