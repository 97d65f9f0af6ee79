"""Configuration: arguments over DSS_* variables over the config file over defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

import dss
from dss.core.config import load_config, parse_size
from tests.conftest import LAYOUT, _pg_schema


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


@pytest.mark.parametrize(
    "options, message",
    [
        ({"host_bytes": "lots"}, "host_bytes"),
        ({"disk_bytes": -1}, "disk_bytes"),
        ({"colour": "red"}, "colour"),
        ({"remote_url": "http://cache:6379"}, "remote_url must start with redis://"),
        ({"node_id": "node one"}, "node_id"),
        ({"remote_prefix": ""}, "remote_prefix"),
        ({"remote_timeout_s": 0}, "remote_timeout_s"),
        ({"feed_poll_s": -1}, "feed_poll_s"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=message):
        load_config(tmp_path, **options)


def test_unreadable_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bad.toml").write_text("this is = = not toml")
    monkeypatch.setenv("DSS_CONFIG", str(tmp_path / "bad.toml"))
    with pytest.raises(dss.ConfigError, match="cannot read config file"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sql_timeout_s": -1}, "sql_timeout_s: Input should be greater than 0"),
        ({"sql_timeout_s": 0}, "sql_timeout_s: Input should be greater than 0"),
        ({"sql_timeout_s": "inf"}, "sql_timeout_s: Input should be a finite number"),
        ({"recompute_tokens_per_s": 0}, "recompute_tokens_per_s: Input should be greater than 0"),
        ({"disk_read_gbps": float("nan")}, "disk_read_gbps: Input should be a finite number"),
    ],
)
def test_numbers_out_of_range_are_refused(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=message):
        load_config(tmp_path, **options)


def test_open_takes_the_folder_as_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with dss.open(home=tmp_path / "h") as store:
        assert store.config.home == tmp_path / "h"
        assert store.config.url == f"sqlite:///{tmp_path / 'h' / 'catalog.db'}"
    assert (tmp_path / "h" / "catalog.db").is_file() and not (tmp_path / "dss-data").exists()
    with pytest.raises(dss.ConfigError, match="the store folder is given twice"):
        dss.open(tmp_path / "a", home=tmp_path / "b")
    with pytest.raises(dss.ConfigError, match="dss.open needs a store folder or a catalog URL, not int"):
        dss.open(5)  # type: ignore[arg-type]


def test_open_takes_a_catalog_url_and_home(tmp_path: Path) -> None:
    """The Python API page's own example: the catalog in PostgreSQL, the page files in home."""
    for url in _pg_schema():
        with dss.open(url, home=tmp_path / "pg-home") as store:
            assert (store.config.home, store.config.url) == (tmp_path / "pg-home", url)
            store.create_session("s", layout=LAYOUT)
            store.commit("s", list(range(8)), {0: bytes(16), 1: bytes(16)})
        assert len(list((tmp_path / "pg-home" / "segments").iterdir())) == 1
        assert not (tmp_path / "pg-home" / "catalog.db").exists()
        with pytest.raises(dss.ConfigError, match="the catalog URL is given twice"):
            dss.open(url, home=tmp_path / "pg-home", catalog_url=url)


@pytest.mark.parametrize(
    "url, message",
    [
        ("nosuch://host/db", "catalog_url names a database SQLAlchemy cannot load"),
        ("postgresql+nodriver://user:secret@host/db", "catalog_url names a database SQLAlchemy cannot load"),
    ],
)
def test_an_unusable_catalog_url_is_a_config_error(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=message) as caught:
        dss.open(tmp_path, catalog_url=url)
    assert "secret" not in str(caught.value)


def test_a_master_key_path_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    with pytest.raises(dss.ConfigError, match=f"the master key file {tmp_path / 'keys'} is a folder"):
        dss.open(tmp_path / "store", master_key_file=tmp_path / "keys")
    (tmp_path / "plain").write_text("")
    with pytest.raises(dss.ConfigError, match="cannot read the master key file .*: Not a directory"):
        dss.open(tmp_path / "store", master_key_file=tmp_path / "plain" / "key")
    assert not (tmp_path / "store" / "catalog.db").exists()


def test_a_refused_open_leaves_no_master_key_file(tmp_path: Path) -> None:
    with dss.open(tmp_path / "store", master_key_file=tmp_path / "key"):
        pass
    # a store made with one key, opened with a key file that does not exist: a new key could never read it
    with pytest.raises(dss.ConfigError, match="this store was made with a master key, but the master key file"):
        dss.open(tmp_path / "store", master_key_file=tmp_path / "other-key")
    assert not (tmp_path / "other-key").exists()
    # a catalog of a newer dss
    catalog = sa.create_engine(f"sqlite:///{tmp_path / 'store' / 'catalog.db'}")
    with catalog.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    catalog.dispose()
    with pytest.raises(dss.SchemaTooNew):
        dss.open(tmp_path / "store", master_key_file=tmp_path / "new-key")
    assert not (tmp_path / "new-key").exists()
    # a new store does make its key
    with dss.open(tmp_path / "fresh", master_key_file=tmp_path / "fresh-key"):
        pass
    assert (tmp_path / "fresh-key").stat().st_size == 32


def test_a_remote_url_redis_cannot_use_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(dss.ConfigError, match="remote_url is not a Redis URL: Port out of range"):
        dss.open(tmp_path / "store", remote_url="redis://:secret@cache:99999999/0")


def test_precision_settings_default_exact_and_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(tmp_path)
    assert (config.host_precision, config.disk_precision, config.remote_precision) == ("exact", "exact", "exact")
    monkeypatch.setenv("DSS_DISK_PRECISION", "int8")
    monkeypatch.setenv("DSS_REMOTE_PRECISION", "int8")
    monkeypatch.setenv("DSS_HOST_PRECISION", "k8v4")
    config = load_config(tmp_path)
    assert (config.host_precision, config.disk_precision, config.remote_precision) == ("k8v4", "int8", "int8")
    monkeypatch.setenv("DSS_REMOTE_PRECISION", "fp8")
    with pytest.raises(dss.ConfigError, match=r"remote_precision \(fp8\) is lossier than disk_precision \(int8\)"):
        load_config(tmp_path)
