"""What `serve` and the Docker image start with: never the network without a key, files and
folders for the owner alone."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from realtime_omni.errors import ConfigError, OmniError
from realtime_omni.gateway.app import secure
from realtime_omni.gateway.config import GatewayConfig, RealtimeConfig
from realtime_omni.gateway.event_log import EventLog
from realtime_omni.pipeline.sockets import private_dir
from tests.conftest import ROOT

NO_KEYS = RealtimeConfig(api_keys_env="RTO_TEST_NO_SUCH_KEYS")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_serve_never_opens_the_network_without_a_key() -> None:
    cfg = GatewayConfig(realtime=NO_KEYS)
    with pytest.raises(OmniError, match="--generate-api-key"):
        secure(cfg, "0.0.0.0")
    assert secure(cfg, "127.0.0.1").api_keys == ()  # loopback: as before
    made = secure(GatewayConfig(realtime=NO_KEYS, generate_api_key=True), "0.0.0.0")
    assert len(made.api_keys) == 1 and made.api_keys[0].startswith("sk-")
    assert len(made.api_keys[0]) > 30 and made.bind_host == "0.0.0.0"


def test_the_docker_image_serves_with_a_key_it_made_not_without_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("CMD"))
    cmd = json.loads(line[3:])
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "--allow-no-auth" not in cmd and "--generate-api-key" in cmd
    from realtime_omni.cli import main

    # `serve` takes the flags (argparse would exit 2 on one it does not know) and goes as far
    # as the port, held here
    with socket.create_server(("0.0.0.0", 0)) as held:
        port = str(held.getsockname()[1])
        args = [*cmd[1:], "--config", str(ROOT / "configs" / "tiny.yaml"), "--port", port]
        assert main(args) == 2
    assert "cannot listen" in capsys.readouterr().err


def test_the_event_log_is_for_its_owner_alone(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        log = EventLog.open(tmp_path / "events.jsonl")
        assert log is not None
        log.write("sess_1", "websocket", False, {"type": "session.created"})
        log.close()
        assert mode(tmp_path / "events.jsonl") == 0o600
        kept = tmp_path / "kept.jsonl"
        kept.write_text("")
        kept.chmod(0o644)
        log = EventLog.open(kept)  # one made before is closed to others too
        assert log is not None
        log.close()
        assert mode(kept) == 0o600
    finally:
        os.umask(old)


def test_the_ipc_dir_is_for_its_owner_alone(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        private_dir(tmp_path / "a" / "ipc")
        assert mode(tmp_path / "a" / "ipc") == 0o700
        private_dir(tmp_path / "a" / "ipc")  # its own again: fine
        with pytest.raises(ConfigError, match="chmod 700"):
            private_dir(tmp_path / "a")  # made with the umask: open to others
    finally:
        os.umask(old)
