"""The catalog connection: engine, schema revision and upgrades, transactions, compaction.

Every write goes through :meth:`Catalog.write`, which starts the transaction by bumping the
one-row ``catalog_seq`` counter. That serialises writers (SQLite: ``BEGIN IMMEDIATE``;
PostgreSQL: the row lock) so sequence numbers follow commit order; each transaction records
what it changed in the feed under its number (:mod:`dss.catalog.feed`). On PostgreSQL the
same statement sends ``NOTIFY`` with the number on the catalog's channel (:func:`channel_of`),
which other nodes listen to (:mod:`dss.catalog.listen`).

This package is the only place SQL is written: the queries live in its modules by subject
(:mod:`~dss.catalog.namespaces`, :mod:`~dss.catalog.sessions`, :mod:`~dss.catalog.pages`,
:mod:`~dss.catalog.erasures`, :mod:`~dss.catalog.feed`), writes are applied by
:mod:`~dss.catalog.change`, and read-only SQL for operators runs in :mod:`~dss.catalog.readonly`.
This module owns the connection.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import resources
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import create_engine, event, inspect, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.sql.expression import Executable

from dss.catalog.readonly import ReadOnlySql
from dss.catalog.schema import SCHEMA_REVISION
from dss.catalog.schema import catalog_seq as _seq
from dss.core.crypto import SealError
from dss.core.errors import CatalogCorrupt, CatalogUnavailable, ConfigError, SchemaOutdated, SchemaTooNew
from dss.core.types import SqlResult

UTC = dt.UTC

CHUNK = 500
"""Largest ``IN (...)`` list sent in one statement."""

T = TypeVar("T")

DuplicateRow = IntegrityError
"""A write broke a unique or foreign-key constraint: another writer got there first (callers
outside this package catch it by this name, never SQLAlchemy's)."""


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """``items`` in slices of at most ``size`` (for ``IN`` lists)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def insert_id(conn: Connection, statement: Executable, params: Mapping[str, Any] | None = None) -> int:
    """Run ``statement``, an insert of one row, and return the row's new id."""
    key = conn.execute(statement, params).inserted_primary_key
    assert key is not None
    return int(key[0])


def now() -> dt.datetime:
    """The current time, timezone-aware UTC."""
    return dt.datetime.now(UTC)


def aware(value: dt.datetime) -> dt.datetime:
    """A catalog timestamp as timezone-aware UTC (SQLite hands back naive ones)."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def channel_of(database: str, schema: str) -> str:
    """The PostgreSQL notification channel of the catalog in ``database``, ``schema`` (one per catalog)."""
    return "dss_feed_" + hashlib.blake2b(f"{database}\0{schema}".encode(), digest_size=10).hexdigest()


_NEXT_SEQ_AND_NOTIFY = (
    "WITH s AS (UPDATE catalog_seq SET seq = seq + 1 WHERE id = 1 RETURNING seq) "
    "SELECT seq, pg_notify(%(channel)s, seq::text) FROM s"
)


class Tx(NamedTuple):
    """An open write transaction and its sequence number."""

    conn: Connection
    seq: int


def open_catalog(url: str, *, fsync: bool = True, sql_timeout_s: float = 10.0, sql_url: str | None = None) -> Catalog:
    """A :class:`Catalog` at ``url``; ``ConfigError`` for a URL SQLAlchemy cannot use or whose
    driver is not installed (the message never repeats the URL: it may hold a password)."""
    try:
        return Catalog(url, fsync=fsync, sql_timeout_s=sql_timeout_s, sql_url=sql_url)
    except NoSuchModuleError as exc:
        raise ConfigError(f"catalog_url names a database SQLAlchemy cannot load: {exc}") from None
    except ModuleNotFoundError as exc:  # the URL's database driver is not installed
        hint = ": pip install 'dss-store[postgres]'" if exc.name == "psycopg" else ""
        raise ConfigError(f"catalog_url needs the {exc.name} package{hint}") from None
    except ArgumentError:
        raise ConfigError("catalog_url is not a SQLAlchemy URL (e.g. postgresql+psycopg://host/db)") from None


@contextmanager
def catalog_errors() -> Iterator[None]:
    """Failures of the catalog database, and catalog rows that do not decode, as ``DssError``s:
    ``CatalogUnavailable`` (cannot connect, locked, I/O) or ``CatalogCorrupt`` (a damaged
    file or row). Anything else passes unchanged."""
    try:
        yield
    except OperationalError as exc:
        raise CatalogUnavailable(f"the catalog cannot be used: {_reason(exc)}") from exc
    except DatabaseError as exc:
        if type(exc) is not DatabaseError:  # integrity, programming, ...: a defect of dss, not of the catalog
            raise
        raise CatalogCorrupt(f"the catalog database is damaged: {_reason(exc)}") from exc
    except (SealError, json.JSONDecodeError) as exc:
        raise CatalogCorrupt(f"a catalog row does not decode ({exc}): the catalog is damaged") from exc


def _reason(exc: DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__


class Catalog:
    """One catalog database, reached through SQLAlchemy. Thread-safe (a connection pool)."""

    def __init__(
        self, url: str, *, fsync: bool = True, sql_timeout_s: float = 10.0, sql_url: str | None = None
    ) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.channel: str | None = None
        if self.is_sqlite:
            self.engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
            _configure_sqlite(self.engine, fsync)
        else:
            self.engine = create_engine(url, pool_pre_ping=True)
        self.readonly = ReadOnlySql(self.engine, timeout_s=sql_timeout_s, reader_url=sql_url)

    def close(self) -> None:
        self.engine.dispose()

    def _channel(self, conn: Connection) -> str:
        """The PostgreSQL notification channel of this catalog (see :mod:`dss.catalog.listen`)."""
        if self.channel is None:
            database, schema = conn.exec_driver_sql("SELECT current_database(), current_schema()").one()
            self.channel = channel_of(database, schema)
        return self.channel

    # -- schema ----------------------------------------------------------------------------

    def revision(self) -> str | None:
        """The Alembic revision the catalog is at, or ``None`` for an empty (or absent) database."""
        path = self.engine.url.database
        if self.is_sqlite and path and not os.path.exists(path):
            return None
        with self.engine.connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()

    def ensure_schema(self) -> None:
        """Create the schema in an empty database; refuse one at another revision."""
        current = self.revision()
        if current is None:
            self.upgrade()
        elif current != SCHEMA_REVISION:
            known = {script.revision for script in _scripts().walk_revisions()}
            if current in known:
                raise SchemaOutdated(
                    f"the catalog at {self.url} is at schema revision {current}, this dss needs "
                    f"{SCHEMA_REVISION}: run `dss db upgrade` (back the catalog up first)"
                )
            raise SchemaTooNew(
                f"the catalog at {self.url} is at schema revision {current}, unknown to this dss "
                f"(it needs {SCHEMA_REVISION}): it was made by a newer dss; upgrade dss"
            )

    def pending_revisions(self) -> list[str]:
        """The migrations :meth:`upgrade` would apply now, oldest first; none when the catalog
        is current or at a revision this dss does not know."""
        current = self.revision()
        scripts = [script.revision for script in _scripts().walk_revisions()][::-1]
        if current is None:
            return scripts
        return scripts[scripts.index(current) + 1 :] if current in scripts else []

    def upgrade(
        self, master_key: bytes | None = None, progress: Callable[[str], None] | None = None
    ) -> tuple[str | None, str]:
        """Apply every pending migration in one transaction; return ``(from_revision, to_revision)``.

        ``master_key`` is needed by migrations that seal rows already there (revision 0003);
        ``progress`` is called with each revision as it is applied (before the transaction commits).
        """
        from alembic import command

        before = self.revision()
        with self.engine.connect() as conn:
            if self.is_sqlite:  # rebuilding tables needs this off, which SQLite allows only outside a transaction
                conn.connection.driver_connection.execute("PRAGMA foreign_keys = OFF")  # type: ignore[union-attr]
            try:
                with conn.begin():
                    if not self.is_sqlite:  # processes opening an empty catalog at once: one creates, the others wait
                        conn.exec_driver_sql(
                            "SELECT pg_advisory_xact_lock(hashtext('dss-schema ' || current_schema()))"
                        )
                    config = _alembic_config()
                    config.attributes["connection"] = conn
                    config.attributes["master_key"] = master_key
                    config.attributes["progress"] = progress
                    command.upgrade(config, "head")
                    if self.is_sqlite and conn.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
                        raise SchemaOutdated("the catalog's migration broke a foreign key; nothing was changed")
            finally:
                if self.is_sqlite:
                    conn.connection.driver_connection.execute("PRAGMA foreign_keys = ON")  # type: ignore[union-attr]
        return before, SCHEMA_REVISION

    # -- transactions ----------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Tx]:
        """A write transaction; commits when the block ends, rolls back if it raises."""
        with self.engine.connect() as conn:
            conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                if self.is_sqlite:
                    seq = conn.execute(
                        update(_seq).where(_seq.c.id == 1).values(seq=_seq.c.seq + 1).returning(_seq.c.seq)
                    ).scalar_one()
                else:  # the same, and NOTIFY, delivered at commit to the nodes listening (dss.catalog.listen)
                    seq = conn.exec_driver_sql(_NEXT_SEQ_AND_NOTIFY, {"channel": self._channel(conn)}).one()[0]
                yield Tx(conn, seq)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction with one consistent snapshot."""
        with self.engine.connect() as conn:
            if not self.is_sqlite:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    # -- compaction ------------------------------------------------------------------------

    def compact(self, tables: Sequence[str]) -> str | None:
        """Scrub the free space of the database so deleted rows leave no bytes behind; return
        why it could not (``None`` when it did).

        SQLite (``secure_delete`` is on) zeroes a deleted row where it lies, but not the stale
        copies that earlier page splits left in a page's unused space, so the whole database is
        rebuilt (``VACUUM``, outside any transaction) and the WAL checkpointed and truncated.
        PostgreSQL vacuums ``tables``.
        """
        if self.is_sqlite:
            with self.engine.connect() as conn:
                raw = conn.connection.driver_connection  # VACUUM cannot run in the transaction SQLAlchemy opens
                assert raw is not None
                try:
                    raw.execute("VACUUM")
                    busy = raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                except sqlite3.OperationalError as exc:
                    return f"the catalog could not be rebuilt ({exc})"
            return "the catalog's WAL could not be truncated: other processes kept it busy" if busy else None
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in tables:
                conn.exec_driver_sql(f"VACUUM {table}")
        return None

    # -- read-only SQL ---------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only statement (see :mod:`dss.catalog.readonly`); raises ``SqlError`` or
        ``ReadOnlyViolation``, and changes nothing."""
        return self.readonly.run(query, params, max_rows)


def _configure_sqlite(engine: Any, fsync: bool) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # dss emits BEGIN itself, below
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {'FULL' if fsync else 'OFF'}")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.execute("PRAGMA secure_delete = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


def _alembic_config() -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("dss_migrations")))
    return config


def _scripts() -> Any:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config())
