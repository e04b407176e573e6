"""Smart Turn out of the box (`models/smart_turn.py`): `make install`'s copy of the pinned file is
where the server looks without configuration; without it, semantic_vad falls back to the silence
rule and one log line says how to install it; a named directory still decides."""

import logging
import zipfile
from pathlib import Path

import pytest

from realtime_omni.errors import ConfigError
from realtime_omni.gateway.app import Gateway
from realtime_omni.gateway.config import GatewayConfig, RealtimeConfig
from realtime_omni.models import smart_turn
from realtime_omni.pipeline.config import load_config
from tests.conftest import ROOT, run
from tests.unit.gateway.fakes import FakeCoord

PIPECAT_DATA = next(
    (ROOT / ".cache" / "venvs" / "pipecat" / "lib").glob(
        "python3*/site-packages/pipecat/audio/turn/smart_turn/data"
    ),
    None,
)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight model of the real signature, under the installed file's name."""
    from tests.models.random_smart_turn import build

    path = build(tmp_path_factory.mktemp("random"))
    return path.rename(path.with_name(smart_turn.FILE_NAME))


def started(directory: str | None) -> Gateway:
    config = GatewayConfig(vad=False, realtime=RealtimeConfig(smart_turn_dir=directory))
    gw = Gateway(load_config(ROOT / "configs" / "tiny.yaml"), config, FakeCoord())
    run(gw.start())
    return gw


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == smart_turn.__name__]


def test_the_server_finds_the_installed_model_without_configuration(
    random_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(smart_turn, "DEFAULT_DIR", random_model.parent)
    gw = started(None)
    assert isinstance(gw.end_of_turn, smart_turn.SmartTurn)
    assert gw.end_of_turn.path == random_model
    assert warnings_of(caplog) == []


def test_without_the_file_semantic_vad_is_the_silence_rule_and_one_line_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(smart_turn, "DEFAULT_DIR", tmp_path)
    caplog.set_level(logging.INFO)
    assert started(None).end_of_turn is None
    (line,) = warnings_of(caplog)
    assert "make install" in line and "realtime.smart_turn_dir" in line and str(tmp_path) in line
    caplog.clear()
    assert started("").end_of_turn is None  # switched off: nothing to report
    assert warnings_of(caplog) == []


def test_a_named_directory_decides(
    random_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smart_turn, "DEFAULT_DIR", tmp_path / "absent")
    model = smart_turn.load(str(random_model.parent))
    assert model is not None and model.path == random_model
    with pytest.raises(ConfigError, match="holds no ONNX model"):
        smart_turn.load(str(tmp_path))  # named, and empty: an error, not a silent fallback


def test_the_default_directory_is_the_one_make_install_fills() -> None:
    assert smart_turn.DEFAULT_DIR == ROOT / ".cache" / "models" / "smart_turn"
    assert "realtime_omni.models.smart_turn install" in (ROOT / "Makefile").read_text()
    installed = smart_turn.DEFAULT_DIR / smart_turn.FILE_NAME
    if not installed.is_file():
        pytest.skip("`make install` has not run here")
    assert smart_turn._sha256(installed.read_bytes()) == smart_turn.SHA256


def test_install_takes_only_the_pinned_file(tmp_path: Path) -> None:
    wheel = tmp_path / "pipecat_ai-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smart_turn.WHEEL_MEMBER, b"not the model")
    with pytest.raises(ValueError, match="not the pinned"):
        smart_turn.install(wheel, tmp_path / "out")
    assert not (tmp_path / "out" / smart_turn.FILE_NAME).exists()
    if PIPECAT_DATA is None:
        pytest.skip("no pipecat-ai client environment (`make install` builds it)")
    with zipfile.ZipFile(wheel, "w") as z:  # the wheel's layout, the pinned content
        z.write(PIPECAT_DATA / smart_turn.FILE_NAME, smart_turn.WHEEL_MEMBER)
    for i, source in enumerate((wheel, PIPECAT_DATA)):
        out = smart_turn.install(source, tmp_path / f"from-{i}")
        assert smart_turn._sha256(out.read_bytes()) == smart_turn.SHA256
