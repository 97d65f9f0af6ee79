"""Read-only SQL on the catalog: what ``store.sql()`` runs, on SQLite and on PostgreSQL.

Whatever the text says, :meth:`ReadOnlySql.run` runs exactly one statement, changes nothing,
reads nothing but dss's tables and views (never :data:`~dss.catalog.reader.SECRET_TABLES`, which hold wrapped
keys), stops after the time limit, and raises nothing but ``SqlError`` (a wrong query, a
timeout) or ``ReadOnlyViolation`` (the statement tried something ``sql()`` may not do: a
write, a command, a privileged function, a secret table). Parameters use the driver's own
placeholders (``:name`` on SQLite, ``%(name)s`` on PostgreSQL); neither dss nor SQLAlchemy
parses the text.

SQLite: a second connection opened read-only (``mode=ro``, ``query_only``), an authorizer
that allows reading and calling the functions of :mod:`dss.catalog.sqlfunctions` and nothing
else, limits of that connection only (:data:`MAX_VALUE_BYTES` per string or blob,
:data:`MAX_QUERY_BYTES` of text, no attached database), :data:`MAX_RESULT_BYTES` per result, and
a progress handler that enforces the time limit.

PostgreSQL: a connection of its own, as a separate LOGIN role that is no superuser, may
only SELECT dss's tables and views, and has ``default_transaction_read_only = on``. dss
creates the role on first use when the catalog user may (CREATEROLE): its name is derived
from the database and schema (:func:`~dss.catalog.reader.reader_role`), its random password is kept in
``store_meta`` (which the role cannot read), and an advisory lock makes concurrent stores
agree on one role and one password. ``sql_url`` names a role of the operator's instead. The
text goes through the extended query protocol (a prepared statement, which holds exactly
one statement) in a ``READ ONLY`` transaction that is always rolled back, never committed,
on a connection that is closed afterwards; a statement that returns no rows (``SET``,
``LOCK``, ``NOTIFY``, ``DO`` ...) or that got a transaction id (it wrote, even where the
server allowed it, as ``lo_creat``) is refused. The time limit is the server's
``statement_timeout`` and, in case the statement lifted it, a timer that cancels the query
from the client.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy import make_url
from sqlalchemy.engine import Engine

from dss.catalog.reader import HOW_TO, SECRET_TABLES, catalog_place, provision, reader_problems, reader_role
from dss.catalog.sqlfunctions import BoundedPrintf, is_allowed
from dss.core.errors import ConfigError, DssError, ReadOnlyViolation, SqlError
from dss.core.types import SqlResult

if TYPE_CHECKING:
    import psycopg

NO_ROWS = (
    "sql() runs queries that return rows (SELECT, WITH, VALUES, TABLE, SHOW, EXPLAIN); this statement returns none"
)


def check_text(query: Any, params: Any, max_rows: Any) -> None:
    """Refuse what is no query text, no parameter dict or no row limit (``SqlError``)."""
    if not isinstance(query, str) or not query.strip():
        raise SqlError("sql() needs a non-empty SQL string")
    if "\0" in query:
        raise SqlError("the query contains a NUL character")
    if params is not None and not (isinstance(params, dict) and all(isinstance(k, str) for k in params)):
        raise SqlError("params must be a dict from parameter names to values")
    if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
        raise SqlError(f"max_rows must be a positive integer, got {max_rows!r}")


class ReadOnlySql:
    """Runs ``sql()`` for one catalog. Thread-safe; each call uses a connection of its own."""

    def __init__(self, engine: Engine, *, timeout_s: float, reader_url: str | None = None) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.is_sqlite = engine.url.get_backend_name() == "sqlite"
        if reader_url is not None and self.is_sqlite:
            raise ConfigError("sql_url (DSS_SQL_URL) applies to a PostgreSQL catalog only")
        self._reader_url = reader_url
        self._connect_args: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def run(self, query: str, params: dict[str, Any] | None, max_rows: int) -> SqlResult:
        """Run one read-only statement; see the module docstring for what is refused and how."""
        check_text(query, params, max_rows)
        if self.is_sqlite:
            return self._run_sqlite(query, params or {}, max_rows)
        return self._run_server(query, params or None, max_rows)

    # -- SQLite ----------------------------------------------------------------------------

    def _run_sqlite(self, query: str, params: dict[str, Any], max_rows: int) -> SqlResult:
        conn = sqlite3.connect(f"file:{quote(self.engine.url.database or '')}?mode=ro", uri=True, timeout=30)
        printf = BoundedPrintf(MAX_VALUE_BYTES)
        try:
            conn.execute("PRAGMA query_only = ON")
            for limit, value in _SQLITE_LIMITS:
                conn.setlimit(limit, value)
            for name in ("printf", "format"):
                conn.create_function(name, -1, printf, deterministic=True)
            refused: list[str] = []
            conn.set_authorizer(_sqlite_authorizer(refused))
            deadline = time.monotonic() + self.timeout_s
            conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1_000)
            try:
                cursor = conn.execute(query, params)
                rows = _fetch(cursor, max_rows)
            except sqlite3.DatabaseError as exc:
                raise self._sqlite_error(exc, refused, printf.refusal) from None
            except (sqlite3.Warning, sqlite3.ProgrammingError, ValueError, OverflowError) as exc:
                raise SqlError(f"query failed: {exc}") from None
            if cursor.description is None:
                raise ReadOnlyViolation(NO_ROWS)
            return SqlResult([d[0] for d in cursor.description], rows)
        finally:
            conn.close()
            printf.close()

    def _sqlite_error(self, exc: sqlite3.DatabaseError, refused: list[str], printf_refusal: str | None) -> DssError:
        message = str(exc)
        if refused:
            return ReadOnlyViolation(refused[0])
        if printf_refusal is not None:
            return SqlError(f"query failed: {printf_refusal}")
        if "not authorized" in message or "authorization denied" in message or "readonly" in message:
            return ReadOnlyViolation(f"sql() runs read-only queries only: {message}")
        if "interrupted" in message:
            return SqlError(f"query ran longer than {self.timeout_s}s")
        if getattr(exc, "sqlite_errorname", None) == "SQLITE_TOOBIG":
            return SqlError(
                f"query failed: a value grew past {MAX_VALUE_BYTES >> 20} MiB, the most sql() "
                "allows for one string or blob"
            )
        if message == "query string is too large":
            return SqlError(
                f"query failed: the query text is longer than {MAX_QUERY_BYTES >> 10} KiB, the most sql() allows"
            )
        return SqlError(f"query failed: {message}")

    # -- PostgreSQL ------------------------------------------------------------------------

    def _run_server(self, query: str, params: dict[str, Any] | None, max_rows: int) -> SqlResult:
        import psycopg

        conn = self._connect()
        timer = threading.Timer(self.timeout_s, _cancel, (conn,))
        timer.daemon = True
        timer.start()
        try:
            if params is not None:
                try:
                    psycopg.ClientCursor(conn).mogrify(query, params)  # checks them; sends nothing
                except (psycopg.Error, ValueError, OverflowError, TypeError) as exc:
                    raise SqlError(f"bad parameters: {exc}") from None
            cursor = conn.cursor()
            cursor.execute(query, params, prepare=True)  # a prepared statement: exactly one statement
            if cursor.description is None:
                raise ReadOnlyViolation(NO_ROWS)
            columns = [column.name for column in cursor.description]
            rows = cursor.fetchmany(max_rows)
            cursor.execute("SELECT pg_catalog.txid_current_if_assigned()", prepare=True)
            if cursor.fetchone() != (None,):
                raise ReadOnlyViolation(
                    "sql() runs read-only queries only: the statement wrote to the database (rolled back)"
                )
            return SqlResult(columns, [tuple(r) for r in rows])
        except psycopg.Error as exc:
            raise self._server_error(exc) from None
        except (ValueError, OverflowError) as exc:  # a value psycopg cannot load, a text it cannot encode
            raise SqlError(f"query failed: {exc}") from None
        finally:
            timer.cancel()
            conn.close()  # never committed: the server rolls the transaction back

    def _server_error(self, exc: psycopg.Error) -> DssError:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        state = exc.sqlstate or ""
        if state == "57014":
            return SqlError(f"query ran longer than {self.timeout_s}s")
        if state.startswith("25"):  # read-only transaction, or an attempt to change the transaction
            return ReadOnlyViolation(f"sql() runs read-only queries only: {message}")
        if state == "42501":
            return ReadOnlyViolation(f"sql() may not do this: {message}")
        return SqlError(f"query failed: {message}")

    def _connect(self) -> psycopg.Connection[Any]:
        """A connection as the reader role, in a read-only transaction with the time limit set."""
        import psycopg

        args = self._reader_args()
        try:
            conn = psycopg.connect(**args)
        except psycopg.Error as exc:
            raise SqlError(
                f"cannot connect to the catalog as the SQL role {args.get('user')!r}: {str(exc).strip()}"
            ) from None
        conn.read_only = True
        return conn

    def _reader_args(self) -> dict[str, Any]:
        with self._lock:
            if self._connect_args is None:
                self._connect_args = self._prepare_reader()
            return self._connect_args

    def _prepare_reader(self) -> dict[str, Any]:
        """Connection arguments of the reader role, creating the role if need be, checked once."""
        import psycopg

        database, schema = catalog_place(self.engine)
        if self._reader_url is None:
            role = reader_role(database, schema)
            url = self.engine.url.set(username=role, password=provision(self.engine, role, schema))
        else:
            url = make_url(self._reader_url)
        _, args = self.engine.dialect.create_connect_args(url)
        args.pop("context", None)  # psycopg's own adapters, not SQLAlchemy's
        timeout_ms = max(1, int(self.timeout_s * 1000))
        args["options"] = (
            f"{args.get('options', '')} -c statement_timeout={timeout_ms} -c default_transaction_read_only=on"
        ).strip()
        args["connect_timeout"] = max(2, math.ceil(self.timeout_s))
        args["application_name"] = "dss sql"
        try:
            conn = psycopg.connect(**args)
            try:
                problems = reader_problems(conn, schema)
            finally:
                conn.close()
        except psycopg.Error as exc:
            raise ConfigError(
                f"cannot connect to the catalog as the SQL role {url.username!r}: {str(exc).strip()}"
            ) from None
        if problems:
            raise ConfigError(f"the SQL role {url.username!r} is not read-only ({'; '.join(problems)}): {HOW_TO}")
        return dict(args)


def _cancel(conn: psycopg.Connection[Any]) -> None:
    """Cancel the running query of ``conn`` (from the timer thread)."""
    import psycopg

    try:
        conn.cancel()
    except psycopg.Error:
        pass  # the connection is already closed: nothing runs


_SQLITE_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
_SQLITE_PRAGMAS = {"table_info", "table_xinfo", "index_list", "index_info"}

MAX_VALUE_BYTES = 8 << 20
"""The longest string or blob a SQLite ``sql()`` statement may make or read (``SQLITE_LIMIT_LENGTH``)."""

MAX_QUERY_BYTES = 100 << 10
"""The longest query text ``sql()`` runs on SQLite (``SQLITE_LIMIT_SQL_LENGTH``)."""

MAX_RESULT_BYTES = 64 << 20
"""The most bytes of strings and blobs one ``sql()`` result may hold (on both catalogs)."""

_SQLITE_LIMITS = (
    (sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES),
    (sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_QUERY_BYTES),
    (sqlite3.SQLITE_LIMIT_ATTACHED, 0),
)
"""Limits of the reader's own connection (the writer's connections keep SQLite's defaults)."""


def _fetch(cursor: Any, max_rows: int) -> list[tuple[Any, ...]]:
    """Up to ``max_rows`` rows of ``cursor``; ``SqlError`` once their strings and blobs pass
    :data:`MAX_RESULT_BYTES` (so many large values cannot fill the process's memory)."""
    rows: list[tuple[Any, ...]] = []
    size = 0
    for row in cursor:
        rows.append(tuple(row))
        size += sum(len(v) for v in row if isinstance(v, (str, bytes, bytearray, memoryview)))
        if size > MAX_RESULT_BYTES:
            raise SqlError(
                f"query failed: the result holds more than {MAX_RESULT_BYTES >> 20} MiB of strings and "
                "blobs, the most sql() returns; select fewer rows or columns"
            )
        if len(rows) == max_rows:
            break
    return rows


def _sqlite_authorizer(refused: list[str]) -> Any:
    """An authorizer that allows reading and calling the functions of :data:`SQLITE_FUNCTIONS`,
    and nothing else; the message for refusing a secret table or a function is appended to ``refused``."""

    def authorize(action: int, arg1: Any, arg2: Any, dbname: Any, source: Any) -> int:
        if action == sqlite3.SQLITE_READ and arg1 in SECRET_TABLES:
            refused.append(f"sql() may not do this: permission denied for table {arg1}")
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION:
            if is_allowed(arg2):
                return sqlite3.SQLITE_OK
            refused.append(
                f"sql() may not call {arg2}(): it is not on the list of functions sql() allows "
                "(see the Python API documentation, section SQL)"
            )
            return sqlite3.SQLITE_DENY
        if action in _SQLITE_ALLOWED or action == sqlite3.SQLITE_PRAGMA and arg1 in _SQLITE_PRAGMAS:
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    return authorize
