"""SIP calls against a real `realtime-omni serve --sip-port 0` (the simulated config), from real
SIP peers of Debian's packages: baresip (a softphone: it plays a WAV into the call and records
what it receives) and SIPp (scripted signalling: DTMF, hold, refusals, OPTIONS)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from string import Template
from typing import Any

import numpy as np
import pytest
import yaml

from realtime_omni.clients.baresip import dial, loud, recordings, write_wav
from realtime_omni.gateway.media.audio import resample
from tests.conftest import ROOT, free_port, timeout
from tests.e2e.conftest import serving
from tests.e2e.test_webrtc import assert_pipeline_idle, get_json, settle

SCENARIOS = Path(__file__).parent / "sip"
LOUD = 1500  # int16: the simulated tone peaks near 3,300 after G.711
IDLE_S = 9.0  # longer than the other tests' silences

pytestmark = pytest.mark.skipif(
    not (shutil.which("baresip") and shutil.which("sipp")),
    reason="SIP peers not installed (apt-get install baresip sip-tester)",
)


@pytest.fixture(scope="module")
def sip_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    pytest.importorskip("pjsua2")
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["phone"] = {
        "idle_timeout_s": IDLE_S,
        "goodbye_max_s": 2.0,
        "routes": {"default": {"session": {"max_output_tokens": 40}}},
    }
    cfg["sip"] = {"allowed_peers": ["127.0.0.1"], "rtp_port": 41000, "rtp_port_range": 200}
    path = Path(tmp_path_factory.mktemp("sip")) / "sip.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lines: list[str] = []
    with serving("--sip-port", "0", config=path, startup=lines) as url:
        found = [m for ln in lines if (m := re.search(r"SIP on udp:([\d.]+):(\d+)", ln))]
        assert found, lines
        yield url, int(found[0].group(2))


def sipp(tmp: Path, port: int, scenario: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sipp", f"127.0.0.1:{port}", "-sf", str(scenario), "-p", str(free_port()),
         "-mp", str(free_port()), "-m", "1", "-nostdin", "-timeout", "20s", "-trace_err",
         *args],
        cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def poll_calls(url: str, stop: threading.Event, seen: list[dict[str, Any]]) -> None:
    """Every SIP call /v1/stats shows, until `stop`."""
    while not stop.is_set():
        seen.extend(c for c in get_json(f"{url}/v1/stats")["phone"] if c["provider"] == "sip")
        time.sleep(0.05)


def test_baresip_call_hears_the_answer_barges_in_and_hangs_up(
    sip_server: tuple[str, int], speech: np.ndarray, tmp_path: Path
) -> None:
    url, port = sip_server
    before = get_json(f"{url}/v1/stats")["gateway_process"]
    say = resample(speech, 24000, 8000)
    gap = np.zeros(8000 * 3, np.float32)
    source = tmp_path / "caller.wav"
    write_wav(source, np.concatenate([np.zeros(4000, np.float32), say, gap, say, gap]))
    seconds = int(0.5 + 2 * (len(say) / 8000 + 3)) + 1
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_calls, args=(url, stop, seen))
    poller.start()
    try:
        proc = dial(tmp_path, f"sip:bot@127.0.0.1:{port}", source, seconds)
        assert proc.wait(timeout=timeout(seconds + 20)) == 0
    finally:
        stop.set()
        poller.join()
    enc, dec = recordings(tmp_path)
    sent, got = loud(enc, LOUD, 800), loud(dec, LOUD, 800)  # what the caller sent and received
    # the caller's two utterances, in 100 ms steps of the call's own timeline
    onsets = [i for i in range(1, len(sent)) if sent[i] and not any(sent[max(0, i - 8) : i])]
    assert len(onsets) == 2, sent
    first, second = onsets
    assert any(got[first:second]), "no answer arrived between the two utterances"
    assert not any(got[:first]), "audio before anything was said"
    # the barge-in: silence from at most 600 ms after the second onset until the speech ends
    speech_end = second + int(len(say) / 800)
    assert not any(got[second + 6 : speech_end]), (got, second)
    # the server kept only what went out, and the hang-up ended the session
    answers = [i for c in seen for i in c["items"] if i["role"] == "assistant"]
    cut = [i for i in answers if i["status"] == "incomplete"]
    assert cut, seen[-1:]
    sent_ms = max((c["sent_ms"].get(cut[-1]["id"], 0) for c in seen), default=0)
    assert 0 < cut[-1]["audio_ms"] <= sent_ms
    st = asyncio.run(settle(url))
    assert st["sessions"] == 0 and st["phone"] == []
    assert_pipeline_idle(st)
    after = st["gateway_process"]  # the call's RTP socket and threads are gone
    assert after["udp_sockets"] <= before["udp_sockets"], (before, after)
    assert after["threads"] <= before["threads"], (before, after)
    assert after["fds"] <= before["fds"] + 2, (before, after)  # a first call's lazy opens


def test_dtmf_hold_and_resume_keep_the_call(sip_server: tuple[str, int], tmp_path: Path) -> None:
    url, port = sip_server
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_calls, args=(url, stop, seen))
    poller.start()
    try:
        proc = sipp(tmp_path, port, SCENARIOS / "invite_dtmf_hold_bye.xml")
        _, err = proc.communicate(timeout=timeout(30))
        assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        stop.set()
        poller.join()
    assert seen, "the call never showed in /v1/stats"
    assert len({c["session_id"] for c in seen}) == 1  # one session through hold and resume
    holds = [c["on_hold"] for c in seen]
    assert True in holds and holds[-1] is False, holds
    assert max(c["dtmf_digits"] for c in seen) >= 1
    st = asyncio.run(settle(url))
    assert st["sessions"] == 0 and st["phone"] == []


def test_rtp_from_a_stranger_leaves_the_call_and_its_session(
    sip_server: tuple[str, int], tmp_path: Path
) -> None:
    """Forged RTP at every port of the call's range while SIPp's call is up: the call goes on
    through hold and resume to its BYE, in one session, and nothing of it is left after."""
    url, port = sip_server
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_calls, args=(url, stop, seen))
    poller.start()
    rogue = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        proc = sipp(tmp_path, port, SCENARIOS / "invite_dtmf_hold_bye.xml")
        time.sleep(1.0)
        for seq in range(20):  # RTP v2, PCMU, loud noise
            packet = bytes([0x80, 0, 0, seq]) + bytes(8) + bytes([0x10]) * 160
            for p in range(41000, 41200):
                rogue.sendto(packet, ("127.0.0.1", p))
            time.sleep(0.02)
        _, err = proc.communicate(timeout=timeout(30))
        assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        rogue.close()
        stop.set()
        poller.join()
    assert len({c["session_id"] for c in seen}) == 1
    st = asyncio.run(settle(url))
    assert st["sessions"] == 0 and st["phone"] == []
    assert_pipeline_idle(st)


@pytest.mark.parametrize(
    ("status", "pt", "codec", "local_ip"),
    [(488, "18", "G729", "127.0.0.1"), (403, "0", "PCMU", "127.0.0.2")],
)
def test_refused_invites_get_their_status_and_leave_nothing(
    sip_server: tuple[str, int], tmp_path: Path, status: int, pt: str, codec: str, local_ip: str
) -> None:
    url, port = sip_server
    scenario = tmp_path / "refused.xml"
    text = Template((SCENARIOS / "refused_invite.xml").read_text())
    scenario.write_text(text.substitute(status=status, pt=pt, codec=codec))
    proc = sipp(tmp_path, port, scenario, "-i", local_ip)
    _, err = proc.communicate(timeout=timeout(30))
    assert proc.returncode == 0, err.decode()[-2000:]
    st = get_json(f"{url}/v1/stats")
    assert st["sessions"] == 0 and st["phone"] == []


def test_options_is_answered(sip_server: tuple[str, int], tmp_path: Path) -> None:
    _, port = sip_server
    proc = sipp(tmp_path, port, SCENARIOS / "options.xml")
    _, err = proc.communicate(timeout=timeout(30))
    assert proc.returncode == 0, err.decode()[-2000:]


def test_the_server_registers_with_a_trunk_using_credentials_from_the_environment(
    tmp_path: Path,
) -> None:
    """SIPp as the trunk's registrar: it challenges the REGISTER and answers 200 only to the
    configured user and the password from the environment (403 otherwise)."""
    pytest.importorskip("pjsua2")
    registrar_port = free_port()
    registrar = subprocess.Popen(
        ["sipp", "-sf", str(SCENARIOS / "registrar.xml"), "-i", "127.0.0.1",
         "-p", str(registrar_port), "-m", "1", "-nostdin", "-timeout", "30s", "-trace_err"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["sip"] = {
        "rtp_port": 41400,
        "registration": {
            "registrar": f"sip:127.0.0.1:{registrar_port}",
            "user": "realtime-bot",
            "realm": "trunk.example.com",
            "password_env": "RTO_TEST_TRUNK_PASSWORD",
        },
    }
    path = tmp_path / "trunk.yaml"
    path.write_text(yaml.safe_dump(cfg))
    os.environ["RTO_TEST_TRUNK_PASSWORD"] = "s3cret"
    try:
        with serving("--sip-port", "0", config=path) as url:
            deadline = time.monotonic() + timeout(10)
            while time.monotonic() < deadline:
                status = get_json(f"{url}/v1/stats")["sip"]["registration"]
                if status is not None and status != 401:
                    break
                time.sleep(0.1)
            assert status == 200, status
        _, err = registrar.communicate(timeout=timeout(10))
        assert registrar.returncode == 0, err.decode()[-2000:]
    finally:
        os.environ.pop("RTO_TEST_TRUNK_PASSWORD", None)
        if registrar.poll() is None:
            registrar.kill()


def test_an_idle_caller_gets_a_goodbye_and_the_servers_bye_over_pcma(
    sip_server: tuple[str, int], tmp_path: Path
) -> None:
    url, port = sip_server
    t0 = time.monotonic()
    proc = sipp(tmp_path, port, SCENARIOS / "invite_wait_bye.xml")
    _, err = proc.communicate(timeout=timeout(IDLE_S + 25))
    assert proc.returncode == 0, err.decode()[-2000:]  # the BYE came, and was answered
    assert time.monotonic() - t0 >= IDLE_S
    st = asyncio.run(settle(url))
    assert st["sessions"] == 0 and st["phone"] == []
    assert_pipeline_idle(st)
