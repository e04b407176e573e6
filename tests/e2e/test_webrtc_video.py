"""A real aiortc caller with a camera against `realtime-omni serve`: the latest camera frame goes
with the next turn as an image.

The served config is the simulated one whose entry stage also records what each turn carried
into the pipeline (tests/e2e/executors.py). Neither `/v1/stats` nor the events could tell: every
turn steps the image encoder (a turn without an image passes through it as `{n: 0}`), and the
frame joins the turn's request, not the user's conversation item."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from realtime_omni.clients.webrtc import Caller, Camera
from realtime_omni.gateway.media.audio import resample
from tests.conftest import run, simulated_config, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import assert_pipeline_idle, settle, short_answers

ORANGE = (220, 120, 30)  # far from grey and unlike its channel swaps (BGR, YUV read as RGB)
BLUE = (30, 60, 210)
COLOUR_TOLERANCE = 16  # VP8 and two YUV <-> RGB conversions keep a flat colour within a few


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("video") / "payloads.jsonl"


@pytest.fixture(scope="module")
def server(recording: Path) -> Iterator[str]:
    cfg = simulated_config()
    entry = cfg["stages"][cfg["entry"]]
    entry["executor"] = "tests.e2e.executors:PayloadRecorder"
    entry["params"]["record_to"] = str(recording)
    config = recording.with_name("config.yaml")
    config.write_text(yaml.safe_dump(cfg))
    with serving("--max-sessions", "2", "--ice-host-address", "127.0.0.1", config=config) as url:
        yield url


@pytest.fixture(scope="module")
def speech48(speech: np.ndarray) -> np.ndarray:
    return resample(speech, 24000, 48000)


def carried(recording: Path, response_id: str) -> dict[str, Any]:
    """What the entry stage got for the turn answered by `response_id`."""
    for line in recording.read_text().splitlines():
        record = json.loads(line)
        if record["request_id"] == response_id:
            return record
    raise AssertionError(f"the entry stage recorded no request {response_id}")


async def turn(caller: Caller, speech48: np.ndarray) -> str:
    """Say `speech48`; the id of the completed response."""
    t = time.monotonic()
    caller.mic.say(np.concatenate([speech48, np.zeros(24000, np.float32)]))
    _, done = await caller.wait_for("response.done", timeout(20), since=t)
    assert done["response"]["status"] == "completed", done
    return str(done["response"]["id"])


def assert_colour(image: dict[str, Any], rgb: tuple[int, int, int]) -> None:
    assert image["shape"] == [240, 320, 3], image  # Camera's size: below the gateway's limit
    err = np.abs(np.asarray(image["mean_rgb"]) - rgb).max()
    assert err < COLOUR_TOLERANCE, (image["mean_rgb"], rgb)


def test_the_latest_camera_frame_goes_with_each_turn(
    server: str, recording: Path, speech48: np.ndarray
) -> None:
    async def body() -> None:
        camera = Camera(ORANGE)
        seeing, blind = Caller(server, camera=camera), Caller(server)
        try:
            for c in (seeing, blind):
                await c.connect(limit_s=timeout(10))
                await short_answers(c, 2)
            # The call without a camera talks at the same time: the contrary case, for free.
            first, plain = await asyncio.gather(turn(seeing, speech48), turn(blind, speech48))
            camera.rgb = BLUE  # the camera now sees something else; the next turn must too
            second = await turn(seeing, speech48)
        finally:
            await asyncio.gather(seeing.hang_up(), blind.hang_up())

        got = carried(recording, first)
        assert got["content"] == ["audio", "image"], got  # the frame joins the user's turn
        (image,) = got["images"]
        assert_colour(image, ORANGE)

        got = carried(recording, plain)
        assert got["content"] == ["audio"] and got["images"] == [], got

        got = carried(recording, second)
        assert got["content"] == ["audio", "image"], got
        (image,) = got["images"]  # only the latest frame: the first turn's is not sent again
        assert_colour(image, BLUE)

        st = await settle(server)
        assert st["sessions"] == 0
        assert_pipeline_idle(st)

    run(body(), 60)
