"""Every setting is an env var; unsafe ones are refused before anything starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from pinfeed_server.cli import app as cli
from pinfeed_server.settings import Settings, physical_memory

TOKEN = "0123456789abcdef-token"


def _settings(tmp_path: Path, **kw: object) -> Settings:
    values: dict[str, object] = {
        "state_dir": tmp_path / "state",
        "data_root": tmp_path,
        "socket": tmp_path / "s.sock",
        **kw,
    }
    return Settings(**values)  # type: ignore[arg-type]


def test_every_setting_reads_its_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {
        "HOST": "::1",
        "PORT": "9000",
        "RUN_DIR": str(tmp_path / "run"),
        "SOCKET": str(tmp_path / "x.sock"),
        "STATE_DIR": str(tmp_path / "st"),
        "DATA_ROOT": str(tmp_path),
        "MAX_SHM_BYTES": "1048576",
        "MAX_BODY_BYTES": "4096",
        "TOKEN": TOKEN,
        "ALLOWED_PLUGINS": '["mylab.data"]',
        "ATTACH_TIMEOUT_S": "5",
        "TORCH_THREADS": "2",
        "SOCKET_GROUP": "0",
        "DEMO": "true",
        "LOG_LEVEL": "DEBUG",
        "MAX_WORKERS": "12",
        "HTTP_MAX_RPS": "20.5",
        "METRICS_MAX_AGE_S": "0",
        "RAY_ADDRESS": "127.0.0.1:6379",
        "ACCEPT_OBJECTS": "false",
        "IDLE_EXIT_S": "30",
        "STARTED_BY": "script",
        "ARBITER": "false",
        "ARBITER_INTERVAL_S": "0.5",
        "CACHE_MAX_BYTES": "524288",
        "CACHE_DIR": str(tmp_path / "caches"),
        "REMOTE_ALLOW": '["s3://corpus/train/"]',
        "REMOTE_CACHE_DIR": str(tmp_path / "objects"),
        "REMOTE_CACHE_MAX_BYTES": str(1 << 30),
        "REMOTE_BLOCK_BYTES": str(1 << 20),
        "REMOTE_CONCURRENCY": "8",
        "REMOTE_AHEAD_BYTES": str(1 << 24),
        "REMOTE_EVICTION": "lru",
        "REMOTE_RETRIES": "3",
        "REMOTE_RETRY_S": "5",
        "REMOTE_VERIFY": "false",
    }
    assert {f"PINFEED_{k.upper()}" for k in Settings.model_fields} == {f"PINFEED_{k}" for k in env}
    for key, value in env.items():
        monkeypatch.setenv(f"PINFEED_{key}", value)
    s = Settings()
    assert (s.host, s.port, s.max_shm_bytes, s.max_body_bytes) == ("::1", 9000, 1 << 20, 4096)
    assert s.socket_path == tmp_path / "x.sock" and s.state_dir == tmp_path / "st"
    assert s.registry_path is None  # a script's server: its registry is in memory
    assert s.model_copy(update={"started_by": "serve"}).registry_path == (
        tmp_path / "st" / "registry.sqlite3"
    )
    assert (s.cache_budget, s.cache_path) == (1 << 19, tmp_path / "caches")
    assert (s.token, s.allowed_plugins, s.demo, s.log_level) == (
        TOKEN,
        ["mylab.data"],
        True,
        "debug",
    )
    assert s.torch_threads == 2 and s.socket_gid == 0
    assert (s.max_workers, s.http_max_rps, s.metrics_max_age_s) == (12, 20.5, 0.0)
    assert TOKEN not in repr(s) and s.ray_address == "127.0.0.1:6379"
    assert (s.accept_objects, s.idle_exit_s) == (False, 30.0)
    assert (s.arbiter, s.arbiter_interval_s) == (False, 0.5)
    s.model_copy(update={"ray_address": None}).check_safe()  # no Ray head here


def test_every_setting_is_described() -> None:
    for name, field in Settings.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"max_shm_bytes": physical_memory() + 1}, "RAM"),
        ({"token": "short"}, "shorter than"),
        ({"token": "has spaces in the middle of it"}, "printable"),
        ({"socket": Path("/tmp") / ("s" * 120)}, "longer than"),
    ],
)
def test_unsafe_settings_are_refused(
    tmp_path: Path, overrides: dict[str, object], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        _settings(tmp_path, **overrides).check_safe()


def test_data_root_must_be_a_folder_other_than_root(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    with pytest.raises(ValueError, match="not a directory"):
        Settings(data_root=tmp_path / "file").check_safe()
    with pytest.raises(ValueError, match="whole filesystem"):
        Settings(data_root=Path("/")).check_safe()


@pytest.mark.parametrize(
    "overrides",
    [
        {"port": 70000},
        {"max_shm_bytes": 0},
        {"log_level": "loud"},
        {"allowed_plugins": ["", "ok"]},
        {"max_body_bytes": 10},
    ],
)
def test_impossible_values_fail_validation(tmp_path: Path, overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        _settings(tmp_path, **overrides)


def test_non_loopback_without_token_warns_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pinfeed"):
        _settings(tmp_path, host="127.0.0.1").check_safe()
        _settings(tmp_path, host="0.0.0.0", token=TOKEN).check_safe()
        assert not caplog.records
        _settings(tmp_path, host="0.0.0.0").check_safe()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "0.0.0.0" in record.getMessage() and "PINFEED_TOKEN" in record.getMessage()


@pytest.mark.parametrize(
    ("env", "needle"),
    [({"PINFEED_TOKEN": "short"}, "shorter than"), ({"PINFEED_PORT": "-1"}, "PINFEED_PORT")],
)
def test_serve_refuses_to_start(tmp_path: Path, env: dict[str, str], needle: str) -> None:
    result = CliRunner().invoke(
        cli,
        ["serve", "--state-dir", str(tmp_path), "--data-root", str(tmp_path)],
        env={**env, "COLUMNS": "200"},
    )
    assert result.exit_code == 2, result.output
    assert "refusing to start" in result.output and needle in result.output


def test_max_workers_defaults_from_the_cpus(tmp_path: Path) -> None:
    assert _settings(tmp_path).max_workers == max(8, 4 * len(os.sched_getaffinity(0)))
    with pytest.raises(ValidationError):
        _settings(tmp_path, max_workers=-1)
