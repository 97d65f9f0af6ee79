"""A store folder's SQLite URL, built by the settings without SQLAlchemy, reads back to the same
file through SQLAlchemy's parser, whatever the folder's name holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from dss.catalog.urls import sqlite_file
from dss.core.config import sqlite_url

NAMES = ["plain", "a b", "q?x#y%z", "é+@:;=&", "100%25", "~tilde"]


@pytest.mark.parametrize("name", NAMES)
def test_a_folders_sqlite_url_names_its_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name / "catalog.db"
    url = sqlite_url(path)
    assert url == URL.create("sqlite", database=str(path)).render_as_string(hide_password=False)
    assert sqlite_file(url) == path


@pytest.mark.parametrize("url", ["postgresql+psycopg://127.0.0.1/test", "sqlite://", "sqlite:///:memory:", "not a url"])
def test_a_url_naming_no_sqlite_file_gives_none(url: str) -> None:
    assert sqlite_file(url) is None
