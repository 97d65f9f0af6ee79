"""Server configuration (dss.service.config): arguments over DSS_SERVER_* over the file over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dss.core.errors import ConfigError
from dss.service.config import ServerConfig, default_api_key, load_server_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "DSS_SERVER_CONFIG",
        "DSS_SERVER_HOST",
        "DSS_SERVER_PORT",
        "DSS_SERVER_MAX_BODY_BYTES",
        "DSS_SERVER_MAX_TOKENS",
        "DSS_SERVER_KEYS_FILE",
        "DSS_SERVER_PUBLIC_METRICS",
        "DSS_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)


def test_defaults(tmp_path: Path) -> None:
    config = load_server_config(tmp_path)
    assert config == ServerConfig(keys_file=tmp_path / "api-keys.json")
    assert (config.host, config.port, config.max_body_bytes, config.max_tokens) == (
        "127.0.0.1",
        8077,
        32 << 20,
        1 << 20,
    )
    assert (config.public_metrics, config.access_log, config.url) == (False, False, "http://127.0.0.1:8077")


def test_precedence_argument_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dss-server.toml").write_text('port = 9001\nhost = "0.0.0.0"\nmax_body_bytes = "1MiB"\n')
    assert load_server_config(tmp_path).port == 9001
    monkeypatch.setenv("DSS_SERVER_PORT", "9002")
    monkeypatch.setenv("DSS_SERVER_PUBLIC_METRICS", "true")
    config = load_server_config(tmp_path)
    assert (config.port, config.host, config.max_body_bytes, config.public_metrics) == (9002, "0.0.0.0", 1 << 20, True)
    assert load_server_config(tmp_path, port=9003, host=None).port == 9003


def test_config_file_from_env_or_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(f'keys_file = "{tmp_path / "k.json"}"\nmax_tokens = 64\n')
    monkeypatch.setenv("DSS_SERVER_CONFIG", str(elsewhere))
    assert load_server_config(tmp_path / "home").keys_file == tmp_path / "k.json"
    monkeypatch.delenv("DSS_SERVER_CONFIG")
    assert load_server_config(tmp_path / "home", elsewhere).max_tokens == 64


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DSS_SERVER_PORT": "70000"}, "port: Input should be less than or equal to 65535 (from DSS_SERVER_PORT)"),
        (
            {"DSS_SERVER_PORT": "http"},
            "port: Input should be a valid integer, unable to parse string as an integer (from DSS_SERVER_PORT)",
        ),
        ({"DSS_SERVER_MAX_BODY_BYTES": "lots"}, "max_body_bytes: Value error, not a size: 'lots'"),
        ({"DSS_SERVER_MAX_TOKENS": "0"}, "max_tokens: Input should be greater than or equal to 1"),
    ],
)
def test_bad_values_name_the_field_and_their_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_server_config(tmp_path)
    assert str(info.value).startswith("invalid dss server configuration: ")
    assert message in str(info.value)


def test_unknown_keys_and_unreadable_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "dss-server.toml").write_text("colour = 'blue'\n")
    with pytest.raises(ConfigError, match=r"colour: Extra inputs are not permitted \(from file .*dss-server.toml\)"):
        load_server_config(tmp_path)
    (tmp_path / "dss-server.toml").write_text("port = \n")
    with pytest.raises(ConfigError, match="cannot read server config file"):
        load_server_config(tmp_path)
    with pytest.raises(ConfigError, match="cannot read server config file"):
        load_server_config(tmp_path, tmp_path / "missing.toml")


def test_config_is_immutable(tmp_path: Path) -> None:
    config = load_server_config(tmp_path)
    with pytest.raises(ValidationError, match="frozen"):
        config.port = 1  # type: ignore[misc]


def test_default_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_api_key() is None
    monkeypatch.setenv("DSS_API_KEY", "dss_x_y")
    assert default_api_key() == "dss_x_y"
