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

Batching: a step makes a frame for every ready request together (up to the stage's
`max_batch`): new requests' prompts are prefilled one by one into their `BlockCache` rows, then
one talker forward serves every other ready row, and the code predictor's 15 steps run once for
the whole batch (its inner loop has the same length for everyone, so a fixed-shape cache of
the batch's width fits: `code_predictor.py`). Sampling stays per request with its own
generators; the codes of the batch are read back to the host once per step, not once per code.

Conversations (`session_id`): a session's turn leaves its cache row and its prompt's input
rows behind when it ends, as in the thinker. The talker's prompt is the conversation's user
turns and an assistant head (its earlier speech is not in it), so the next turn continues the
row after the longest common prefix of the two prompts' input rows, the earlier user turns, and
prefills the rest; bounded by `params.session_cache_tokens` (default 65,536), by the rows and
by the KV pool's blocks (`params.kv_cache_tokens` or `kv_cache_gib`, as the thinker's).

Under pressure, as in the thinker (thinker.py): a request's prompt is prefilled only once it and
`params.admit_margin_tokens` (default 128) fit, in arrival order; one that could never fit fails
at once, evicting nothing. It waits with no deadline unless `admit_timeout_s` is set: a talker
request comes with its answer's first token, so its answer already runs (its text reaches the
caller), and the running answers holding the blocks always finish (under pressure the newest
gives its blocks back): failing it at a deadline would kill a running answer, which a busy
machine did at 20 s. When a frame
finds no block, the newest request holding blocks gives them back and is recomputed later: its
prompt and every frame's input so far (`_Request.inputs`) prefilled again, its repetition
penalty's codes kept, and it goes on from its last frame. A prefill that raises fails its
request alone (an `Emit` with `error`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from realtime_omni.errors import ExecutorError
from realtime_omni.models.qwen3_omni.cache import (
    BlockCache,
    KeptSessions,
    PreemptsNewest,
    admission,
    pool_blocks,
)
from realtime_omni.models.qwen3_omni.code_predictor import CodePredictorLoop
from realtime_omni.models.qwen3_omni.prompt import mrope_positions, user_positions
from realtime_omni.models.qwen3_omni.sampling import BatchPicker, Sampler, checkpoint_defaults
from realtime_omni.models.qwen3_omni.tensors import (
    each,
    model_dtype,
    nonempty,
    setup_torch,
    to_numpy,
    to_torch,
)
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir, read_rows
from realtime_omni.pipeline.executor import Emit, HoldsRequests, StageContext

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
    session: str | None = None
    row: int | None = None  # its BlockCache row, once its prompt is prefilled
    prompt: torch.Tensor | None = None  # [L, D] its prompt's input rows (for a session to keep)
    next_pos: torch.Tensor | None = None
    code0s: list[int] = field(default_factory=list)
    frame: torch.Tensor | None = None  # the previous frame's 16 codes
    # Every talker input so far, [1, k, D] each (the prompt, then a row per frame), from the
    # prompt's building on, with the prompt's positions: what a recompute prefills again.
    inputs: list[torch.Tensor] | None = None
    prompt_pos: torch.Tensor | None = None
    first_time: float = 0.0  # the token_time of the first frame (the prompt's token)
    seq: int = 0  # arrival order: admission and preemption go by it (the newest pays)
    arrived: float = 0.0  # when it came or was preempted (`clock`)
    resume_pos: torch.Tensor | None = None  # preempted: its next position
    seen: torch.Tensor | None = None  # preempted: its row of `TalkerExecutor.seen`


class TalkerExecutor(HoldsRequests, PreemptsNewest):
    def __init__(self, ctx: StageContext) -> None:
        self.device = setup_torch(ctx.device)
        d = model_dir(ctx.model)
        self.cfg = load_config(d)
        dtype = model_dtype(ctx.model, ctx.device)
        self.model = load_part(d, "talker", ctx.device, dtype, self.cfg)
        self.tc = self.cfg.talker_config
        self.code_predictor = CodePredictorLoop(self.model)
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
        # Defaults: the stage's params, else the checkpoint's generation_config, else generate's.
        ckpt = checkpoint_defaults(d)
        generate = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}

        def default(key: str) -> Any:
            return p.get(key, ckpt.get(f"talker_{key}", generate[key]))

        self.default_sampling = {
            "temperature": float(default("temperature")),
            "top_k": int(default("top_k")),
            "top_p": float(default("top_p")),
        }
        self.default_penalty = float(default("repetition_penalty"))
        tcfg = self.cfg.thinker_config
        self.mm_ids = torch.tensor([tcfg.audio_token_id, tcfg.image_token_id, tcfg.video_token_id])
        text = self.model.model.config
        blocks = pool_blocks(p, text, dtype, self.device, ctx.stage, pipeline=ctx.pipeline)
        self.cache = BlockCache.for_text_model(text, ctx.max_batch, blocks, dtype, self.device)
        self.max_batch = ctx.max_batch
        # Per cache row, the codes 0 its answer has made so far (the repetition penalty's).
        self.seen = torch.zeros(ctx.max_batch, vocab, dtype=torch.bool, device=self.device)
        self.prefill_budget = ctx.max_prefill_tokens_per_step
        self.sessions = KeptSessions(self.cache, int(p.get("session_cache_tokens", 65536)))
        self.admit_margin = int(p.get("admit_margin_tokens", 128))
        self.admit_timeout_s = float(p.get("admit_timeout_s", math.inf))  # see the docstring
        self.clock = time.monotonic
        self.reqs: dict[str, _Request] = {}
        self.arrivals = 0
        self.preemptions = 0  # requests that gave their blocks back for an older one's frame

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
            session=str(merged["session_id"]) if merged.get("session_id") else None,
            seq=self.arrivals,
            arrived=self.clock(),
        )
        self.arrivals += 1

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
        """Some request is ready and has a cache row, or the first waiting one can be admitted
        or refused (its prompt is built first when a row is free); one waiting for blocks
        makes no work (`wake_in` says when its wait runs out)."""
        ready = [r for r in self.running().values() if self._ready(r)]
        if any(r.row is not None or (r.inputs is None and not r.tokens) for r in ready):
            return True
        if not ready:
            return False
        head = min(ready, key=lambda r: r.seq)
        if head.inputs is None:
            return self.sessions.row_available()
        return self._admission(head) != "wait"

    def wake_in(self) -> float | None:
        """Seconds until the wait of the first request waiting for blocks runs out, else
        None."""
        waiting = [r for r in self.running().values() if r.row is None and r.inputs is not None]
        if not waiting:
            return None
        head = min(waiting, key=lambda r: r.seq)
        if self._admission(head) != "wait" or math.isinf(self.admit_timeout_s):
            return None
        return max(0.0, head.arrived + self.admit_timeout_s - self.clock())

    def step(self) -> list[Emit]:
        """One frame for every request whose next text step is available: new prompts (and
        preempted requests) prefilled in arrival order as they fit, then one talker forward for
        the others, oldest first to their blocks (the newest preempted when there are none)."""
        emits: list[Emit] = []
        running = self.running()
        ready = sorted((rid for rid, r in running.items() if self._ready(r)), key=self._seq)
        ready = ready[: self.max_batch]
        picked: list[tuple[str, torch.Tensor, float]] = []  # (rid, code 0 logits, token_time)
        hidden: list[torch.Tensor] = []  # the talker's last hidden state of each, [1, 1, D]
        budget = self.prefill_budget
        for rid in ready:
            r = self.reqs[rid]
            if r.row is not None:
                continue
            if r.inputs is None and not r.tokens:  # the thinker ended before its first token
                self.abort(rid)
                emits.append(Emit(rid, done=True))
                continue
            if budget <= 0 or not self.sessions.row_available():
                break  # first come, first served: later prompts wait their turn
            if r.inputs is None:
                tok = r.tokens.popleft()
                if tok.last:  # a one-token answer: its end-of-text row comes next, as always
                    r.tokens.appendleft(tok)
                embeds, r.prompt_pos = self._prefill_inputs(r, tok)
                r.inputs, r.first_time = [embeds], tok.token_time
            verdict = self._admission(r)
            if verdict == "wait":
                break
            if verdict != "admit":
                self._drop(rid)
                emits.append(Emit(rid, error=verdict))
                continue
            try:
                out, n = self._prefill(r)
            except Exception as e:  # this request's alone (a CUDA out-of-memory, say)
                self._drop(rid)
                emits.append(Emit(rid, error=f"talker: prefill failed: {type(e).__name__}: {e}"))
                continue
            budget -= n
            if out is not None:  # its first frame's code 0 comes from the prompt's last row
                picked.append((rid, out.logits[0, -1], r.first_time))
                hidden.append(out.hidden_states[0][-1][:, -1:])
        firsts = {p[0] for p in picked}
        decoding = [
            rid
            for rid in ready
            if rid in self.reqs and rid not in firsts and self.reqs[rid].row is not None
        ]
        decoding = [rid for rid in decoding if self._ready(self.reqs[rid])]
        for rid in self._reserve_decode(decoding):
            self._drop(rid)
            emits.append(Emit(rid, error=self.grown_past("talker")))
        decoding = [rid for rid in decoding if self._holding_row(rid)]
        kept = [i for i, (rid, _, _) in enumerate(picked) if self._holding_row(rid)]
        picked, hidden = [picked[i] for i in kept], [hidden[i] for i in kept]  # none preempted
        if decoding:
            for rid, logits, h, t in self._decode(decoding):
                picked.append((rid, logits, t))
                hidden.append(h)
        if not picked:
            return emits
        reqs = [self.reqs[rid] for rid, _, _ in picked]
        code0 = self._pick_code0s(reqs, torch.stack([x for _, x, _ in picked]))
        frames = self._residuals(reqs, code0, torch.cat(hidden)).tolist()  # one read back
        for (rid, _, token_time), codes in zip(picked, frames, strict=True):
            r = self.reqs[rid]
            r.spoken += 1
            r.code0s.append(codes[0])
            if codes[0] == self.tc.codec_eos_token_id or len(r.code0s) >= r.max_steps:
                self.abort(rid)  # this code 0 gets no frame (as generate)
                emits.append(Emit(rid, done=True))
                continue
            r.frame = torch.tensor(codes)
            data = {"codes": to_numpy(r.frame), "index": len(r.code0s) - 1}
            data["token_time"] = token_time
            emits.append(Emit(rid, data))
        return emits

    def kv_stats(self) -> tuple[int, int, int, int]:
        """The KV pool: blocks in use, blocks in all, kept sessions evicted and requests
        preempted so far."""
        cache = self.cache
        return cache.blocks_in_use(), cache.blocks, self.sessions.evictions, self.preemptions

    def abort(self, request_id: str) -> None:
        """Drop the request; a session's turn leaves its cache row for the next turn."""
        r = self.reqs.pop(request_id, None)
        if r is None or r.row is None:
            return
        if r.session is None or r.prompt is None:
            self.cache.free(r.row)
            return
        self.sessions.keep(r.session, r.row, r.prompt)

    # ---- admission and preemption ----------------------------------------------------------

    def _admission(self, r: _Request) -> str:
        """ "admit", "wait", or why it is refused (`cache.admission`): its inputs so far and a
        margin of frames."""
        assert r.inputs is not None
        margin = max(0, min(self.admit_margin, r.max_steps - r.spoken))
        tokens = sum(x.shape[1] for x in r.inputs) + margin
        waited_s = self.clock() - r.arrived
        return admission(self.sessions, "talker", tokens, waited_s, self.admit_timeout_s)

    def _preempt(self, rid: str) -> None:
        """Take `rid`'s row and blocks back; it is prefilled again once admitted: from its
        last frame on, or, before its first frame (its prompt prefilled in this very step),
        as a new request."""
        r = self.reqs[rid]
        assert r.row is not None and r.next_pos is not None
        if r.spoken:
            r.seen = self.seen[r.row].clone()
            r.resume_pos = r.next_pos
        r.next_pos = None
        self.cache.free(r.row)
        r.row = None
        r.arrived = self.clock()  # its wait for blocks starts again
        self.preemptions += 1

    def _prefill(self, r: _Request) -> tuple[Any, int]:
        """Prefill an admitted request's inputs into a row: its prompt (continuing its
        session's kept row), giving the output its first code 0 is picked from; or, preempted,
        everything it had (no output: it goes on from its last frame). And the rows computed."""
        assert r.inputs is not None and r.prompt_pos is not None
        embeds = torch.cat(r.inputs, dim=1)
        pos = r.prompt_pos
        if r.resume_pos is None:
            shared = self._continue_session(r, embeds[0])
        else:
            frames = embeds.shape[1] - pos.shape[-1]
            steps = torch.arange(-frames, 0, device=self.device).view(1, 1, -1)
            pos = torch.cat([pos, r.resume_pos + steps], dim=-1)
            shared = 0
            self.sessions.make_room(None)
            r.row = self.cache.alloc()
            assert r.seen is not None
            self.seen[r.row] = r.seen
        assert r.row is not None
        ok = self.cache.reserve(r.row, embeds.shape[1])
        assert ok, "admitted, so its blocks are there (`KeptSessions.fits`)"
        window = self.cache.prefill(r.row, embeds.shape[1] - shared)
        out = self._forward(embeds[:, shared:], pos[..., shared:], window)
        if r.resume_pos is not None:
            r.next_pos, r.resume_pos, r.seen = r.resume_pos, None, None
            return None, embeds.shape[1]
        r.next_pos = pos[..., -1:] + 1
        return out, embeds.shape[1] - shared

    def _continue_session(self, r: _Request, prompt: torch.Tensor) -> int:
        """Give `r` a cache row: its session's kept one, holding the longest common prefix of
        the two prompts' input rows (at least one row is left to compute), or a fresh one."""
        row, shared, _ = self.sessions.take(r.session, prompt)
        if row is None:
            self.sessions.make_room(None)  # a kept row given up, when every row is taken
            row = self.cache.alloc()
        r.row = row
        self.seen[r.row] = False
        if r.session is not None:
            r.prompt = prompt
        return shared

    # ---- model calls ---------------------------------------------------------------------

    @staticmethod
    def _ready(r: _Request) -> bool:
        if r.row is None:
            if r.inputs is not None:  # its prefill waits for blocks (preempted, or new)
                return True
            return (bool(r.tokens) and r.prompt_rows is not None) or (
                r.thinker_done and not r.tokens
            )
        return bool(r.tokens) or r.thinker_done

    def _decode(self, rids: list[str]) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
        """One talker forward for the rows of `rids`: (rid, logits, last hidden, token_time)."""
        reqs = [self.reqs[rid] for rid in rids]
        toks = [r.tokens.popleft() if r.tokens else None for r in reqs]
        x = self._step_inputs(reqs, toks)
        for i, r in enumerate(reqs):
            assert r.inputs is not None  # set when its prompt was built
            r.inputs.append(x[i : i + 1])
        rows = each([r.row for r in reqs])
        pos = torch.cat(each([r.next_pos for r in reqs]), dim=1)
        out = self._forward(x, pos, self.cache.decode(rows))
        last = out.hidden_states[0][-1]
        result = []
        for i, (rid, r, tok) in enumerate(zip(rids, reqs, toks, strict=True)):
            assert r.next_pos is not None  # set by its prefill
            r.next_pos = r.next_pos + 1
            token_time = tok.token_time if tok else r.last_time
            result.append((rid, out.logits[i, -1], last[i : i + 1, -1:], token_time))
        return result

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
        return embeds, pos

    def _step_inputs(self, reqs: list[_Request], toks: list[_Token | None]) -> torch.Tensor:
        """[n, 1, D]: each request's previous frame's 16 code embeddings summed, plus its text
        entry (the token's projected embedding, `tts_eos` for the last, `tts_pad` after it)."""
        m = self.model
        frames = torch.stack(each([r.frame for r in reqs])).to(self.device)
        f = frames.T[..., None]  # [16, n, 1]
        cp_embed = m.code_predictor.get_input_embeddings()
        parts = [m.get_input_embeddings()(f[0])]
        parts += [cp_embed[j - 1](f[j]) for j in range(1, len(f))]
        x = torch.cat(parts, dim=1).sum(1, keepdim=True)  # cat-then-sum, as generate
        text = [i for i, t in enumerate(toks) if t is not None and not t.last]
        extra = [self.tts_pad if t is None else self.tts_eos for t in toks]
        if text:
            embeds = torch.stack([t.embed for t in each([toks[i] for i in text])])[:, None]
            projected = m.text_projection(embeds)
            for j, i in enumerate(text):
                extra[i] = projected[j : j + 1]
        return x + torch.cat(extra)

    def _forward(self, x: torch.Tensor, pos: torch.Tensor, window: Any) -> Any:
        """One talker forward of inputs `x` at `pos` through a BlockCache window."""
        out = self.model(
            inputs_embeds=x,
            position_ids=pos,
            cache=window,
            blocks=window,
            use_cache=True,
            output_hidden_states=True,
            generation_step=0,  # read (only to count on) when x has one row
        )
        window.commit()
        return out

    def _pick_code0s(self, reqs: list[_Request], logits: torch.Tensor) -> torch.Tensor:
        """Code 0 [n]: each row's repetition penalty over its answer's earlier code 0s, the
        special ids suppressed except codec EOS, then each row's own sampler."""
        rows = torch.tensor([r.row for r in reqs], device=self.device)
        penalty = torch.tensor([r.repetition_penalty for r in reqs], device=self.device)[:, None]
        x = logits.float()
        x = torch.where(self.seen[rows], torch.where(x < 0, x * penalty, x / penalty), x)
        x[:, self.suppress] = float("-inf")
        code0 = BatchPicker([r.sampler for r in reqs], self.device).pick(x)
        self.seen[rows, code0] = True
        return code0

    def _residuals(
        self, reqs: list[_Request], code0: torch.Tensor, past_hidden: torch.Tensor
    ) -> torch.Tensor:
        """Frames [n, 16]: code 0 and codes 1..15 from the code predictor's 15 steps, for the
        whole batch at once with a fresh fixed-shape cache per frame (`CodePredictorLoop`);
        each row samples on its own, its 15 draws taken at once."""
        samplers = [r.residual_sampler for r in reqs]
        picker = BatchPicker(samplers, self.device, self.code_predictor.groups - 1)
        return self.code_predictor.frame(past_hidden, code0, picker.pick)
