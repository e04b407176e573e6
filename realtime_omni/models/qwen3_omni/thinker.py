"""The thinker stage: prefill, then one token per step, per-request KV cache and sampling.

Inputs (once, from `wait_for`): `input_ids` [L] int64 with `image_grid_thw` [n, 3] and
`audio_lengths` [n] when the prompt has images or audio, plus the request's sampling fields
(`temperature`, `top_p`, `top_k`, `seed`, `max_tokens`) and `prefill_only`; `audio_embeds`
[Na, D] from the audio encoder; `image_embeds` [Ni, D] and `deepstack` [K, Ni, D] from the image
encoder.

Outputs per generated token k: to the text stage (`params.text_to`, default `decode`)
`{token_id, index, token_time, last}`; to the speech stage (`params.speech_to`, default
`talker_ar`) the same plus `embed` [D] (the token's thinker input embedding, what the talker's
text side projects), and with token 0 `prompt_rows` [U + 3, D]: for every user-turn position the
`accept_hidden_layer` output at audio/image/video positions and the input embedding elsewhere,
then the input embeddings of the final `<|im_start|>assistant\\n`. The request ends after a stop
token (`params.stop_token_ids`, default `<|im_end|>`) or `max_tokens` tokens, whichever is
first; the last token carries `last: true` and is followed by `done`. A `text_only` request
sends nothing to the speech stage (its stream there just ends: the talker and code2wav do no
work for it); nor does a request with tools (`tool_calls`) after its `<tool_call>` token
(`params.tool_call_token_id`, default the checkpoint's), which goes to the speech stage marked
`last`, as a stop token would, so the talker ends what was said with its end-of-text row: a
function call is written for the client, not said. Its tags go to decode marked `keep`, to
stay in the text.

Batching: one step decodes a token for every running request in one forward (up to the stage's
`max_batch`), each request in its own row of a `BlockCache` with its own 3-D rope positions and
sampler, and then prefills new prompts in chunks of at most `max_prefill_tokens_per_step`
tokens: a new turn delays the others' next token by one chunk's forward per step, not by its
whole prompt. A request whose prefill ends in a step emits its first token in that step.
Requests beyond `max_batch` wait for a row. KV memory comes in blocks from one pool
(`cache.py`; its size `params.kv_cache_tokens` or `kv_cache_gib`, by default a share of the GPU
memory free after loading, or 1 GiB on a CPU). Per-request state (row, positions, sampler) lives
in `_Request`; the module's own `rope_deltas` is never read or written.

Under pressure (the pool nearly full), no running answer dies for a newcomer's sake:
- Admission: a waiting request starts its prefill only when its prompt plus a decode margin
  (`params.admit_margin_tokens`, default 128, at most what it may still generate) fits in the
  free blocks and those that evicting kept sessions would give back, counted before anything
  is evicted; then its whole prompt's blocks are taken at once. Requests are admitted in
  arrival order; one that waits longer than `params.admit_timeout_s` (default 20) fails
  saying so, and one that could never fit, even in an empty pool, fails at once and evicts
  nothing.
- Preemption: when a decode step still finds no block for a row, the newest request holding
  blocks gives its blocks back (a request in its prefill starts it again later; one already
  answering is recomputed later: its prompt and the tokens it fed are prefilled again and it
  goes on where it was, its sampler's state kept, nothing sent twice). The oldest answer is
  never the one that pays. `preemptions` counts them.
- Failures: a request refused or whose prefill chunk raises (a CUDA out-of-memory, say) fails
  alone, as an `Emit` with `error`, beside the others' tokens of the same step.

With `params.decode_interval_ms` (default 0: off; 20 in configs/tiny.yaml), decode
steps come at most that often while every running request speaks and is past its first two
tokens and no prompt waits: the talker takes a token per 80 ms frame, and tokens made faster
only take the cores from the stages after this one (`_paced_until`).

Conversations (`session_id` in the request): when a turn of a session ends (finished or
aborted), its cache row is kept with the inputs whose keys and values it holds (the prompt and
the answer's tokens as they were generated). The session's next turn prefills only what follows
the longest common prefix of those inputs and its own prompt, compared as input embeddings (so a
replaced audio clip of the same length is not taken for the old one): a new user turn after the
answer as generated, or, after a barge-in, after the answer cut where it was heard. Anything else
(another history, a deleted item) shares a shorter prefix, down to none: a full prefill, with the
same result. A turn aborted in its prefill keeps the prefix it computed.

Prefill while the person speaks (`prefill_only: true`, with `session_id`): the prompt (the
conversation with the turn's audio so far) is prefilled like any other, then the request ends
with `done` and no token, so the text and speech stages get an empty stream and the talker and
code2wav compute nothing for it; its row is kept for its session. The session's next request
(the turn's next chunk, or its answer) then prefills only what follows the common prefix: the
audio encoder's windows decide how far that reaches (encoders.py). A request waits while an
earlier prefill-only request of its session still prefills, so it takes that row once kept
instead of a fresh one.

Kept sessions are bounded by `params.session_cache_tokens` (default 65,536), by the cache rows and
by the pool's blocks, which running requests take first; the least recently used goes first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from realtime_omni.errors import ExecutorError
from realtime_omni.models.qwen3_omni.cache import (
    BlockCache,
    KeptSessions,
    PreemptsNewest,
    admission,
    pool_blocks,
)
from realtime_omni.models.qwen3_omni.prompt import assistant_start, mrope_positions, user_positions
from realtime_omni.models.qwen3_omni.sampling import (
    Sampler,
    checkpoint_defaults,
    pick_batch,
    special_token_id,
)
from realtime_omni.models.qwen3_omni.tensors import (
    each,
    model_dtype,
    nonempty,
    setup_torch,
    to_torch,
)
from realtime_omni.models.qwen3_omni.weights import load_config, load_part, model_dir
from realtime_omni.pipeline.executor import Emit, HoldsRequests, StageContext

Payload = dict[str, Any]
# A paced request has made this many tokens: the talker's first two frames (the first chunk's)
# need tokens 0 and 1, so they are never waited for.
PACED_AFTER = 2


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
    session: str | None = None
    text_only: bool = False  # a text answer (or one now writing a function call): no speech
    tool_calls: bool = False  # tools were given: <tool_call> means a call
    prefill_only: bool = False  # prefill the prompt for its session, make no token
    row: int | None = None  # its BlockCache row, from the start of its prefill to its end
    embeds: torch.Tensor | None = None  # [L, D] the prompt's input embeddings, while prefilling
    pos: torch.Tensor | None = None  # [4, 1, L] its positions, while prefilling
    prefilled: int = 0  # prompt tokens in the cache
    cached: int = 0  # of those, taken over from the session's previous turn
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per chunk
    next_pos: torch.Tensor | None = None  # [4, 1, 1]: position of the next input token
    tokens: list[int] = field(default_factory=list)
    prompt: _Prompt | None = None  # the prompt's rows once prefilled (for a session to keep)
    seq: int = 0  # arrival order: admission and preemption go by it (the newest pays)
    arrived: float = 0.0  # when it came (`clock`): it waits for blocks `admit_timeout_s` at most
    resume_pos: torch.Tensor | None = None  # preempted while answering: its next position

    @property
    def decoding(self) -> bool:
        return self.next_pos is not None


@dataclass
class _Prompt:
    """A prefilled prompt's rows, per position, for its session to keep: the input embedding,
    the first hidden state and the `accept_hidden_layer` output (the talker's prompt rows)."""

    embeds: torch.Tensor  # [n, D]
    hs0: torch.Tensor | None  # [n, D], with speech
    hidden: torch.Tensor | None  # [n, D], with speech


class ThinkerExecutor(HoldsRequests, PreemptsNewest):
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
        # Defaults: the stage's params, else the checkpoint's generation_config (greedy and
        # <|im_end|> where it says nothing); a request's own fields come first.
        ckpt = checkpoint_defaults(d)
        eos = [self.cfg.im_end_token_id, *ckpt.get("eos_token_ids", [])]
        self.stop_ids = set(p.get("stop_token_ids") or eos)
        # A function call is written, not said: from <tool_call> on, nothing goes to speech.
        tags = [p.get("tool_call_token_id", special_token_id(d, "<tool_call>"))]
        tags.append(p.get("tool_call_end_token_id", special_token_id(d, "</tool_call>")))
        self.tool_call_id, self.tool_call_end_id = (int(t) if t is not None else None for t in tags)
        self.default_sampling = {
            k: p.get(k, ckpt.get(k, getattr(Sampler, k))) for k in ("temperature", "top_p", "top_k")
        }
        self.default_max_tokens = int(p.get("max_tokens", 256))
        self.accept_layer = self.cfg.talker_config.accept_hidden_layer
        tc = self.cfg.thinker_config
        self.mm_ids = torch.tensor([tc.audio_token_id, tc.image_token_id, tc.video_token_id])
        self.lm = self.model.model.language_model
        dtype = self.embed.weight.dtype
        blocks = pool_blocks(
            p, self.lm.config, dtype, self.device, ctx.stage, pipeline=ctx.pipeline
        )
        self.cache = BlockCache.for_text_model(
            self.lm.config, ctx.max_batch, blocks, dtype, self.device
        )
        self.prefill_budget = ctx.max_prefill_tokens_per_step
        self.sessions = KeptSessions(self.cache, int(p.get("session_cache_tokens", 65536)))
        self.decode_interval_s = float(p.get("decode_interval_ms", 0)) / 1e3
        if self.decode_interval_s < 0:
            raise ValueError("thinker: decode_interval_ms >= 0")
        self.clock = time.monotonic
        self.last_decode = float("-inf")  # when the last decode step began (`clock`)
        self.admit_margin = int(p.get("admit_margin_tokens", 128))
        self.admit_timeout_s = float(p.get("admit_timeout_s", 20.0))
        self.reqs: dict[str, _Request] = {}
        self.arrivals = 0
        self.preemptions = 0  # requests that gave their blocks back for an older one's decode
        self.shares: dict[str, float] = {}  # tokens each request had computed in the last step

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
            sampler = Sampler.from_meta(merged, **self.default_sampling)
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
            session=str(merged["session_id"]) if merged.get("session_id") else None,
            text_only=bool(merged.get("text_only", False)),
            tool_calls=bool(merged.get("tool_calls", False)),
            prefill_only=bool(merged.get("prefill_only", False)),
            seq=self.arrivals,
            arrived=self.clock(),
        )
        self.arrivals += 1

    def add_item(self, request_id: str, src: str, item: Payload) -> None:
        raise ExecutorError(request_id, f"thinker: takes no streamed input (got one from {src})")

    def end_stream(self, request_id: str, src: str) -> None:
        pass

    def has_work(self) -> bool:
        """Some running request decodes or prefills, or the first waiting one can be admitted
        or refused; one waiting for a row or blocks makes no work (the loop must not spin on
        it: `wake_in` says when its wait runs out)."""
        running = self.running()
        due = self._paced_until(running)
        if due is not None and self.clock() < due:
            return False
        if any(r.row is not None for r in running.values()):
            return True
        waiting = self._waiting(running)
        return bool(waiting) and self._admission(waiting[0][1]) != "wait"

    def wake_in(self) -> float | None:
        """Seconds until a paced decode step is due (`_paced_until`) or the wait of the first
        request waiting for blocks runs out, else None."""
        running = self.running()
        times = [self._paced_until(running)]
        waiting = self._waiting(running)
        if waiting and self._admission(waiting[0][1]) == "wait":
            times.append(waiting[0][1].arrived + self.admit_timeout_s)
        due = min((t for t in times if t is not None), default=None)
        return None if due is None else max(0.0, due - self.clock())

    def step(self) -> list[Emit]:
        """Decode one token of every running request together (oldest first to their blocks,
        preempting the newest when there are none), then prefill prompts in arrival order,
        admitting those whose prompt fits (module docstring)."""
        self.shares = {}
        running = self.running()
        decoding = sorted((rid for rid, r in running.items() if r.decoding), key=self._seq)
        failed = []
        for rid in self._reserve_decode(decoding):
            self._drop(rid)
            failed.append(Emit(rid, error=self.grown_past("thinker")))
        decoding = [rid for rid in decoding if self._holding_row(rid)]
        if decoding:
            self.last_decode = self.clock()  # its start: a token every interval, however long
        emits = failed + (self._decode(decoding) if decoding else [])
        self.shares = dict.fromkeys(decoding, 1.0)
        budget = self.prefill_budget
        filling: set[str] = set()  # sessions with a prefill-only request still prefilling
        for rid, r in sorted(running.items(), key=lambda kv: kv[1].seq):
            if r.decoding or rid not in self.reqs:
                continue
            if r.session in filling:
                continue  # it will keep its row for this one: take it then, not a fresh one
            if r.prefill_only and r.session is not None:
                filling.add(r.session)
            if budget <= 0:
                break
            if r.row is None:
                verdict = self._admission(r)
                if verdict == "wait":
                    break  # first come, first served: later prompts wait their turn
                if verdict != "admit":
                    del self.reqs[rid]
                    emits.append(Emit(rid, error=verdict))
                    continue
            try:
                if r.row is None:
                    self._start_prefill(r)
                assert r.embeds is not None and r.row is not None  # `_start_prefill` set them
                n = min(budget, r.embeds.shape[0] - r.prefilled)
                chunk = self._prefill_chunk(rid, r, n)
            except Exception as e:  # this request's alone (a CUDA out-of-memory, say)
                self._drop(rid)
                emits.append(Emit(rid, error=f"thinker: prefill failed: {type(e).__name__}: {e}"))
                continue
            budget -= n
            self.shares[rid] = float(n)
            emits += chunk
        return emits

    def step_shares(self) -> dict[str, float]:
        """Tokens computed for each request in the last step (a decode row 1, a prefill chunk
        its tokens): how the step's time divides among them."""
        return self.shares

    # ---- admission and preemption ----------------------------------------------------------

    def _waiting(self, running: dict[str, _Request]) -> list[tuple[str, _Request]]:
        """Requests without a row, in arrival order."""
        return sorted(((k, r) for k, r in running.items() if r.row is None), key=lambda x: x[1].seq)

    def _tokens_needed(self, r: _Request) -> int:
        """A waiting request's prompt (and the tokens it fed, when recomputed) plus its margin."""
        fed = len(r.tokens) - 1 if r.resume_pos is not None else 0
        margin = 0 if r.prefill_only else min(self.admit_margin, r.max_tokens - len(r.tokens))
        return int(r.ids.shape[0]) + fed + max(margin, 0)

    def _admission(self, r: _Request) -> str:
        """ "admit", "wait", or why it is refused (`cache.admission`)."""
        waited_s = self.clock() - r.arrived
        return admission(
            self.sessions, "thinker", self._tokens_needed(r), waited_s, self.admit_timeout_s
        )

    def _preempt(self, rid: str) -> None:
        """Take `rid`'s row and blocks back; it waits to be admitted again (module docstring)."""
        r = self.reqs[rid]
        assert r.row is not None
        self.cache.free(r.row)
        r.row = None
        self.preemptions += 1
        r.arrived = self.clock()  # its wait for blocks starts again
        if r.decoding:  # answering: recomputed later from its prompt and fed tokens
            r.resume_pos, r.next_pos = r.next_pos, None
        r.prefilled = r.cached = 0
        r.embeds = r.pos = None
        r.hidden = []

    def kv_stats(self) -> tuple[int, int, int, int]:
        """The KV pool: blocks in use, blocks in all, kept sessions evicted and requests
        preempted so far."""
        cache = self.cache
        return cache.blocks_in_use(), cache.blocks, self.sessions.evictions, self.preemptions

    def abort(self, request_id: str) -> None:
        """Drop the request; a session's turn leaves its cache row for the next turn, with
        what it holds: the prompt and the answer's fed tokens, or a prompt's part prefilled."""
        r = self.reqs.pop(request_id, None)
        if r is None or r.row is None:
            return
        if r.session is None or (r.prompt is None and (r.embeds is None or not r.prefilled)):
            self.cache.free(r.row)
            return
        if r.prompt is None:  # cut short in its prefill: keep the prefix it computed
            assert r.embeds is not None
            hs0 = hidden = None
            if r.hidden:
                hs0 = torch.cat([h[0] for h in r.hidden])
                hidden = torch.cat([h[1] for h in r.hidden])
            self.sessions.keep(r.session, r.row, r.embeds[: r.prefilled], (hs0, hidden))
            return
        fed = r.tokens[:-1]  # the last token made was never fed back: it has no keys yet
        gen = self.embed(torch.tensor(fed, dtype=torch.long, device=self.device))
        hs0 = hidden = None
        if r.prompt.hs0 is not None and r.prompt.hidden is not None:
            hs0 = torch.cat([r.prompt.hs0, gen])
            hidden = torch.cat([r.prompt.hidden, gen.new_zeros(gen.shape)])
        # Answer tokens' hidden rows are zeros: the talker's prompt reads user turns only.
        self.sessions.keep(r.session, r.row, torch.cat([r.prompt.embeds, gen]), (hs0, hidden))

    def _paced_until(self, running: dict[str, _Request]) -> float | None:
        """When the next decode step is due if it is paced, `decode_interval_ms` after the
        last: while every running request speaks and is past its first `PACED_AFTER` tokens,
        and no prompt waits. The talker takes a token per 80 ms frame, so tokens made faster
        only take the cores from the stages after this one (and from new answers' first
        audio); paced, the rows also gather into a few full steps instead of a step per row
        as they come. The first tokens, which the first audio waits for, are never paced."""
        if self.decode_interval_s <= 0 or not running or not self.speech:
            return None
        for r in running.values():
            if not r.decoding or len(r.tokens) < PACED_AFTER or r.text_only:
                return None
        return self.last_decode + self.decode_interval_s

    # ---- model calls ---------------------------------------------------------------------

    def _start_prefill(self, r: _Request) -> None:
        """Merge the prompt's embeddings, as the thinker's forward does, and take a cache row:
        the session's kept one when it shares a prefix with this prompt."""
        ids = r.ids.view(1, -1)
        embeds = self.embed(ids)
        tc = self.cfg.thinker_config
        if r.audio_embeds is not None:
            mask = (ids == tc.audio_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, r.audio_embeds.to(embeds.dtype))
        if r.image_embeds is not None:
            mask = (ids == tc.image_token_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, r.image_embeds.to(embeds.dtype))
        r.embeds = embeds[0]
        r.pos = mrope_positions(self.model, r.ids, r.grid, r.audio_lengths, always=True)
        if r.resume_pos is not None:  # preempted while answering: its fed tokens follow
            fed = r.tokens[:-1]
            r.embeds = torch.cat([r.embeds, self.embed(torch.tensor(fed, device=self.device))])
            steps = torch.arange(-len(fed), 0, device=self.device).view(1, 1, -1)
            r.pos = torch.cat([r.pos, r.resume_pos + steps], dim=-1)
            self.sessions.make_room(None)
            r.row = self.cache.alloc()
            ok = self.cache.reserve(r.row, r.embeds.shape[0])
            assert ok, "admitted, so its blocks are there (`KeptSessions.fits`)"
            return
        row, shared, extra = self.sessions.take(r.session, r.embeds)
        if row is not None:
            r.row, r.prefilled, r.cached = row, shared, shared
            hs0, hidden = extra
            if hs0 is not None and hidden is not None:
                r.hidden.append((hs0[:shared], hidden[:shared]))
        else:
            self.sessions.make_room(None)  # a kept row given up, when every row is taken
            r.row = self.cache.alloc()
        ok = self.cache.reserve(r.row, r.embeds.shape[0])
        assert ok, "admitted, so its blocks are there (`KeptSessions.fits`)"

    def _prefill_chunk(self, rid: str, r: _Request, n: int) -> list[Emit]:
        assert r.embeds is not None and r.pos is not None and r.row is not None
        a, b = r.prefilled, r.prefilled + n
        deepstack = visual = None
        if r.image_embeds is not None and r.deepstack is not None:
            vis = r.ids == self.cfg.thinker_config.image_token_id
            vis = F.pad(vis, (0, r.embeds.shape[0] - vis.shape[0]))  # fed tokens: no image
            before, inside = int(vis[:a].sum()), int(vis[a:b].sum())
            visual = vis[None, a:b]
            deepstack = [f[before : before + inside] for f in r.deepstack]
        resuming = r.resume_pos is not None
        window = self.cache.prefill(r.row, n)
        out = self.lm(
            inputs_embeds=r.embeds[None, a:b],
            position_ids=r.pos[..., a:b],
            cache=window,
            blocks=window,
            use_cache=True,
            visual_pos_masks=visual,
            deepstack_visual_embeds=deepstack,
            output_hidden_states=self.speech and not resuming,
        )
        window.commit()
        r.prefilled = b
        if self.speech and not resuming:
            hs = out.hidden_states
            r.hidden.append((hs[0][0], hs[self.accept_layer][0]))
        if b < r.embeds.shape[0]:
            return []
        if resuming:  # its cache holds what it had: decode on from its last token
            r.next_pos, r.resume_pos = r.resume_pos, None
            r.embeds = r.pos = None
            return []
        rows = None
        hs0 = hidden = None
        if self.speech:
            hs0 = torch.cat([h[0] for h in r.hidden])
            hidden = torch.cat([h[1] for h in r.hidden])
            if not r.prefill_only:
                rows = self._prompt_rows(r.ids, hs0, hidden)
        if r.session is not None:
            r.prompt = _Prompt(r.embeds, hs0, hidden)
        if r.prefill_only:  # its row stays with its session (`abort`), holding the prompt
            self.abort(rid)
            return [Emit(rid, done=True)]
        r.next_pos = r.pos[..., -1:] + 1
        r.embeds = r.pos = None
        r.hidden = []
        # [1, D], not a [1, 1, D] view of the prompt's hidden states: matmul turns that view
        # into a bmm that copies the whole lm_head weight transposed (0.6 GB at the real
        # vocabulary and width, seconds a prefill on a CPU; benchmarks/real_width.py).
        logits = self.model.lm_head(out.last_hidden_state[0, -1:])
        tok = r.sampler.pick_tensor(logits[-1].float())
        return self._take(rid, int(tok), rows)

    def _decode(self, rids: list[str]) -> list[Emit]:
        """One token for each of `rids`, in one forward over their cache rows only."""
        reqs = [self.reqs[rid] for rid in rids]
        rows = each([r.row for r in reqs])
        ids = torch.tensor([[r.tokens[-1]] for r in reqs], dtype=torch.long)
        pos = torch.cat(each([r.next_pos for r in reqs]), dim=1)
        window = self.cache.decode(rows)
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=pos.to(self.device),
            cache=window,
            blocks=window,
            use_cache=True,
        )
        window.commit()
        logits = out.logits[:, -1]
        picks = pick_batch([r.sampler for r in reqs], logits).tolist()  # one read back
        emits: list[Emit] = []
        for rid, r, tok in zip(rids, reqs, picks, strict=True):
            assert r.next_pos is not None  # set by its prefill
            r.next_pos = r.next_pos + 1
            emits += self._take(rid, int(tok), None)
        return emits

    def _prompt_rows(self, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor) -> Any:
        users = user_positions(ids.cpu(), self.cfg).to(ids.device)
        a = assistant_start(ids.cpu(), self.cfg)
        mm = torch.isin(ids, self.mm_ids.to(ids.device)).unsqueeze(-1)
        rows = torch.where(mm, hidden, embeds)[users]
        return torch.cat([rows, embeds[a : a + 3]])

    def _take(self, rid: str, tok: int, prompt_rows: Any) -> list[Emit]:
        r = self.reqs[rid]
        r.tokens.append(tok)
        last = tok in self.stop_ids or len(r.tokens) >= r.max_tokens
        meta = {"token_id": tok, "index": len(r.tokens) - 1, "token_time": time.monotonic()}
        meta["last"] = last
        if len(r.tokens) == 1:  # what the prompt cost: tokens prefilled, and taken from a kept turn
            meta["prefill_tokens"] = int(r.ids.shape[0]) - r.cached
            meta["cached_tokens"] = r.cached
        speaking = self.speech and not r.text_only
        if r.tool_calls and tok in (self.tool_call_id, self.tool_call_end_id):
            meta["keep"] = True  # decode keeps the tag in the text, for the gateway
            r.text_only = True  # what came before is said; the call is written, not said
        emits = [Emit(rid, dict(meta), to=self.text_to)]
        if speaking:
            speech: Payload = {**meta, "embed": self.embed.weight[tok]}  # weights: never written
            # A call's tag ends the speech as a stop token would: the talker's end-of-text row.
            speech["last"] = last or r.text_only
            if prompt_rows is not None:
                speech["prompt_rows"] = prompt_rows
            emits.append(Emit(rid, speech, to=self.speech_to))
        if last:
            self.abort(rid)  # its row goes back to the cache
            emits.append(Emit(rid, done=True))
        return emits
