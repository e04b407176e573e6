"""semantic_vad on a real server: Smart Turn (a random-weight model of the real signature, on
disk, named by `realtime.smart_turn_dir`; or, with no setting, the real v3.2 that `make install`
put in `.cache/models/smart_turn/`) ends a turn that sounds complete sooner than the silence rule
would, with silero-vad judging the speech."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import yaml

from realtime_omni.models import smart_turn
from tests.conftest import ROOT, run
from tests.e2e.conftest import serving
from tests.e2e.test_realtime_ws import connect, send_audio, until


@pytest.fixture(scope="module")
def semantic_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests.models.random_smart_turn import build

    root = tmp_path_factory.mktemp("eot")
    model = build(root / "smart_turn", bias=6).parent  # every turn sounds complete
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["realtime"] = {"smart_turn_dir": str(model)}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serving(config=path) as url:
        yield url


async def turn_end_after_speech(url: str, speech: np.ndarray, turn_detection: dict) -> float:
    """ms from the end of the speech (in the audio) to the end of the turn the server found."""
    async with connect(url) as conn:
        await until(conn, "session.created")
        session = {"type": "realtime", "max_output_tokens": 4, "audio": {"input": {
            "turn_detection": turn_detection}}}  # fmt: skip
        await conn.send({"type": "session.update", "session": session})
        await until(conn, "session.updated")
        lead = np.zeros(12000, np.float32)
        tail = np.zeros(24000 * 3, np.float32)
        await send_audio(conn, np.concatenate([lead, speech, tail]), pace_s=0.1)
        stopped = await until(conn, "input_audio_buffer.speech_stopped", limit_s=20)
        voiced = np.flatnonzero(np.abs(speech) > 0.02 * np.abs(speech).max())
        speech_end_ms = (len(lead) + voiced[-1]) / 24  # espeak's own trailing silence left out
        return float(stopped.audio_end_ms - speech_end_ms)


def test_a_complete_turn_ends_at_the_models_word_not_after_the_silence(
    semantic_server: str, speech: np.ndarray
) -> None:
    async def body() -> tuple[float, float]:
        semantic = await turn_end_after_speech(
            semantic_server, speech, {"type": "semantic_vad", "eagerness": "low"}
        )
        silence = await turn_end_after_speech(
            semantic_server, speech, {"type": "server_vad", "silence_duration_ms": 1000}
        )
        return semantic, silence

    semantic, silence = run(body())
    # The model is asked after 200 ms of silence and says "complete"; low eagerness alone would
    # wait 8 s, the silence rule 1 s.
    assert semantic < 600, (semantic, silence)
    assert silence >= 900, (semantic, silence)


def test_out_of_the_box_the_real_smart_turn_ends_a_complete_question(speech: np.ndarray) -> None:
    """No `realtime.smart_turn_dir`: the server takes the installed v3.2 (its real weights), which
    hears "Hello, how are you today?" as complete; low eagerness alone would wait 1 s."""
    if not (smart_turn.DEFAULT_DIR / smart_turn.FILE_NAME).is_file():
        pytest.skip("Smart Turn is not installed (`make install` puts it in .cache/models/)")
    with serving() as url:  # the simulated config, as shipped: no realtime section
        semantic = run(
            turn_end_after_speech(url, speech, {"type": "semantic_vad", "eagerness": "low"})
        )
    assert semantic < 600, semantic
