"""The thinker stage: prefill, then one token per step, per-request KV cache and sampling.

Inputs (once, from `wait_for`): `input_ids` [L] int64 with `image_grid_thw` [n, 3] and
`audio_lengths` [n] when the prompt has images or audio, plus the request's sampling fields
(`temperature`, `top_p`, `top_k`, `seed`, `max_tokens`); `audio_embeds` [Na, D] from the audio
encoder; `image_embeds` [Ni, D] and `deepstack` [K, Ni, D] from the image encoder.

Outputs per generated token k: to the text stage (`params.text_to`, default `decode`)
`{token_id, index, token_time, last}`; to the speech stage (`params.speech_to`, default
`talker_ar`) the same plus `embed` [D] (the token's thinker input embedding, what the talker's
text side projects), and with token 0 `prompt_rows` [U + 3, D]: for every user-turn position the
`accept_hidden_layer` output at audio/image/video positions and the input embedding elsewhere,
then the input embeddings of the final `<|im_start|>assistant\\n`. The request ends after a stop
token (`params.stop_token_ids`, default `<|im_end|>`) or `max_tokens` tokens, whichever is
first; the last token carries `last: true` and is followed by `done`.

Every per-request state (cache, positions, sampler) lives in `_Request`; the module's own
`rope_deltas` is never read or written (positions are passed explicitly).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    BaseModelOutputWithDeepstackFeatures,
)

from realtime_omni.models.qwen3_omni.prompt import assistant_start, mrope_positions, user_positions
from realtime_omni.models.qwen3_omni.sampling import Sampler
from realtime_omni.models.qwen3_omni.tensors import model_dtype, nonempty, setup_torch, to_torch
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir
from realtime_omni.pipeline.executor import Emit, ExecutorError, HoldsRequests, StageContext

Payload = dict[str, Any]


@dataclass
class _Request:
    ids: torch.Tensor  # [L]
    grid: torch.Tensor | None
    audio_lengths: torch.Tensor | None
    audio_embeds: torch.Tensor | None
    image_embeds: torch.Tensor | None
    deepstack: torch.Tensor | None
    sampler: Sampler
    max_tokens: int
    cache: DynamicCache | None = None
    next_pos: torch.Tensor | None = None  # [4, 1, 1]: position of the next input token
    tokens: list[int] = field(default_factory=list)


class ThinkerExecutor(HoldsRequests):
    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        self.cfg = load_config(d)
        self.model = load_part(
            d, "thinker", ctx.device, model_dtype(ctx.model, ctx.device), self.cfg
        )
        self.embed = self.model.get_input_embeddings()
        p = ctx.params
        self.text_to = p.get("text_to", "decode")
        self.speech_to = p.get("speech_to", "talker_ar")
        self.speech = self.speech_to in ctx.downstream
        self.stop_ids = set(p.get("stop_token_ids") or [self.cfg.im_end_token_id])
        self.default_max_tokens = int(p.get("max_tokens", 256))
        self.accept_layer = self.cfg.talker_config.accept_hidden_layer
        tc = self.cfg.thinker_config
        self.mm_ids = torch.tensor([tc.audio_token_id, tc.image_token_id, tc.video_token_id])
        self.reqs: dict[str, _Request] = {}

    # ---- executor contract ---------------------------------------------------------------

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        merged: Payload = {}
        for payload in inputs.values():
            merged.update(payload)
        if "input_ids" not in merged:
            raise ExecutorError(request_id, "thinker: no input_ids among the inputs")

        def tensor(name: str) -> torch.Tensor | None:
            a = merged.get(name)
            return to_torch(a, self.device) if nonempty(a) else None

        try:
            sampler = Sampler.from_meta(merged)
        except ValueError as e:
            raise ExecutorError(request_id, f"thinker: {e}") from None
        self.reqs[request_id] = _Request(
            ids=to_torch(merged["input_ids"], self.device).long(),
            grid=tensor("image_grid_thw"),
            audio_lengths=tensor("audio_lengths"),
            audio_embeds=tensor("audio_embeds"),
            image_embeds=tensor("image_embeds"),
            deepstack=tensor("deepstack"),
            sampler=sampler,
            max_tokens=int(merged.get("max_tokens", self.default_max_tokens)),
        )

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        raise ExecutorError(request_id, f"thinker: takes no streamed input (got one from {src})")

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.running())

    def step(self) -> list[Emit]:
        """Prefill one new request, or else decode one token of every running request."""
        running = self.running()
        fresh = next((rid for rid, r in running.items() if r.cache is None), None)
        if fresh is not None:
            return self._prefill(fresh)
        emits: list[Emit] = []
        for rid in list(running):
            emits += self._decode(rid)
        return emits

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    # ---- model calls ---------------------------------------------------------------------

    def _prefill(self, rid: str) -> list[Emit]:
        r = self.reqs[rid]
        ids = r.ids.view(1, -1)
        embeds = self.embed(ids)
        if r.audio_embeds is not None:  # as the thinker's forward merges its own audio features
            mask = (ids == self.cfg.thinker_config.audio_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, r.audio_embeds.to(embeds.dtype))
        mm = None
        if r.image_embeds is not None:
            feats = [(f,) for f in r.deepstack] if r.deepstack is not None else []
            mm = {
                "image": BaseModelOutputWithDeepstackFeatures(
                    pooler_output=(r.image_embeds,), deepstack_features=feats
                )
            }
        pos = mrope_positions(self.model, r.ids, r.grid, r.audio_lengths, always=True)
        r.cache = DynamicCache(config=self.model.config.text_config)
        out = self.model(
            input_ids=ids,
            inputs_embeds=embeds,
            mm_encoder_outputs=mm,
            attention_mask=None,  # generate drops an all-ones mask: keep the same kernels
            position_ids=pos,
            cache=r.cache,
            use_cache=True,
            output_hidden_states=self.speech,
        )
        r.next_pos = pos[..., -1:] + 1
        rows = None
        if self.speech:
            hs = out.hidden_states
            rows = self._prompt_rows(r.ids, hs[0][0], hs[self.accept_layer][0])
        return self._take(rid, out.logits[0, -1], rows)

    def _decode(self, rid: str) -> list[Emit]:
        r = self.reqs[rid]
        tok = torch.tensor([[r.tokens[-1]]], device=self.device)
        out = self.model(input_ids=tok, position_ids=r.next_pos, cache=r.cache, use_cache=True)
        r.next_pos = r.next_pos + 1
        return self._take(rid, out.logits[0, -1], None)

    def _prompt_rows(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> Any:
        users = user_positions(ids.cpu(), self.cfg).to(ids.device)
        a = assistant_start(ids.cpu(), self.cfg)
        mm = torch.isin(ids, self.mm_ids.to(ids.device)).unsqueeze(-1)
        rows = torch.where(mm, hidden, embeds)[users]
        return torch.cat([rows, embeds[a : a + 3]])

    def _take(self, rid: str, logits: torch.Tensor, prompt_rows: Any) -> list[Emit]:
        r = self.reqs[rid]
        tok = r.sampler.pick(logits.float())
        r.tokens.append(tok)
        last = tok in self.stop_ids or len(r.tokens) >= r.max_tokens
        meta = {"token_id": tok, "index": len(r.tokens) - 1, "token_time": time.monotonic()}
        meta["last"] = last
        emits = [Emit(rid, dict(meta), to=self.text_to)]
        if self.speech:
            speech: Payload = {**meta, "embed": self.embed.weight[tok]}  # weights: never written
            if prompt_rows is not None:
                speech["prompt_rows"] = prompt_rows
            emits.append(Emit(rid, speech, to=self.speech_to))
        if last:
            del self.reqs[rid]
            emits.append(Emit(rid, done=True))
        return emits
