"""Phone calls through the media-stream bridges against a real `realtime-omni serve` (the
simulated config): a scripted provider (`clients/media_stream.py`) speaks espeak-ng speech as
8 kHz mu-law, plays back what the server sends after a 200 ms jitter delay and echoes marks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets
import yaml

from realtime_omni.clients.media_stream import ProviderCall
from realtime_omni.clients.webrtc import http
from realtime_omni.gateway.media.audio import resample
from tests.conftest import ROOT, run, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import assert_pipeline_idle, get_json, settle

LOUD = 0.05  # the simulated tone peaks at 0.1
IDLE_S = 6.0
TOKENS = {"twilio": "e2e-twilio-auth-token", "plivo": "e2e-plivo-auth-token"}


def phone_config(tmp_path_factory: pytest.TempPathFactory, **phone: Any) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["phone"] = {
        "idle_timeout_s": IDLE_S,
        "goodbye_max_s": 2.0,
        "start_timeout_s": 2.0,
        "routes": {"default": {"session": {"max_output_tokens": 40}}},  # about 6 s of answer
        **phone,
    }
    path = Path(tmp_path_factory.mktemp("phone")) / "phone.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving("--max-sessions", "3", config=phone_config(tmp_path_factory)) as url:
        yield url


@pytest.fixture(scope="module")
def signed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The accounts' auth tokens set: Twilio's and Plivo's stream upgrades must be signed."""
    env = {"RTO_E2E_TWILIO_TOKEN": TOKENS["twilio"], "RTO_E2E_PLIVO_TOKEN": TOKENS["plivo"]}
    path = phone_config(
        tmp_path_factory,
        twilio_auth_token_env="RTO_E2E_TWILIO_TOKEN",
        plivo_auth_token_env="RTO_E2E_PLIVO_TOKEN",
    )
    with serving("--max-sessions", "3", config=path, env=env) as url:
        yield url


@pytest.fixture(scope="module")
def speech8(speech: np.ndarray) -> np.ndarray:
    return resample(speech, 24000, 8000)


def unplayed_s(call: ProviderCall) -> float:
    return (sum(n for _, n in call.received) - call.played_samples) / 8000


async def phone_stats(url: str) -> list[dict[str, Any]]:
    return (await asyncio.to_thread(get_json, f"{url}/v1/stats"))["phone"]


@pytest.mark.parametrize("provider", ["twilio", "telnyx", "plivo"])
def test_call_answer_barge_in_and_truncation_to_what_was_heard(
    server: str, speech8: np.ndarray, provider: str
) -> None:
    async def body() -> None:
        call = ProviderCall(server, provider, parameters={"instructions": "Be brief"})
        await call.connect()
        try:
            call.say(np.concatenate([np.zeros(2400, np.float32), speech8]))
            t_first = await call.wait_media(timeout(20))
            assert not call.clears
            (live,) = await phone_stats(server)
            assert live["provider"] == provider and live["call_id"] == call.call_id
            await asyncio.sleep(1.5)  # the caller hears about 1.3 s of the answer
            # ... and the provider holds more than the jitter delay's worth not yet played: a
            # slow machine's first chunks (new shapes, cold caches) can let it run dry for a
            # moment, when what was sent and what was heard are the same.
            deadline = time.monotonic() + timeout(5)
            while unplayed_s(call) < 0.2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            loud = [t for t, peak in call.played if peak > LOUD]
            assert loud, "the answer's audio did not play"
            call.say(speech8)  # talks over it
            t_say = time.monotonic()
            t_clear = await call.wait_clear(timeout(5))
            heard_s = call.played_samples / 8000
            received_s = sum(n for _, n in call.received) / 8000
            # the provider held the jitter delay's worth that was sent but never heard
            assert received_s - heard_s > 0.15, (received_s, heard_s)
            # the session kept what the marks said was heard, not what was sent
            deadline = time.monotonic() + timeout(5)
            while True:
                (live,) = await phone_stats(server)
                answer = next(i for i in live["items"] if i["role"] == "assistant")
                if answer["status"] == "incomplete" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert answer["status"] == "incomplete", live
            assert abs(answer["audio_ms"] - heard_s * 1000) <= 60, (answer, heard_s)
            assert answer["audio_ms"] < received_s * 1000 - 150, live
            # silence until the caller stops talking and the next answer starts
            end_of_speech = t_say + len(speech8) / 8000
            while call.saying:
                await asyncio.sleep(0.02)
            assert not [t for t, _ in call.received if t_clear < t < end_of_speech]
            assert t_clear - t_first > 1.0
        finally:
            await call.hang_up()
        st = await settle(server)
        assert st["sessions"] == 0 and st["phone"] == []
        assert_pipeline_idle(st)  # every stage let the aborted request go

    run(body(), 60)


def test_bad_input_is_dropped_and_the_call_goes_on(server: str, speech8: np.ndarray) -> None:
    async def body() -> None:
        # A stream that never starts is closed at start_timeout_s; nothing is left of it.
        async with websockets.connect(f"{server.replace('http', 'ws')}/v1/phone/twilio") as ws:
            await ws.send(json.dumps({"event": "media", "media": {"payload": "AAAA"}}))
            await ws.send("not json")
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), timeout(6))
        call = ProviderCall(server, "twilio")
        await call.connect()
        try:
            for bad in [
                "{not json",
                json.dumps([1, 2]),
                json.dumps({"event": "nonsense"}),
                json.dumps({"event": "media", "media": {"payload": "%%% not base64"}}),
                json.dumps({"event": "media", "media": {}}),
                json.dumps(call._start()),  # a second start
                json.dumps({"event": "mark", "mark": {"name": "never-sent"}}),
                json.dumps({"event": "dtmf", "dtmf": {"digit": "5"}}),
            ]:
                await call.send(bad)
            call.say(np.concatenate([np.zeros(2400, np.float32), speech8]))
            await call.wait_media(timeout(20))
            (live,) = await phone_stats(server)
            assert live["call_id"] == call.call_id  # the second start changed nothing
        finally:
            await call.hang_up()
        st = await settle(server)
        assert st["sessions"] == 0
        assert_pipeline_idle(st)

    run(body(), 60)


def test_idle_call_gets_a_goodbye_and_is_ended(server: str) -> None:
    async def body() -> None:
        call = ProviderCall(server, "telnyx")
        await call.connect()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(call.closed.wait(), timeout(IDLE_S + 15))
        finally:
            await call.hang_up()
        assert time.monotonic() - t0 >= IDLE_S
        assert call.received and call.received[0][0] - t0 >= IDLE_S  # the goodbye, spoken
        st = await settle(server)
        assert st["sessions"] == 0
        assert_pipeline_idle(st)

    run(body(), 60)


def test_twilio_voice_webhook_answers_twiml_for_the_stream(server: str) -> None:
    form = b"CallSid=CA123&From=%2B15550100&To=%2B15550199"
    status, headers, body = http(
        "POST",
        f"{server}/v1/phone/twilio/voice",
        form,
        "application/x-www-form-urlencoded",
        {"X-Forwarded-Proto": "https"},
    )
    assert status == 200 and headers["content-type"].startswith("application/xml")
    text = body.decode()
    host = server.removeprefix("http://")
    assert f'<Connect><Stream url="wss://{host}/v1/phone/twilio">' in text
    assert '<Parameter name="from" value="+15550100"/>' in text
    assert '<Parameter name="call_sid" value="CA123"/>' in text


@pytest.mark.parametrize("provider", ["twilio", "plivo", "telnyx"])
def test_with_the_accounts_token_set_a_stream_must_be_signed(
    signed_server: str, provider: str
) -> None:
    """Twilio and Plivo sign a stream's WebSocket upgrade with the account's auth token: one
    unsigned or signed with another token is refused (403) before it is accepted, a signed one
    becomes a call. Telnyx signs no upgrade, so its streams are taken without one."""

    async def body() -> None:
        if provider != "telnyx":
            for token in (None, "not-the-accounts-token"):
                forged = ProviderCall(signed_server, provider, auth_token=token)
                try:
                    with pytest.raises(websockets.InvalidStatus) as refused:
                        await forged.connect()
                finally:
                    if forged.ws is not None:  # taken after all: leave no call to the next test
                        await forged.hang_up()
                assert refused.value.response.status_code == 403
        call = ProviderCall(signed_server, provider, auth_token=TOKENS.get(provider))
        await call.connect()
        try:
            deadline = time.monotonic() + timeout(10)
            while not (live := await phone_stats(signed_server)):
                assert time.monotonic() < deadline, "the signed stream did not become a call"
                await asyncio.sleep(0.05)
            assert [c["call_id"] for c in live] == [call.call_id]
            assert live[0]["session_id"] is not None
        finally:
            await call.hang_up()
        st = await settle(signed_server)
        assert st["sessions"] == 0 and st["phone"] == []

    run(body(), 60)
