"""OpenAI's Live API (`/v1/live/sessions`) against a real `realtime-omni serve`, driven by the two
frameworks that speak it, each in its own environment (the Makefile's `.cache/venvs/`):
LiveKit Agents' `GPTLiveModel` (`clients/livekit_live.py`) and Pipecat's `OpenAILiveLLMService`
(`clients/pipecat_live.py`). The thinker is `test_tools`'s scripted one: a turn calls the
`delegate` function (client delegation), a turn after its result answers `ANSWER`; the talker
speaks at most 2.4 s an answer. Each shows speech in, the delegation handed to the client and
its result taken back, the answer spoken and transcribed, a barge-in the server decides (the
client has no way to cancel) and a clean `session.closed`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.e2e.conftest import serving
from tests.e2e.test_tools import ANSWER, CLIENTS, SAY_FIRST, pcm_file, run_client

pytestmark = pytest.mark.slow

LIVEKIT_PY = CLIENTS / "livekit" / "bin" / "python"
PIPECAT_PY = CLIENTS / "pipecat" / "bin" / "python"
MAX_FRAMES = 30  # talker frames an answer (80 ms each): 2.4 s
DELEGATE = '{"name": "delegate", "arguments": {"request": "the weather in Paris"}}'
CALL = f"{SAY_FIRST}<tool_call>\n{DELEGATE}\n</tool_call>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    d = tmp_path_factory.mktemp("live")
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    thinker = cfg["stages"]["thinker"]
    thinker["executor"] = "tests.e2e.executors:ScriptedThinker"
    record = d / "thinker.jsonl"
    thinker["params"].update(call=CALL, answer=ANSWER, record_to=str(record))
    # Greedy: a sampled random-weight talker can draw its codec end early (an answer of 21
    # frames, not 30, in one suite run), and the answers' lengths are what the test reads.
    cfg["stages"]["talker_ar"]["params"].update(max_frames=MAX_FRAMES, temperature=0.0)
    path = d / "live.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with serving("--max-sessions", "1", config=path) as url:
        yield url, record


def _prompts(record: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in record.read_text().splitlines()]


def _check_barge_in(summary: dict[str, Any]) -> None:
    """The answer the person spoke over stopped early; the first turn's answers (what the
    model said before delegating, then the whole 2.4 s answer) made at least 2.4 s of audio.
    Not its longest run: an underrun of 300 ms on a busy machine splits a run in two."""
    runs = [end - start for start, end in summary["runs"]]
    cut = runs[summary["cut_run"]]
    assert summary["loud_ms_first"] >= MAX_FRAMES * 80 and cut < 1500, summary["runs"]


def test_livekit_gpt_live_model(server: tuple[str, Path], speech: Any, tmp_path: Path) -> None:
    """LiveKit's `GPTLiveModel` (delegation="client") in an `AgentSession` with no room."""
    if not LIVEKIT_PY.exists():
        pytest.skip(f"LiveKit Agents' environment is missing ({LIVEKIT_PY}): run `make install`")
    url, record = server
    pcm = pcm_file(speech, tmp_path)
    summary = run_client(LIVEKIT_PY, "livekit_live.py", f"{url}/v1", pcm, tmp_path)
    assert summary["errors"] == [] and summary["error_events"] == [], summary
    events = summary["server"]
    assert events.get("session.started") == 1 and events.get("session.closed") == 1, events
    assert summary["session_id"].startswith("sess_")
    # Speech in, heard and transcribed on the input timeline.
    assert summary["heard"] and all(0 <= s <= e for s, e in summary["heard_spans"]), summary
    # The delegation, answered by append_commentary: its result reached the model.
    assert len(summary["delegations"]) == 1, summary
    assert any('{"city": "Paris", "sunny": true}' in p for p in _prompts(record))
    assert SAY_FIRST in summary["said"] and ANSWER in summary["said"], summary["said"]
    assert events.get("session.usage.updated", 0) >= 1
    assert sum(summary["speaker_frames"]) > 0, summary  # the framework played the answers
    _check_barge_in(summary)


def test_pipecat_openai_live_service(server: tuple[str, Path], speech: Any, tmp_path: Path) -> None:
    """Pipecat's `OpenAILiveLLMService` (no delegation backend: it answers a delegation itself,
    with its decline) in a pipeline with its context aggregators and no transport."""
    if not PIPECAT_PY.exists():
        pytest.skip(f"Pipecat's environment is missing ({PIPECAT_PY}): run `make install`")
    url, record = server
    ws = url.replace("http://", "ws://") + "/v1/live/sessions"
    summary = run_client(PIPECAT_PY, "pipecat_live.py", ws, pcm_file(speech, tmp_path), tmp_path)
    assert summary["errors"] == [], summary
    events = summary["server"]
    assert events.get("session.started") == 1 and events.get("session.closed") == 1, events
    assert summary["closed_reason"] == "close_requested"
    assert summary["heard"] and "user" in summary["context"], summary  # transcribed turns
    assert len(summary["delegations"]) == 1, summary
    assert any("No backend is available" in p for p in _prompts(record))
    assert ANSWER in summary["said"], summary["said"]
    _check_barge_in(summary)
