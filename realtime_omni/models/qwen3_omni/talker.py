"""The talker stage: the talker prompt as `generate` builds it, then one 16-code frame per step.

Inputs once (from preprocessing): `input_ids` [L], `image_grid_thw`, `audio_lengths`, and the
request's `speaker` and talker sampling fields (`talker_temperature`, `talker_top_p`,
`talker_top_k`, `talker_seed`, `talker_repetition_penalty`, `talker_max_tokens`). Items (from the
thinker, see thinker.py): token k with `embed`, `last`, `token_time`, and `prompt_rows` on token 0.

Step k (80 ms of speech) needs thinker token k, or the thinker's end:
- k = 0, prefill: the user turns (audio/image positions through `hidden_projection`, text through
  `text_projection`) then a 9-position assistant head that includes token 0's text;
- k >= 1: the sum of frame k-1's 16 code embeddings plus one text entry: token k's projected
  embedding while token k is not the last, `tts_eos` for the last, `tts_pad` after it.
A talker forward gives code 0 (repetition penalty over earlier code 0s, the 1,024 special ids
suppressed except codec EOS); the code predictor's 15 forwards give codes 1..15. Code 0 = EOS or
the `talker_max_tokens`-th step ends the request without a frame, as `generate` does.

Outputs: `{codes [16] int64, index, token_time}` per frame, `token_time` being that of the
thinker token whose text step made the frame (the last token's for frames after the text).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from realtime_omni.models.qwen3_omni.prompt import mrope_positions, user_positions
from realtime_omni.models.qwen3_omni.sampling import Sampler
from realtime_omni.models.qwen3_omni.tensors import (
    model_dtype,
    nonempty,
    setup_torch,
    to_numpy,
    to_torch,
)
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir, read_rows
from realtime_omni.pipeline.executor import Emit, ExecutorError, HoldsRequests, StageContext

Payload = dict[str, Any]


@dataclass
class _Token:
    embed: torch.Tensor  # [D] thinker input embedding
    last: bool
    token_time: float


@dataclass
class _Request:
    ids: torch.Tensor
    grid: torch.Tensor | None
    audio_lengths: torch.Tensor | None
    speaker_id: int
    sampler: Sampler
    residual_sampler: Sampler
    repetition_penalty: float
    max_steps: int
    prompt_rows: torch.Tensor | None = None
    tokens: deque[_Token] = field(default_factory=deque)  # received, not yet spoken
    spoken: int = 0  # thinker tokens consumed (= talker steps taken)
    thinker_done: bool = False
    last_time: float = 0.0
    cache: DynamicCache | None = None
    next_pos: torch.Tensor | None = None
    code0s: list[int] = field(default_factory=list)
    frame: torch.Tensor | None = None  # the previous frame's 16 codes
    past_hidden: torch.Tensor | None = None


class TalkerExecutor(HoldsRequests):
    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        self.cfg = load_config(d)
        dtype = model_dtype(ctx.model, ctx.device)
        self.model = load_part(d, "talker", ctx.device, dtype, self.cfg)
        self.tc = self.cfg.talker_config
        ids = [self.cfg.tts_bos_token_id, self.cfg.tts_eos_token_id, self.cfg.tts_pad_token_id]
        rows = read_rows(d, "thinker.model.embed_tokens.weight", ids, ctx.device, dtype)
        # One [1, 3] batch through text_projection, exactly as generate computes them.
        self.tts_bos, self.tts_eos, self.tts_pad = self.model.text_projection(rows[None]).chunk(
            3, 1
        )
        vocab = self.tc.text_config.vocab_size
        self.suppress = torch.tensor(
            [i for i in range(vocab - 1024, vocab) if i != self.tc.codec_eos_token_id],
            device=self.device,
        )
        p = ctx.params
        self.default_speaker = str(p.get("speaker", "ethan"))
        self.default_max_steps = int(p.get("max_frames", 4096))
        self.default_sampling = {
            "temperature": float(p.get("temperature", 0.9)),
            "top_k": int(p.get("top_k", 50)),
            "top_p": float(p.get("top_p", 1.0)),
        }
        self.default_penalty = float(p.get("repetition_penalty", 1.05))
        tcfg = self.cfg.thinker_config
        self.mm_ids = torch.tensor([tcfg.audio_token_id, tcfg.image_token_id, tcfg.video_token_id])
        self.reqs: dict[str, _Request] = {}

    # ---- executor contract ---------------------------------------------------------------

    def add_request(self, request_id: str, inputs: dict[str, Payload]) -> None:
        merged: Payload = {}
        for payload in inputs.values():
            merged.update(payload)
        speaker = str(merged.get("speaker", self.default_speaker)).lower()
        if speaker not in self.tc.speaker_id:
            raise ExecutorError(
                request_id, f"speaker {speaker!r} unknown; one of {sorted(self.tc.speaker_id)}"
            )

        def tensor(name: str) -> torch.Tensor | None:
            a = merged.get(name)
            return to_torch(a, self.device) if nonempty(a) else None

        try:
            sampler = Sampler.from_meta(merged, "talker_", **self.default_sampling)
            residual = Sampler(
                temperature=1.0 if sampler.temperature else 0.0,
                top_k=50,
                top_p=0.8,  # generate's code predictor settings when sampling
                seed=None if sampler.seed is None else int(sampler.seed) + 1,
            )
        except ValueError as e:
            raise ExecutorError(request_id, f"talker: {e}") from None
        self.reqs[request_id] = _Request(
            ids=to_torch(merged["input_ids"], self.device).long(),
            grid=tensor("image_grid_thw"),
            audio_lengths=tensor("audio_lengths"),
            speaker_id=int(self.tc.speaker_id[speaker]),
            sampler=sampler,
            residual_sampler=residual,
            repetition_penalty=float(merged.get("talker_repetition_penalty", self.default_penalty)),
            max_steps=int(merged.get("talker_max_tokens", self.default_max_steps)),
        )

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        r = self.reqs[request_id]
        if "prompt_rows" in item:
            r.prompt_rows = to_torch(item["prompt_rows"], self.device)
        r.tokens.append(
            _Token(to_torch(item["embed"], self.device), bool(item["last"]), item["token_time"])
        )
        r.last_time = float(item["token_time"])
        r.thinker_done = r.thinker_done or bool(item["last"])

    def end_stream(self, request_id: str, src: str) -> None:
        self.reqs[request_id].thinker_done = True

    def has_work(self) -> bool:
        return any(self._ready(r) for r in self.running().values())

    def step(self) -> list[Emit]:
        """One frame for every request whose next text step is available."""
        emits: list[Emit] = []
        for rid in [rid for rid, r in self.running().items() if self._ready(r)]:
            emits += self._frame(rid)
        return emits

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    # ---- model calls ---------------------------------------------------------------------

    @staticmethod
    def _ready(r: _Request) -> bool:
        if r.cache is None:
            return bool(r.tokens) and r.prompt_rows is not None
        return bool(r.tokens) or r.thinker_done

    def _frame(self, rid: str) -> list[Emit]:
        r = self.reqs[rid]
        if not r.tokens and r.spoken == 0:  # the thinker ended before its first token
            del self.reqs[rid]
            return [Emit(rid, done=True)]
        tok = r.tokens.popleft() if r.tokens else None
        token_time = tok.token_time if tok else r.last_time
        if r.cache is None:
            assert tok is not None
            out = self._talker(r, *self._prefill_inputs(r, tok))
        else:
            out = self._talker(r, self._step_input(r, tok), r.next_pos)
        r.spoken += 1
        code0 = self._pick_code0(r, out.logits[0, -1])
        if code0 == self.tc.codec_eos_token_id or len(r.code0s) >= r.max_steps:
            del self.reqs[rid]  # this code 0 gets no residual codes: no frame (as generate)
            return [Emit(rid, done=True)]
        r.past_hidden = out.hidden_states[0][-1][:, -1:]
        r.frame = self._residuals(r, code0)
        data = {"codes": to_numpy(r.frame), "index": len(r.code0s) - 1, "token_time": token_time}
        return [Emit(rid, data)]

    def _prefill_inputs(self, r: _Request, tok: _Token) -> tuple[torch.Tensor, torch.Tensor]:
        m, cfg, tc = self.model, self.cfg, self.tc
        assert r.prompt_rows is not None
        users = user_positions(r.ids.cpu(), cfg).to(self.device)
        user_ids = r.ids[users]
        rows, head = r.prompt_rows[:-3], r.prompt_rows[-3:]
        mm = torch.isin(user_ids, self.mm_ids.to(self.device))
        user = torch.empty(len(users), tc.text_config.hidden_size, dtype=rows.dtype)
        user = user.to(self.device)
        if mm.any():
            user[mm] = m.hidden_projection(rows[mm])
        user[~mm] = m.text_projection(rows[~mm])
        head_text = m.text_projection(torch.cat([head, tok.embed[None]])[None])
        text = torch.cat([head_text[:, :3], self.tts_pad.expand(1, 4, -1), self.tts_bos], 1)
        text = torch.cat([text, head_text[:, 3:4]], 1)
        codec_ids = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
        codec_ids += [r.speaker_id, tc.codec_pad_id, tc.codec_bos_id]
        codec = m.get_input_embeddings()(torch.tensor([codec_ids], device=self.device))
        zeros = torch.zeros(1, 3, tc.text_config.hidden_size, dtype=codec.dtype)
        codec = torch.cat([zeros.to(self.device), codec], 1)
        embeds = torch.cat([user[None], text + codec], 1)
        pad = torch.full((9,), cfg.tts_pad_token_id, device=self.device)
        talker_ids = torch.cat([user_ids, pad])
        pos = mrope_positions(m, talker_ids, r.grid, r.audio_lengths)
        r.cache = DynamicCache(config=tc.text_config)
        return embeds, pos

    def _step_input(self, r: _Request, tok: _Token | None) -> torch.Tensor:
        m = self.model
        assert r.frame is not None
        f = r.frame.view(16, 1, 1).to(self.device)
        cp_embed = m.code_predictor.get_input_embeddings()
        parts = [m.get_input_embeddings()(f[0])] + [cp_embed[j - 1](f[j]) for j in range(1, 16)]
        x = torch.cat(parts, dim=1).sum(1, keepdim=True)  # cat-then-sum, as generate
        if tok is None:
            return x + self.tts_pad
        if tok.last:
            return x + self.tts_eos
        return x + m.text_projection(tok.embed.view(1, 1, -1))

    def _talker(self, r: _Request, x: torch.Tensor, pos: torch.Tensor) -> Any:
        step = None if r.next_pos is None else len(r.code0s) - 1  # needed, otherwise unused
        out = self.model(
            inputs_embeds=x,
            position_ids=pos,
            cache=r.cache,
            use_cache=True,
            output_hidden_states=True,
            generation_step=step,
        )
        r.next_pos = pos[..., -1:] + 1
        return out

    def _pick_code0(self, r: _Request, logits: torch.Tensor) -> int:
        x = logits.float().clone()
        if r.code0s and r.repetition_penalty != 1.0:
            seen = torch.tensor(r.code0s, device=x.device)
            score = x[seen]
            x[seen] = torch.where(
                score < 0, score * r.repetition_penalty, score / r.repetition_penalty
            )
        x[self.suppress] = float("-inf")
        code0 = r.sampler.pick(x)
        r.code0s.append(code0)
        return code0

    def _residuals(self, r: _Request, code0: int) -> torch.Tensor:
        """Codes 1..15: the code predictor's 15 forwards with a fresh cache per frame."""
        m = self.model
        cp = m.code_predictor
        cache = DynamicCache(config=cp.config)
        first = m.get_input_embeddings()(torch.tensor([[code0]], device=self.device))
        x = torch.cat([r.past_hidden, first], dim=1)
        pos = torch.arange(2, device=self.device).view(1, 2)
        out = cp(inputs_embeds=x, position_ids=pos, cache=cache, use_cache=True)
        codes = [code0, r.residual_sampler.pick(out.logits[0, -1].float())]
        for j in range(1, 15):
            out = cp(
                input_ids=torch.tensor([[codes[-1]]], device=self.device),
                generation_steps=j,
                position_ids=torch.tensor([[1 + j]], device=self.device),
                cache=cache,
                use_cache=True,
            )
            codes.append(r.residual_sampler.pick(out.logits[0, -1].float()))
        return torch.tensor(codes)
