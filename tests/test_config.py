"""Configuration: arguments over DSS_* variables over the config file over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

import dss
from dss.config import load_config, parse_size


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "h"
    home.mkdir()
    (home / "dss.toml").write_text('host_bytes = "1MiB"\ndisk_bytes = 1000\nfsync = false\n')
    monkeypatch.setenv("DSS_DISK_BYTES", "2KB")
    config = load_config(home, fsync=True)
    assert (config.host_bytes, config.disk_bytes, config.fsync) == (1 << 20, 2000, True)
    assert config.url == f"sqlite:///{home / 'catalog.db'}"
    monkeypatch.setenv("DSS_HOME", str(tmp_path / "other"))
    assert load_config().home == tmp_path / "other"


@pytest.mark.parametrize("value, expected", [(5, 5), ("5", 5), ("1.5 KiB", 1536), ("2GB", 2 * 10**9)])
def test_sizes(value: object, expected: int) -> None:
    assert parse_size(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("options, message", [
    ({"host_bytes": "lots"}, "host_bytes"), ({"disk_bytes": -1}, "disk_bytes"), ({"colour": "red"}, "colour"),
])
def test_bad_values_are_named(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=message):
        load_config(tmp_path, **options)


def test_unreadable_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.toml").write_text("this is = = not toml")
    monkeypatch.setenv("DSS_CONFIG", str(tmp_path / "bad.toml"))
    with pytest.raises(dss.ConfigError, match="cannot read config file"):
        load_config(tmp_path)
