"""Catalog URLs read with SQLAlchemy's parser (nothing is opened): the file a SQLite URL names.

The settings build the default SQLite URL of a store folder (:func:`dss.core.config.sqlite_url`)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError


def sqlite_file(url: str) -> Path | None:
    """The database file a SQLite catalog URL names; ``None`` for another database, an in-memory
    one, or a URL SQLAlchemy cannot read (opening its catalog says why)."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return Path(parsed.database)
