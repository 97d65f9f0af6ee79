"""The PostgreSQL role ``sql()`` runs as: what it may read, its name, its creation (when the
catalog user may create roles) and the checks that it is read-only (see
:mod:`dss.catalog.readonly`)."""

from __future__ import annotations

import hashlib
import secrets
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from dss.catalog.schema import Base
from dss.core.errors import ConfigError

if TYPE_CHECKING:
    import psycopg

SECRET_TABLES = ("user_keys", "store_meta")
"""Tables ``sql()`` never reads: data keys wrapped under the master key, and facts about the store."""

VIEWS = ("session_summary", "user_summary", "tier_usage", "version_summary", "tier_quota_usage", "tier_encodings")
"""The catalog's views (``sql()`` may read them)."""

PASSWORD_KEY = "sql_password"
"""``store_meta`` key of the password of the role dss creates for ``sql()``."""


def readable_relations() -> list[str]:
    """Every table and view ``sql()`` may read: dss's tables and views but the secret ones."""
    names = set(Base.metadata.tables) | {"alembic_version"} | set(VIEWS)
    return sorted(names - set(SECRET_TABLES))


def reader_role(database: str, schema: str) -> str:
    """The name of the role dss creates for ``sql()`` on a catalog in ``database`` and ``schema``
    (roles are shared by the whole PostgreSQL cluster, so the name tells catalogs apart)."""
    digest = hashlib.sha256(f"{database}\0{schema}".encode()).hexdigest()[:20]
    return f"dss_sql_{digest}"


HOW_TO = (
    "sql() on PostgreSQL runs as a LOGIN role that is no superuser and may only SELECT dss's tables; "
    "grant the catalog user CREATEROLE so that dss creates that role itself, or create one and set "
    "sql_url (DSS_SQL_URL) to it (see the Python API documentation, section SQL)"
)


def catalog_place(engine: Engine) -> tuple[str, str]:
    """``(database, schema)`` the catalog user works in."""
    with engine.connect() as conn:
        database, schema = conn.exec_driver_sql("SELECT current_database(), current_schema()").one()
    if schema is None:
        raise ConfigError("the catalog user has no schema on its search_path")
    return database, schema


def provision(engine: Engine, role: str, schema: str) -> str:
    """Create or refresh ``role``, the reader role of the catalog in ``schema``; return its password.

    Runs as the catalog user in one transaction under an advisory lock, so concurrent stores
    (threads or processes) agree on one role and one password. Grants SELECT on exactly
    :func:`readable_relations` (refreshed each time, so new tables of a migration are covered).
    """
    import psycopg

    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        with conn.cursor() as cur:
            cur.execute("SELECT rolsuper OR rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = current_user")
            (may_create,) = cur.fetchone()
            lock = int.from_bytes(hashlib.sha256(role.encode()).digest()[:8], "big", signed=True)
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))
            cur.execute("SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %s", (role,))
            exists = cur.fetchone() is not None
            cur.execute("SELECT value FROM store_meta WHERE key = %s", (PASSWORD_KEY,))
            stored = cur.fetchone()
            password = bytes(stored[0]).decode() if stored else None
            if not exists or password is None:
                if not may_create:
                    raise ConfigError(
                        f"the catalog user may not create the SQL role {role!r} (no CREATEROLE): {HOW_TO}"
                    )
                password = _create_role(conn, cur, role, schema, exists)
            grant(cur, role, schema)
        conn.commit()
        return password
    except psycopg.Error as exc:
        raise ConfigError(f"cannot set up the SQL role: {str(exc).strip()}: {HOW_TO}") from None
    finally:
        raw.close()


def _create_role(conn: Any, cur: psycopg.Cursor[Any], role: str, schema: str, exists: bool) -> str:
    """Create ``role`` (or give the existing one a new password), read-only, searching
    ``schema``; keep its password in ``store_meta`` and return it."""
    from psycopg import sql

    password = secrets.token_urlsafe(32)
    verifier = conn.pgconn.encrypt_password(password.encode(), role.encode()).decode()
    create = "ALTER ROLE {} WITH" if exists else "CREATE ROLE {}"
    cur.execute(
        sql.SQL(
            create + " LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT PASSWORD {}"
        ).format(sql.Identifier(role), sql.Literal(verifier))
    )
    cur.execute(sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(sql.Identifier(role)))
    cur.execute(sql.SQL("ALTER ROLE {} SET search_path = {}").format(sql.Identifier(role), sql.Identifier(schema)))
    cur.execute("DELETE FROM store_meta WHERE key = %s", (PASSWORD_KEY,))
    cur.execute("INSERT INTO store_meta (key, value) VALUES (%s, %s)", (PASSWORD_KEY, password.encode()))
    return password


def grant(cur: psycopg.Cursor[Any], role: str, schema: str) -> None:
    """SELECT on :func:`readable_relations` that exist in ``schema``, and nothing else there."""
    from psycopg import sql

    cur.execute(
        "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = ANY(%s)",
        (schema, readable_relations()),
    )
    present = sorted(name for (name,) in cur.fetchall())
    who, where = sql.Identifier(role), sql.Identifier(schema)
    cur.execute(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(where, who))
    cur.execute(sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {} FROM {}").format(where, who))
    cur.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(where, who))
    if present:
        tables = sql.SQL(", ").join(sql.Identifier(schema, name) for name in present)
        cur.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(tables, who))


POWERFUL_ROLES = (
    "pg_read_all_data",
    "pg_write_all_data",
    "pg_read_server_files",
    "pg_write_server_files",
    "pg_execute_server_program",
)


def reader_problems(conn: psycopg.Connection[Any], schema: str) -> list[str]:
    """What makes the connected role unfit to run ``sql()`` (empty when it is fit)."""
    problems = []
    attributes = conn.execute(
        "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls FROM pg_catalog.pg_roles "
        "WHERE rolname = current_user"
    ).fetchone()
    assert attributes is not None  # the connected role has a row
    for flag, name in zip(attributes, ("SUPERUSER", "CREATEROLE", "CREATEDB", "REPLICATION", "BYPASSRLS")):
        if flag:
            problems.append(f"it has {name}")
    member = conn.execute(
        "SELECT rolname FROM pg_catalog.pg_roles WHERE rolname = ANY(%s) "
        "AND pg_catalog.pg_has_role(current_user, oid, 'USAGE') ORDER BY rolname",
        (list(POWERFUL_ROLES),),
    ).fetchall()
    problems += [f"it has the privileges of {name}" for (name,) in member]
    rows = conn.execute(
        "SELECT c.relname, pg_catalog.has_table_privilege(c.oid, 'SELECT'), "
        "pg_catalog.has_table_privilege(c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER') "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = ANY(%s) ORDER BY c.relname",
        (schema, readable_relations() + list(SECRET_TABLES)),
    ).fetchall()
    problems += [f"it may write to {name}" for name, _, writes in rows if writes]
    problems += [f"it may read {name}" for name, reads, _ in rows if reads and name in SECRET_TABLES]
    return problems
