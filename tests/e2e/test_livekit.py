"""LiveKit Agents (`livekit-agents` 1.8.9 with `livekit-plugins-openai`) on the Realtime API,
against a real `realtime-omni serve`: the plugin's `RealtimeModel` at its defaults (semantic_vad,
input transcription, the voice "marin") in an `AgentSession` with no room, run by
`clients/livekit_call.py` in its own environment (`.cache/venvs/livekit`, the Makefile). The
thinker is `test_tools`'s scripted one, so the model calls the tool; the talker speaks at most
2.4 s an answer, which keeps the call short."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.e2e.conftest import serving
from tests.e2e.test_tools import ANSWER, CALL, CLIENTS, SAY_FIRST, pcm_file, run_client

pytestmark = pytest.mark.slow

LIVEKIT_PY = CLIENTS / "livekit" / "bin" / "python"
MAX_FRAMES = 30  # talker frames an answer (80 ms each)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not LIVEKIT_PY.exists():
        pytest.skip(f"LiveKit Agents' environment is missing ({LIVEKIT_PY}): run `make install`")
    d = tmp_path_factory.mktemp("livekit")
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    thinker = cfg["stages"]["thinker"]
    thinker["executor"] = "tests.e2e.executors:ScriptedThinker"
    thinker["params"].update(call=CALL, answer=ANSWER, record_to=str(d / "thinker.jsonl"))
    cfg["stages"]["talker_ar"]["params"]["max_frames"] = MAX_FRAMES
    path = d / "livekit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serving("--max-sessions", "1", config=path) as url:
        yield url


def test_livekit_agents_calls_the_tool_speaks_and_is_interrupted_at_its_first_audio(
    server: str, speech: Any, tmp_path: Path
) -> None:
    """A typed turn (`session.run`) whose answer calls the tool and then speaks, played to the
    end; then speech in, and speech again at the first audio of its answer, which is cut there.
    Every server event parses as the plugin's `openai` types (and, on the way out of `serving`,
    as this environment's); the session reports no error."""
    summary = run_client(
        LIVEKIT_PY, "livekit_call.py", f"{server}/v1", pcm_file(speech, tmp_path), tmp_path
    )
    assert summary["errors"] == [], summary
    assert summary["invalid"] == {}, summary["invalid"]
    # On an interruption the plugin sends response.cancel twice (its session's and its
    # activity's); OpenAI refuses the second as this server does, and the plugin drops that one
    # error by its message.
    for e in summary["error_events"]:
        assert e["code"] == "response_cancel_not_active", summary["error_events"]
        assert e["message"].startswith("Cancellation failed"), e
    assert summary["tools"] == [
        {
            "name": "get_weather",
            "arguments": {"city": "Paris"},
            "output": summary["tools"][0]["output"],
        }
    ]
    assert '"sunny": true' in summary["tools"][0]["output"]
    # The typed turn: its reply matched to the request, the tool's round trip, the answer.
    run = summary["run"]
    assert run.index("function_call") < run.index("function_call_output") < len(run) - 1, run
    assert summary["answer"] == [SAY_FIRST, ANSWER]
    # Audio out: both answers of the typed turn played whole, then the spoken turn's answer
    # cut after its first frames (the session cleared the speaker, the message says so).
    whole, cut = summary["audio"][1], summary["audio"][2]
    assert summary["audio"][0] > 0 and whole > 0 and 0 < cut < whole, summary["audio"]
    assert summary["spoken_answers"] >= 1 and summary["cleared"] >= 1, summary
    assert summary["interrupted"][:3] == [False, False, True], summary["interrupted"]
    server_events = summary["server"]
    for kind in (
        "response.function_call_arguments.done",
        "input_audio_buffer.speech_started",  # audio in: the server's VAD heard it
        "conversation.item.input_audio_transcription.completed",  # the plugin's default
        "conversation.item.truncated",  # the plugin truncates what was not heard
    ):
        assert kind in server_events, kind
