"""Prefill while the person speaks, in the simulated graph's seven real processes: a prefill-only
request makes no output, costs no talker or vocoder time and leaves nothing behind, finished or
aborted; every request's stream says what it cost each stage."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from realtime_omni.errors import RequestAborted
from realtime_omni.pipeline.config import parse_config
from realtime_omni.pipeline.coordinator import Coordinator
from tests.conftest import run, simulated_config, timeout
from tests.integration.test_pipeline import all_slots_free, check_complete

RATE = 16000


def speech(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(20 * RATE).astype(np.float32)


SPEECH = {"s": speech(0), "other": speech(1)}  # per session: the encoder keeps what it saw


def turn(seconds: float, session: str, **extra: Any) -> dict[str, Any]:
    """A conversation whose last user turn is the first `seconds` of the session's speech."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "audio", "audio": "a0"}]}]  # fmt: skip
    audio = SPEECH[session][: int(seconds * RATE)]
    return {"messages": messages, "a0": audio, "session_id": session, "max_tokens": 3, **extra}


def config(time_scale: float = 1.0) -> Any:
    """The simulated graph with the gateway's 4 MiB entry slots (a turn carries its audio)."""
    data = simulated_config(time_scale)
    data["edges"].append({"src": "client", "dst": "preprocessing", "slot_bytes": 4 << 20})
    return parse_config(data)


async def settled(stream: Any) -> dict[str, float]:
    await asyncio.wait_for(stream.settled.wait(), 10)
    return dict(stream.compute_s)


def test_a_turn_prefilled_while_spoken_costs_its_answer_only_the_rest() -> None:
    async def body() -> None:
        async with Coordinator(config()) as coord:
            for seconds in (8.5, 16.5):
                stream = await coord.submit(turn(seconds, "s", prefill_only=True))
                assert await stream.collect() == {}  # no text, no audio: a clean end
                spent = await settled(stream)
                assert spent.keys() == {"preprocessing", "audio_encoder", "thinker"}
            answer = await coord.submit(turn(20, "s"))
            check_complete(await answer.collect(), 3)
            whole = await coord.submit(turn(20, "other"))
            check_complete(await whole.collect(), 3)
            a, w = await settled(answer), await settled(whole)
            # The answer's audio encoder had its 4 s tail left (52 tokens, not 260: a pass at
            # its floor, 60 ms, against 120); its thinker 104 + 52 + 784 tokens of 1,344 to
            # prefill (the context and window 1 kept: 74 ms less at 0.183 ms a token), beside
            # the same decode steps.
            assert a["audio_encoder"] < 0.6 * w["audio_encoder"]
            assert a["thinker"] < w["thinker"] - 0.037
            assert a["talker_ar"] == pytest.approx(w["talker_ar"], rel=0.5)
            await all_slots_free(coord)
            assert coord.in_flight == 0

    run(body())


def test_an_aborted_prefill_only_request_leaves_nothing_behind() -> None:
    async def body() -> None:
        async with Coordinator(config()) as coord:
            # 60 s of audio: the thinker prefills 300 + 780 tokens in chunks of 512 (94 ms each)
            long = {**turn(0, "s", prefill_only=True), "a0": np.tile(SPEECH["s"], 3)}
            stream = await coord.submit(long)

            async def busy(stage: str) -> float:
                stats = await coord.stats()
                return sum(st.busy_s.get(stage, 0.0) for st in stats.values())

            while not await busy("thinker"):  # its first chunk is done, the next one runs
                await asyncio.sleep(0.005)
            await coord.abort(stream.request_id)
            with pytest.raises(RequestAborted):
                await stream.collect()
            assert stream.settled.is_set()
            await all_slots_free(coord)
            assert coord.in_flight == 0
            for _ in range(100):  # a step the abort came in is reported once it ends
                if stream.compute_s.get("thinker", 0) > 0.1:
                    break
                await asyncio.sleep(0.01)
            assert stream.compute_s.keys() == {"preprocessing", "audio_encoder", "thinker"}
            assert stream.compute_s["thinker"] == pytest.approx(await busy("thinker"))
            answer = await coord.submit(turn(20, "s"))  # the session goes on
            check_complete(await answer.collect(), 3)

    run(body())


def test_a_step_an_abort_came_in_is_charged_once_it_ends() -> None:
    """The abort is acknowledged at once; the step's seconds follow when it ends (`Spent`)."""

    async def body() -> None:
        one = {"name": "one", "entry": "a", "stages": {"a": {
            "executor": "simulated", "terminal": True,
            "params": {"role": "transform", "first_step_ms": 600}}}}  # fmt: skip
        async with Coordinator(parse_config(one)) as coord:
            stream = await coord.submit({})
            await asyncio.sleep(0.3)
            t0 = asyncio.get_running_loop().time()
            await coord.abort(stream.request_id)
            assert asyncio.get_running_loop().time() - t0 < timeout(0.25)  # not waiting for it
            assert stream.compute_s == {}
            for _ in range(200):
                if stream.compute_s:
                    break
                await asyncio.sleep(0.01)
            assert stream.compute_s["a"] == pytest.approx(0.6, abs=0.2)

    run(body())
