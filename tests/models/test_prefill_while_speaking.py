"""A turn prefilled while it is spoken (prefill-only requests, then the answer) gives the tokens
and codec frames of the same turn prefilled at once; the audio encoder reuses its complete
windows to the bit; a prefill-only request leaves its kept row and nothing else behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from realtime_omni.models.qwen3_omni.preprocessing import encode_conversation
from tests.models.conftest import tiny_config
from tests.models.inproc import InProcess
from tests.models.reference import SYSTEM

pytestmark = pytest.mark.slow
RATE = 16000
GREEDY = {"temperature": 0, "talker_temperature": 0, "max_tokens": 6, "talker_max_tokens": 12}
CUTS_S = (8.5, 16.5)  # where the prefill-only requests cut the turn (20 s): windows are 8 s


def voice(seconds: float = 20.0, louder: tuple[float, float] | None = None) -> np.ndarray:
    """A sweep at a steady level (its log-mel maximum comes early), or 4x louder over `louder`
    (seconds): audio louder than all before it changes the features of everything before."""
    t = np.arange(int(seconds * RATE)) / RATE
    x = 0.2 * np.sin(2 * np.pi * (200 * t + 40 * t * t))
    if louder is not None:
        x[int(louder[0] * RATE) : int(louder[1] * RATE)] *= 4
    return x.astype(np.float32)


def payload(audio: np.ndarray, **extra: Any) -> dict[str, Any]:
    turn = {"role": "user", "content": [{"type": "audio", "audio": "turn"}]}
    return {"messages": [SYSTEM, turn], "turn": audio, **GREEDY, **extra}


def pipeline(**stage: Any) -> InProcess:
    data = tiny_config()
    data["stages"]["thinker"].update(stage)
    return InProcess(data)


def count_windows(p: InProcess) -> list[int]:
    """Windows the audio encoder encodes, per forward."""
    ex = p.stages["audio_encoder"].executor
    counts: list[int] = []
    encode = ex._encode_windows  # type: ignore[attr-defined]
    ex._encode_windows = lambda todo: counts.append(len(todo)) or encode(todo)  # type: ignore[attr-defined]
    return counts


def answer(p: InProcess, rid: str, body: dict[str, Any]) -> dict[str, Any]:
    p.submit(rid, body)
    p.run()
    out = p.outputs[rid]
    return {
        "ids": [o["token_id"] for o in out["decode"]],
        "codes": np.concatenate([o["codes"] for o in out["code2wav"]]),
        "cached": out["decode"][0]["cached_tokens"],
    }


def audio_start(p: InProcess, body: dict[str, Any]) -> int:
    """Where the turn's audio tokens begin in the prompt."""
    processor = p.stages["preprocessing"].executor.processor  # type: ignore[attr-defined]
    ids = encode_conversation(processor, body, "np")[0]["input_ids"][0].tolist()
    return int(ids.index(processor.tokenizer.convert_tokens_to_ids("<|audio_start|>"))) + 1


def test_windows_encoded_one_by_one_are_the_whole_clips_to_the_bit(tiny_dir: Path) -> None:
    p = pipeline()
    ex = p.stages["audio_encoder"].executor
    processor = p.stages["preprocessing"].executor.processor  # type: ignore[attr-defined]
    extract = processor.feature_extractor
    clips = [voice(20.0), voice(3.3)]
    mels = [extract([c], sampling_rate=RATE, padding=True)["input_features"][0] for c in clips]
    mels = [m[:, : len(c) // 160] for m, c in zip(mels, clips, strict=True)]
    with torch.no_grad():
        whole = [
            ex.model(torch.from_numpy(m), feature_lens=torch.tensor([m.shape[1]])).last_hidden_state
            for m in mels
        ]
    lengths = np.array([m.shape[1] for m in mels])
    ex.add_request("r", {"pre": {"mel": np.concatenate(mels, 1), "audio_lengths": lengths}})
    (out, _) = ex.step()
    assert len(ex.cache) == 4  # 8 s, 8 s and 4 s of the first clip; the second clip
    assert torch.equal(out.data["audio_embeds"], torch.cat(whole))


@pytest.mark.parametrize(
    ("louder", "encoded"),
    [
        (None, [2, 2, 1]),  # each request: its new window and its new tail
        ((10.0, 12.0), [2, 3, 1]),  # louder audio at 10 s changes the features of window 1
    ],
    ids=["steady", "louder-later"],
)
def test_a_turn_prefilled_in_chunks_answers_as_one_prefill(
    tiny_dir: Path, louder: tuple[float, float] | None, encoded: list[int]
) -> None:
    audio = voice(louder=louder)
    kept, fresh = pipeline(), pipeline()
    counts, whole_counts = count_windows(kept), count_windows(fresh)
    for i, cut in enumerate(CUTS_S):
        kept.submit(f"p{i}", payload(audio[: int(cut * RATE)], session_id="s", prefill_only=True))
        kept.run()
        assert not kept.outputs[f"p{i}"]  # no token, no frame: the stream just ends
    got = answer(kept, "a", payload(audio, session_id="s"))
    ref = answer(fresh, "a", payload(audio))
    assert got["ids"] == ref["ids"] and got["ids"]
    np.testing.assert_array_equal(got["codes"], ref["codes"])
    assert counts == encoded and whole_counts == [3]
    # Everything up to the end of the turn's second window was prefilled while it was spoken.
    assert got["cached"] == audio_start(kept, payload(audio)) + 2 * 104
    assert ref["cached"] == 0


def test_a_prefill_only_request_leaves_its_kept_row_and_nothing_else(tiny_dir: Path) -> None:
    audio = voice()
    p = pipeline(max_prefill_tokens_per_step=64)
    thinker = p.stages["thinker"].executor

    def clean() -> None:
        for name, stage in p.stages.items():
            held = getattr(stage.executor, "reqs", None) or getattr(stage.executor, "todo", None)
            assert stage.active == 0 and not held, name
            assert not p.router.outbox[name] and not p.router.inbound[name], name
        assert not p.router.routes and not p.open
        assert thinker.cache.in_use() == 1 and list(thinker.sessions) == ["s"]  # type: ignore[attr-defined]
        talker = p.stages["talker_ar"].executor
        assert talker.cache.in_use() == 0  # type: ignore[attr-defined]

    p.submit("p0", payload(audio[: 9 * RATE], session_id="s", prefill_only=True))
    p.run()
    clean()
    # Aborted in its prefill (64 tokens a step): what it prefilled stays kept, and no more.
    p.submit("p1", payload(audio[: 17 * RATE], session_id="s", prefill_only=True))
    for _ in range(100):
        p.step()
        r = thinker.reqs.get("p1")  # type: ignore[attr-defined]
        if r is not None and r.prefilled > r.cached:  # past the prefix p0 left: one chunk
            break
    assert r is not None and r.cached == audio_start(p, payload(audio)) + 104
    prefilled = r.prefilled
    p.abort("p1")
    clean()
    assert thinker.sessions._kept["s"][1].shape[0] == prefilled  # type: ignore[attr-defined]
    assert thinker.cache.lens[thinker.sessions._kept["s"][0]] == prefilled  # type: ignore[attr-defined]
    got = answer(p, "a", payload(audio, session_id="s"))
    ref = answer(pipeline(), "a", payload(audio))
    assert got["ids"] == ref["ids"] and got["cached"] == prefilled


def test_an_answer_waits_for_its_sessions_prefill_only_request(tiny_dir: Path) -> None:
    """Submitted together, the answer takes the row the prefill-only request keeps."""
    audio = voice()
    p = pipeline()
    p.submit("p", payload(audio[: 17 * RATE], session_id="s", prefill_only=True))
    got = answer(p, "a", payload(audio, session_id="s"))
    assert got["cached"] == audio_start(p, payload(audio)) + 2 * 104


def test_a_prefill_only_request_leaves_out_the_image_after_the_turns_audio() -> None:
    from realtime_omni.models.qwen3_omni.preprocessing import _without_trailing_images

    turn = {"role": "user", "content": [
        {"type": "image", "image": "before"}, {"type": "audio", "audio": "turn"},
        {"type": "text", "text": "this?"}, {"type": "image", "image": "camera"}]}  # fmt: skip
    kept = _without_trailing_images([SYSTEM, turn])
    assert [p.get("image") or p["type"] for p in kept[1]["content"]] == ["before", "audio", "text"]
    typed = {"role": "user", "content": [{"type": "image", "image": "camera"}]}
    assert _without_trailing_images([SYSTEM, typed]) == [SYSTEM, typed]  # no audio: no growth
