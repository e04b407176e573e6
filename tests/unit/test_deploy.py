"""The compose file: valid for Debian's docker-compose, and no gateway on every interface."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def test_no_service_exposes_the_gateway_beyond_loopback() -> None:
    """Without API keys a gateway must not listen on every interface."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, svc in services.items():
        cmd = svc.get("command", [])
        if "serve" in cmd:
            assert "--host" in cmd, f"{name}: serve without --host"
            assert cmd[cmd.index("--host") + 1] in LOOPBACK, f"{name} binds beyond loopback"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
def test_docker_compose_config_accepts_the_file() -> None:
    done = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here")
def test_the_load_balanced_profile_is_valid_and_drains_before_docker_kills() -> None:
    done = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "--profile", "lb", "config"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    haproxy = (ROOT / "docs" / "examples" / "haproxy.cfg").read_text()
    assert "bind 127.0.0.1:" in haproxy and "option httpchk GET /readyz" in haproxy
    for name in ("tiny-a", "tiny-b"):
        cmd = services[name]["command"]
        port = cmd[cmd.index("--port") + 1]
        assert f"127.0.0.1:{port} check" in haproxy, f"{name} is not behind the balancer"
    from realtime_omni.gateway.config import GatewayConfig

    for name, svc in services.items():
        if "serve" in svc.get("command", []):  # docker's SIGKILL must come after the drain
            grace = svc.get("stop_grace_period", "10s")
            assert float(str(grace).rstrip("s")) > GatewayConfig().drain_s + 10, name
