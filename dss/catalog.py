"""The catalog connection: engine, schema revision, transactions, change feed; read-only SQL
is :mod:`dss.readonly_sql`.

Every write goes through :meth:`Catalog.write`, which starts the transaction by bumping the
one-row ``catalog_seq`` counter. That serialises writers (SQLite: ``BEGIN IMMEDIATE``;
PostgreSQL: the row lock) so sequence numbers follow commit order, and each transaction
tags what it changed in ``changes`` with its number. Another process catches up by reading
the ``changes`` rows above the last number it saw (:meth:`Catalog.changes_since`).

The queries on the tables live in :mod:`dss.records`; this module owns the connection.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any, NamedTuple

from sqlalchemy import create_engine, event, func, insert, inspect, select, text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ArgumentError, DatabaseError, DBAPIError, NoSuchModuleError, OperationalError

from dss.crypto import SealError
from dss.errors import CatalogCorrupt, CatalogUnavailable, ConfigError, SchemaOutdated, SchemaTooNew
from dss.readonly_sql import ReadOnlySql
from dss.schema import SCHEMA_REVISION, CatalogSeq, Change
from dss.types import SqlResult

UTC = dt.timezone.utc
_seq = CatalogSeq.__table__
_changes = Change.__table__

CHANGES_KEPT = 100_000
"""How many change rows survive pruning; a process further behind reloads everything."""
PRUNE_EVERY = 1000
"""Every this many write transactions, the change feed is pruned (in that transaction)."""


def now() -> dt.datetime:
    """The current time, timezone-aware UTC."""
    return dt.datetime.now(UTC)


def aware(value: dt.datetime) -> dt.datetime:
    """A catalog timestamp as timezone-aware UTC (SQLite hands back naive ones)."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


class Tx(NamedTuple):
    """An open write transaction and its sequence number."""

    conn: Connection
    seq: int


def open_catalog(url: str, *, fsync: bool = True, sql_timeout_s: float = 10.0, sql_url: str | None = None) -> Catalog:
    """A :class:`Catalog` at ``url``; ``ConfigError`` for a URL SQLAlchemy cannot use (the
    message never repeats the URL: it may hold a password)."""
    try:
        return Catalog(url, fsync=fsync, sql_timeout_s=sql_timeout_s, sql_url=sql_url)
    except NoSuchModuleError as exc:
        raise ConfigError(f"catalog_url names a database SQLAlchemy cannot load: {exc}") from None
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

    def __init__(self, url: str, *, fsync: bool = True, sql_timeout_s: float = 10.0,
                 sql_url: str | None = None) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            self.engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})
            _configure_sqlite(self.engine, fsync)
        else:
            self.engine = create_engine(url, pool_pre_ping=True)
        self.readonly = ReadOnlySql(self.engine, timeout_s=sql_timeout_s, reader_url=sql_url)

    def close(self) -> None:
        self.engine.dispose()

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
                    f"{SCHEMA_REVISION}: run `dss db upgrade` (back the catalog up first)")
            raise SchemaTooNew(
                f"the catalog at {self.url} is at schema revision {current}, unknown to this dss "
                f"(it needs {SCHEMA_REVISION}): it was made by a newer dss; upgrade dss")

    def pending_revisions(self) -> list[str]:
        """The migrations :meth:`upgrade` would apply now, oldest first; none when the catalog
        is current or at a revision this dss does not know."""
        current = self.revision()
        scripts = [script.revision for script in _scripts().walk_revisions()][::-1]
        if current is None:
            return scripts
        return scripts[scripts.index(current) + 1:] if current in scripts else []

    def upgrade(self, master_key: bytes | None = None,
                progress: Callable[[str], None] | None = None) -> tuple[str | None, str]:
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
                        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(hashtext('dss-schema ' || current_schema()))")
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
        """A write transaction; commits when the block ends, rolls back if it raises.

        Every :data:`PRUNE_EVERY`-th one also prunes the change feed.
        """
        with self.engine.connect() as conn:
            conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                seq = conn.execute(
                    update(_seq).where(_seq.c.id == 1).values(seq=_seq.c.seq + 1).returning(_seq.c.seq)
                ).scalar_one()
                tx = Tx(conn, seq)
                yield tx
                if seq % PRUNE_EVERY == 0:
                    self.prune_changes(tx)

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction with one consistent snapshot."""
        with self.engine.connect() as conn:
            if not self.is_sqlite:
                conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                yield conn

    # -- change feed -----------------------------------------------------------------------

    @staticmethod
    def note(tx: Tx, kind: str, *, session_ref: int | None = None, user_ref: int | None = None,
             page_ids: list[bytes] | None = None) -> None:
        """Record in the change feed what this transaction did."""
        if page_ids is not None:
            rows = [{"seq": tx.seq, "kind": kind, "user_ref": user_ref, "page_id": p} for p in page_ids]
            if rows:
                tx.conn.execute(insert(_changes), rows)
            return
        tx.conn.execute(insert(_changes).values(seq=tx.seq, kind=kind, session_ref=session_ref, user_ref=user_ref))

    def changes_since(self, seq: int) -> tuple[int, list[Any] | None]:
        """``(latest_seq, rows)`` of every change after ``seq``; ``rows`` is ``None`` when
        pruning removed some of them (the caller must then reload everything)."""
        with self.read() as conn:
            latest, floor = conn.execute(select(_seq.c.seq, _seq.c.floor).where(_seq.c.id == 1)).one()
            if seq < floor:
                return latest, None
            rows = conn.execute(
                select(_changes.c.seq, _changes.c.kind, _changes.c.session_ref, _changes.c.user_ref,
                       _changes.c.page_id).where(_changes.c.seq > seq).order_by(_changes.c.id)
            ).all()
            return latest, rows

    def latest_seq(self) -> int:
        with self.read() as conn:
            return conn.execute(select(_seq.c.seq).where(_seq.c.id == 1)).scalar_one()

    @staticmethod
    def prune_changes(tx: Tx) -> None:
        """Keep the newest :data:`CHANGES_KEPT` change rows (whole transactions); record the new floor."""
        count = tx.conn.execute(select(func.count()).select_from(_changes)).scalar_one()
        if count <= CHANGES_KEPT:
            return
        cut = tx.conn.execute(
            select(_changes.c.seq).order_by(_changes.c.id.desc()).offset(CHANGES_KEPT).limit(1)
        ).scalar_one()
        tx.conn.execute(_changes.delete().where(_changes.c.seq <= cut))
        tx.conn.execute(update(_seq).where(_seq.c.id == 1).values(floor=cut))

    # -- read-only SQL ---------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only statement (see :mod:`dss.readonly_sql`); raises ``SqlError`` or
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
