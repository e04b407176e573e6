"""Executor-level tests in this process: abort frees a request's KV cache, a wrong
`model.path` is a clear ConfigError."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.pipeline.executor import StageContext


def ctx(stage: str, model: dict, **params: object) -> StageContext:
    return StageContext(stage=stage, device="cpu", params=dict(params), model=model,
                        downstream=["decode", "talker_ar"])  # fmt: skip


def test_abort_mid_stream_frees_the_kv_cache_row(tiny_dir: Path) -> None:
    """Abort gives the request's cache row back at once (the next request takes it), and the
    other request in flight decodes on exactly as it would have."""
    from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor

    def make() -> ThinkerExecutor:
        return ThinkerExecutor(ctx("thinker", {"path": str(tiny_dir)}))

    tok = ex_tokenizer(tiny_dir)
    prompt = tok("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    inputs = {"preprocessing": {"input_ids": np.array(prompt), "max_tokens": 12}}
    ex, solo = make(), make()
    ex.add_request("a", inputs)
    ex.add_request("b", inputs)
    solo.add_request("b", inputs)
    got: dict[str, list[int]] = {"b": [], "solo": []}
    for i in range(12):
        if i == 4:
            row = ex.reqs["a"].row
            ex.abort("a")
            assert "a" not in ex.reqs and ex.cache.in_use() == 1
            ex.add_request("c", inputs)
        for who, e in (("b", ex), ("solo", solo)):
            got[who] += [m.data["token_id"] for m in e.step() if m.request_id == "b" and m.data
                         and m.to == "decode"]  # fmt: skip
    assert ex.reqs["c"].row == row  # the freed row was reused
    assert got["b"] == got["solo"] and len(got["b"]) == 12
    ex.abort("c")
    assert not ex.reqs and ex.cache.in_use() == 0


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


def test_the_code_predictor_loop_matches_the_transformers_forward(tiny_dir: Path) -> None:
    """CodePredictorLoop (fixed-shape cache, no wrappers) gives the logits of the code
    predictor's own forward through a DynamicCache, step by step, for a batch of 3."""
    import torch
    from transformers import DynamicCache

    from realtime_omni.models.qwen3_omni.code_predictor import CodePredictorLoop
    from realtime_omni.models.qwen3_omni.weights import load_config, load_part

    cfg = load_config(tiny_dir)
    talker = load_part(tiny_dir, "talker", "cpu", torch.float32, cfg)
    cp, n = talker.code_predictor, 3
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, 1, cfg.talker_config.text_config.hidden_size, generator=g)
    code0 = torch.randint(0, 2048, (n,), generator=g)
    seen: dict[str, list[torch.Tensor]] = {"loop": [], "forward": []}

    def pick(who: str):  # the argmax's runner-up, so that a wrong step changes what follows
        return lambda logits: seen[who].append(logits) or logits.topk(2).indices[:, 1]

    with torch.no_grad():
        got = CodePredictorLoop(talker).frame(hidden, code0, pick("loop"))
        cache = DynamicCache(config=cp.config)
        x = torch.cat([hidden, talker.get_input_embeddings()(code0.view(n, 1))], 1)
        out = cp(inputs_embeds=x, position_ids=torch.arange(2).expand(n, 2), cache=cache,
                 use_cache=True)  # fmt: skip
        codes = [code0, pick("forward")(out.logits[:, -1])]
        for j in range(1, 15):
            out = cp(input_ids=codes[-1].view(n, 1), generation_steps=j, cache=cache,
                     position_ids=torch.full((n, 1), 1 + j), use_cache=True)  # fmt: skip
            codes.append(pick("forward")(out.logits[:, -1]))
    assert torch.equal(got, torch.stack(codes, 1)) and got.shape == (n, 16)
    for a, b in zip(seen["loop"], seen["forward"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


class _Vocoder:
    """A code2wav executor on a clock of the test's (`now[0]`), and frames to give it."""

    def __init__(self, tiny_dir: Path) -> None:
        from realtime_omni.models.qwen3_omni.code2wav import Code2WavExecutor

        self.ex = Code2WavExecutor(ctx("code2wav", {"path": str(tiny_dir)}))
        self.now = [100.0]
        self.ex.clock = lambda: self.now[0]
        self.frames = np.random.default_rng(0).integers(0, 2048, (32, 16))

    def give(self, rid: str, codes: np.ndarray) -> None:
        for f in codes:
            self.ex.add_item(rid, "talker_ar", {"codes": f, "token_time": 0.0})

    def chunks(self) -> list[tuple[str, int]]:
        return [(e.request_id, e.data["frames"]) for e in self.ex.step() if e.data]


@pytest.mark.parametrize("later_s", [0.0, 2.0])
def test_a_first_chunk_goes_without_the_listeners_far_ahead(tiny_dir: Path, later_s: float) -> None:
    """code2wav: a step that makes a new answer's first chunk leaves out a listener with more
    than `yield_lead_s` of audio ahead of real time (it gets the next step); once that listener
    is no longer ahead, both chunks share the step."""
    v = _Vocoder(tiny_dir)
    ex, now, frames, give, chunks = v.ex, v.now, v.frames, v.give, v.chunks

    ex.add_request("old", {})
    give("old", frames[:16])
    assert [chunks() for _ in range(4)] == [[("old", n)] for n in (2, 2, 4, 8)]  # 1.26 s out
    give("old", frames[16:26])  # its next chunk (10 frames) is due
    ex.add_request("new", {})
    give("new", frames[:2])  # and a new answer's first
    now[0] += later_s  # 2 s on, "old" has no audio left to play
    if later_s:
        assert sorted(chunks()) == [("new", 2), ("old", 10)]
    else:
        assert chunks() == [("new", 2)]
        assert chunks() == [("old", 10)]


def test_a_first_chunk_pending_keeps_the_listeners_far_ahead_waiting(tiny_dir: Path) -> None:
    """code2wav: while a new answer has one of its first chunk's two frames, a listener with
    more than `yield_lead_s` of audio ahead waits (no step begins, and the loop is told when
    that listener runs short); the first chunk then goes alone. Once the listener is short, it
    is served while the first chunk still waits."""
    v = _Vocoder(tiny_dir)
    ex, now, frames, give, chunks = v.ex, v.now, v.frames, v.give, v.chunks

    for wait_s in (None, 1.1):
        ex.reqs.clear()
        ex.add_request("old", {})
        give("old", frames[:16])
        assert [chunks() for _ in range(4)] == [[("old", n)] for n in (2, 2, 4, 8)]
        lead = ex.reqs["old"].samples / 24000  # 1.26 s out, none of it played yet
        give("old", frames[16:26])  # its next chunk (10 frames) is due
        assert ex.has_work() and ex.wake_in() is None
        ex.add_request("new", {})
        give("new", frames[:1])  # a new answer's first frame: its first chunk needs two
        assert not ex.has_work()
        assert ex.wake_in() == pytest.approx(lead - ex.yield_lead_s)
        if wait_s is None:
            give("new", frames[1:2])
            assert chunks() == [("new", 2)]
            assert chunks() == [("old", 10)]
        else:
            now[0] += wait_s  # "old" has 0.16 s left to play, "new" still one frame
            assert ex.has_work() and chunks() == [("old", 10)]


def test_the_thinker_paces_decode_steps_of_answers_past_their_first_tokens(tiny_dir: Path) -> None:
    """thinker `decode_interval_ms`: an answer past its first two tokens waits for the interval
    since the last decode step (the loop is told how long), alone or beside another; a prompt
    waiting, or a text answer running, is never kept waiting; the tokens are those made
    unpaced."""
    from realtime_omni.models.qwen3_omni.thinker import ThinkerExecutor

    tok = ex_tokenizer(tiny_dir)
    prompt = tok("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    inputs = {"preprocessing": {"input_ids": np.array(prompt), "max_tokens": 8}}
    text = {"preprocessing": {**inputs["preprocessing"], "text_only": True}}
    got: dict[float, dict[str, list[int]]] = {}
    for interval in (0.0, 20.0):
        ex = ThinkerExecutor(ctx("thinker", {"path": str(tiny_dir)}, decode_interval_ms=interval))
        now = [100.0]
        ex.clock = lambda: now[0]  # noqa: B023
        tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}

        def step() -> None:
            for e in ex.step():  # noqa: B023
                if e.data and e.to == "decode":
                    tokens[e.request_id].append(e.data["token_id"])  # noqa: B023

        ex.add_request("a", inputs)
        step()  # the prefill: token 0
        step()  # token 1: from here on "a" is paced
        if interval:
            assert not ex.has_work() and ex.wake_in() == pytest.approx(0.02)
            now[0] += 0.015
            assert not ex.has_work() and ex.wake_in() == pytest.approx(0.005)
            ex.add_request("b", inputs)  # a prompt waits: no pacing
            assert ex.has_work() and ex.wake_in() is None
        else:
            assert ex.has_work() and ex.wake_in() is None
            ex.add_request("b", inputs)
        paced, asked = 0, False
        while ex.reqs:
            if len(tokens["b"]) == 4 and not asked:
                ex.add_request("c", text)  # a text answer: nothing waits for it
                asked = True
            if "c" in ex.reqs and ex.reqs["c"].decoding:
                assert ex.has_work()
            if ex.has_work():
                step()
            else:
                paced += 1
                now[0] += 0.005
        assert (paced > 0) == bool(interval)
        got[interval] = tokens
    assert got[0.0] == got[20.0] and all(len(t) == 8 for t in got[0.0].values())
