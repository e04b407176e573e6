"""baresip (Debian's `baresip`) as a scripted SIP caller, for tests and benchmarks.

    proc = dial(workdir, "sip:bot@127.0.0.1:5060", microphone_wav, seconds=12)
    proc.wait()                                   # it hangs up after `seconds` and exits
    sent, received = recordings(workdir)          # int16 8 kHz: what it sent, what it got

It calls once from 127.0.0.1 with PCMU (plus telephone-event), plays `microphone_wav` (16-bit
mono 8 kHz; silence once it ends) into the call, and its `sndfile` module records both
directions on one timeline that starts with the call. The config lives in `workdir`; nothing
in $HOME is touched.
"""

from __future__ import annotations

import glob
import socket
import subprocess
import wave
from pathlib import Path

import numpy as np

from realtime_omni.gateway.media.audio import float_to_pcm16

RATE_HZ = 8000


def write_wav(path: Path, pcm: np.ndarray, rate: int = RATE_HZ) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(float_to_pcm16(pcm))


def read_wav(path: str | Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        if w.getframerate() != RATE_HZ:
            raise ValueError(f"{path}: {w.getframerate()} Hz, not {RATE_HZ}")
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.int32)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dial(workdir: Path, uri: str, microphone: Path, seconds: int) -> subprocess.Popen[bytes]:
    cfg, rec = workdir / "baresip", workdir / "rec"
    cfg.mkdir(parents=True)
    rec.mkdir()
    rtp = _free_port()
    lines = [
        "poll_method epoll",
        "sip_listen 127.0.0.1:0",
        "net_interface 127.0.0.1",  # `lo` is refused in containers
        "audio_player none,none",  # no sound card: sndfile records instead
        "audio_alert none,none",
        f"audio_source aufile,{microphone.resolve()}",
        f"ausrc_srate {RATE_HZ}",  # must be the file's rate
        "ausrc_channels 1",
        f"rtp_ports {rtp}-{rtp + 1}",
        "module_path /usr/lib/baresip/modules",
        "module g711.so",
        "module aufile.so",
        "module sndfile.so",
        "module_tmp account.so",
        "module_app menu.so",
        f"snd_path {rec}",
    ]
    (cfg / "config").write_text("\n".join(lines) + "\n")
    (cfg / "accounts").write_text("<sip:caller@127.0.0.1>;regint=0;audio_codecs=pcmu;mwi=no\n")
    (cfg / "contacts").write_text("")  # else baresip writes a template
    return subprocess.Popen(
        ["baresip", "-f", str(cfg), "-e", f"/dial {uri}", "-t", str(seconds)],
        cwd=workdir,
        stdin=subprocess.PIPE,  # its stdio module refuses /dev/null
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def recordings(workdir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(what baresip sent, what it received) of its one call."""
    (enc,) = glob.glob(str(workdir / "rec" / "dump-*-enc.wav"))
    (dec,) = glob.glob(str(workdir / "rec" / "dump-*-dec.wav"))
    return read_wav(enc), read_wav(dec)


def loud(x: np.ndarray, threshold: int, step: int = 160) -> list[bool]:
    """Per `step` samples (20 ms by default): is anything above `threshold` in it."""
    return [
        bool(np.abs(x[i : i + step]).max() > threshold) for i in range(0, len(x) - step + 1, step)
    ]
