"""SIP calls against a real `realtime-omni serve --sip-port 0` (the simulated config), from real
SIP peers of Debian's packages: baresip (a softphone: it plays a WAV into the call and records
what it receives) and SIPp (scripted signalling: DTMF, hold, refusals, OPTIONS)."""

from __future__ import annotations

import asyncio
import glob
import re
import shutil
import subprocess
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from string import Template
from typing import Any

import numpy as np
import pytest
import yaml

from realtime_omni.gateway.audio import float_to_pcm16, resample
from tests.conftest import ROOT, timeout
from tests.e2e.conftest import _free_port, serving
from tests.e2e.test_phone import settle
from tests.e2e.test_webrtc import assert_pipeline_idle, get_json

SCENARIOS = Path(__file__).parent / "sip"
LOUD = 1500  # int16: the simulated tone peaks near 3,300 after G.711

pytestmark = pytest.mark.skipif(
    not (shutil.which("baresip") and shutil.which("sipp")),
    reason="SIP peers not installed (apt-get install baresip sip-tester)",
)


@pytest.fixture(scope="module")
def sip_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    pytest.importorskip("pjsua2")
    cfg = yaml.safe_load((ROOT / "configs" / "simulated-qwen3-omni.yaml").read_text())
    cfg["phone"] = {"routes": {"default": {"session": {"max_output_tokens": 40}}}}
    cfg["sip"] = {"allowed_peers": ["127.0.0.1"], "rtp_port": 41000, "rtp_port_range": 200}
    path = Path(tmp_path_factory.mktemp("sip")) / "sip.yaml"
    path.write_text(yaml.safe_dump(cfg))
    lines: list[str] = []
    with serving("--sip-port", "0", config=path, startup=lines) as url:
        found = [m for ln in lines if (m := re.search(r"SIP on udp:([\d.]+):(\d+)", ln))]
        assert found, lines
        yield url, int(found[0].group(2))


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(float_to_pcm16(pcm))


def read_wav(path: str) -> np.ndarray:
    with wave.open(path) as w:
        assert w.getframerate() == 8000
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.int32)


def loud_spans(x: np.ndarray, step: int = 800) -> list[bool]:
    """Per 100 ms at 8 kHz: is anything loud in it."""
    return [bool(np.abs(x[i : i + step]).max() > LOUD) for i in range(0, len(x) - step + 1, step)]


def baresip(tmp: Path, source: Path, uri: str, seconds: int) -> subprocess.Popen[bytes]:
    """baresip calling `uri` once with `source` as its microphone, recording what it gets
    (`sndfile`: dump-*-dec.wav) and hanging up after `seconds`."""
    cfg, rec = tmp / "baresip", tmp / "rec"
    cfg.mkdir()
    rec.mkdir()
    rtp = _free_port()
    (cfg / "config").write_text(
        "\n".join(
            [
                "poll_method epoll",
                "sip_listen 127.0.0.1:0",
                "net_interface 127.0.0.1",
                "audio_player none,none",
                "audio_alert none,none",
                f"audio_source aufile,{source}",
                "ausrc_srate 8000",
                "ausrc_channels 1",
                f"rtp_ports {rtp}-{rtp + 1}",
                "module_path /usr/lib/baresip/modules",
                "module g711.so",
                "module aufile.so",
                "module sndfile.so",
                "module_tmp account.so",
                "module_app menu.so",
                f"snd_path {rec}",
                "",
            ]
        )
    )
    (cfg / "accounts").write_text("<sip:caller@127.0.0.1>;regint=0;audio_codecs=pcmu;mwi=no\n")
    (cfg / "contacts").write_text("")
    return subprocess.Popen(
        ["baresip", "-f", str(cfg), "-e", f"/dial {uri}", "-t", str(seconds)],
        cwd=tmp,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def sipp(tmp: Path, port: int, scenario: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sipp", f"127.0.0.1:{port}", "-sf", str(scenario), "-p", str(_free_port()),
         "-mp", str(_free_port()), "-m", "1", "-nostdin", "-timeout", "20s", "-trace_err",
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
    say = resample(speech, 24000, 8000)
    gap = np.zeros(8000 * 3, np.float32)
    source = tmp_path / "caller.wav"
    write_wav(source, np.concatenate([np.zeros(4000, np.float32), say, gap, say, gap]), 8000)
    seconds = int(0.5 + 2 * (len(say) / 8000 + 3)) + 1
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_calls, args=(url, stop, seen))
    poller.start()
    try:
        proc = baresip(tmp_path, source, f"sip:bot@127.0.0.1:{port}", seconds)
        assert proc.wait(timeout=timeout(seconds + 20)) == 0
    finally:
        stop.set()
        poller.join()
    (dec,) = glob.glob(str(tmp_path / "rec" / "dump-*-dec.wav"))  # what the caller received
    (enc,) = glob.glob(str(tmp_path / "rec" / "dump-*-enc.wav"))  # what it sent
    got, sent = loud_spans(read_wav(dec)), loud_spans(read_wav(enc))
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
