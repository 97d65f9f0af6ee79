"""Read-only SQL (dss.catalog.readonly): any text, on both catalogs, changes nothing and raises only
``SqlError`` or ``ReadOnlyViolation``; on PostgreSQL it runs as a role that may only read dss's
tables and views. Every attack asserts the exact error class and that no catalog row changed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

import dss
from dss.catalog.reader import PASSWORD_KEY, SECRET_TABLES, VIEWS, readable_relations, reader_role
from dss.catalog.readonly import MAX_RESULT_BYTES, MAX_VALUE_BYTES
from dss.catalog.schema import Base
from dss.catalog.sqlfunctions import SQLITE_FUNCTIONS
from tests.conftest import LAYOUT, PG_URL, _pg_schema, pages_for

ROV, ERR = dss.ReadOnlyViolation, dss.SqlError
T = list(range(1, 13))
SUPER = PG_URL.replace("postgresql+psycopg://", "postgresql://")

# (text, class on SQLite, class on PostgreSQL); {marker} is a path under the test's tmp_path.
ATTACKS: list[tuple[str, type[dss.DssError], type[dss.DssError]]] = [
    # several statements: at most one ever runs
    ("COMMIT; BEGIN READ WRITE; DELETE FROM pages", ROV, ERR),
    ("SELECT 1; DELETE FROM pages", ERR, ERR),
    ("SELECT 1; COMMIT; BEGIN READ WRITE; DELETE FROM pages", ERR, ERR),
    # transaction control and session settings
    ("COMMIT", ROV, ROV),
    ("BEGIN", ROV, ROV),
    ("BEGIN READ WRITE", ERR, ROV),
    ("ROLLBACK", ROV, ROV),
    ("SAVEPOINT s", ROV, ROV),
    ("SET statement_timeout = 0", ERR, ROV),
    ("SET default_transaction_read_only = off", ERR, ROV),
    ("SET TRANSACTION READ WRITE", ERR, ROV),
    ("RESET ALL", ERR, ROV),
    ("DISCARD ALL", ERR, ROV),
    ("SET ROLE postgres", ERR, ROV),
    ("SET SESSION AUTHORIZATION postgres", ERR, ROV),
    ("SELECT set_config('role', 'postgres', false)", ERR, ROV),
    ("SELECT set_config('session_authorization', 'postgres', false)", ERR, ROV),
    ("SELECT set_config('transaction_read_only', 'off', true)", ERR, ROV),
    # writes, plain and hidden
    ("INSERT INTO tenants (tenant_id, created_at) VALUES ('x', '2020-01-01')", ROV, ROV),
    ("UPDATE sessions SET head_id = NULL", ROV, ROV),
    ("DELETE FROM pages", ROV, ROV),
    ("DROP TABLE versions", ROV, ROV),
    ("CREATE TABLE evil (x INTEGER)", ROV, ROV),
    ("ALTER TABLE sessions ADD COLUMN x INTEGER", ROV, ROV),
    ("TRUNCATE pages", ERR, ROV),
    ("CREATE TEMP TABLE x (a INTEGER)", ROV, ROV),
    ("REINDEX pages", ROV, ERR),
    ("REINDEX TABLE pages", ERR, ROV),
    ("WITH d AS (DELETE FROM pages RETURNING 1) SELECT count(*) FROM d", ERR, ROV),
    ("SELECT * FROM pages FOR UPDATE", ERR, ROV),
    ("SELECT 1 FROM sessions FOR SHARE", ERR, ROV),
    ("EXPLAIN DELETE FROM pages", ROV, ROV),
    ("EXPLAIN ANALYZE DELETE FROM pages", ERR, ROV),
    ("SELECT nextval('sessions_id_seq')", ERR, ROV),
    ("SELECT setval('sessions_id_seq', 1)", ERR, ROV),
    ("SELECT txid_current()", ERR, ROV),
    ("SELECT lo_creat(-1)", ERR, ROV),
    ("SELECT lo_from_bytea(0, 'x')", ERR, ROV),
    # commands that return no rows
    ("DO $$BEGIN DELETE FROM pages; END$$", ERR, ROV),
    ("DO $$BEGIN PERFORM 1; END$$", ERR, ROV),
    ("LOCK TABLE pages IN ACCESS EXCLUSIVE MODE", ERR, ROV),
    ("LOCK TABLE pages IN ACCESS SHARE MODE", ERR, ROV),
    ("NOTIFY dss, 'x'", ERR, ROV),
    ("LISTEN dss", ERR, ROV),
    ("PREPARE p AS DELETE FROM pages", ERR, ROV),
    ("EXECUTE p", ERR, ERR),
    ("DEALLOCATE ALL", ERR, ROV),
    ("VACUUM", ROV, ROV),
    ("ANALYZE", ROV, ROV),
    ("CHECKPOINT", ERR, ROV),
    # the database host's files and programs
    ("COPY pages TO PROGRAM 'touch {marker}'", ERR, ROV),
    ("COPY pages TO '{marker}'", ERR, ROV),
    ("COPY pages FROM '/etc/hostname'", ERR, ROV),
    ("COPY (SELECT 1) TO STDOUT", ERR, ERR),
    ("SELECT pg_read_file('/etc/hostname')", ERR, ROV),
    ("SELECT pg_read_binary_file('/etc/hostname')", ERR, ROV),
    ("SELECT pg_ls_dir('.')", ERR, ROV),
    ("SELECT pg_stat_file('/etc/hostname')", ERR, ROV),
    ("SELECT lo_import('/etc/hostname')", ERR, ROV),
    ("SELECT lo_export(1, '{marker}')", ERR, ROV),
    ("SELECT current_setting('data_directory')", ERR, ROV),
    ("SELECT pg_reload_conf()", ERR, ROV),
    ("SELECT dblink_exec('dbname=test user=postgres', 'DELETE FROM pages')", ERR, ERR),
    ("ATTACH DATABASE '{marker}' AS x", ROV, ERR),
    ("PRAGMA journal_mode = DELETE", ROV, ERR),
    ("SELECT load_extension('{marker}')", ROV, ERR),
    # functions that reach the process, not the data: a pointer into libsqlite3, and one that takes a pointer
    ("SELECT hex(fts3_tokenizer('simple'))", ROV, ERR),
    ("SELECT fts3_tokenizer('x', x'0000000000000000')", ROV, ERR),
    # key material and other roles' secrets
    ("SELECT * FROM user_keys", ROV, ROV),
    ("SELECT count(*) FROM store_meta", ROV, ROV),
    ("SELECT s.id FROM sessions s JOIN user_keys k ON true", ROV, ROV),
    ("SELECT * FROM pg_authid", ERR, ROV),
    # the text reaches the database unchanged, and nothing else raises
    ("SELECT :word", ERR, ERR),
    ("SELECT %(word)s", ERR, ERR),
    ("SELECT $1", ERR, ERR),
    ("SELECT 1 \x00; DELETE FROM pages", ERR, ERR),
    ("", ERR, ERR),
    ("   ", ERR, ERR),
    (";", ROV, ROV),
    ("-- nothing", ROV, ROV),
    ("SELEC 1", ERR, ERR),
    ("SELECT * FROM no_such_table", ERR, ERR),
    ("SELECT pg_terminate_backend(pg_backend_pid())", ERR, ERR),
    ("SELECT 'infinity'::date", ERR, ERR),
    ("SELECT '\ud800'", ERR, ERR),
]

# (text, rows): statements that run and change nothing; the same on both catalogs.
HARMLESS = [
    ("SELECT '{\"a\": 1}' AS j", [('{"a": 1}',)]),
    ("SELECT ':word' AS w, '100%' AS p, '%(x)s' AS q, '$1' AS d", [(":word", "100%", "%(x)s", "$1")]),
]

FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def is_pg(store: dss.Store) -> bool:
    return not store.catalog.is_sqlite


def snapshot(store: dss.Store) -> dict[str, Any]:
    """Every row of every catalog table (and, on PostgreSQL, the number of large objects), read as
    the catalog user, not through sql()."""
    with store.catalog.engine.connect() as conn:
        out: dict[str, Any] = {
            name: sorted(map(repr, conn.execute(table.select()).all())) for name, table in Base.metadata.tables.items()
        }
        if is_pg(store):
            out["large objects"] = conn.exec_driver_sql("SELECT count(*) FROM pg_largeobject_metadata").scalar()
    return out


@pytest.fixture
def filled(store: dss.Store) -> dss.Store:
    store.create_session("s", user_id="u", tenant_id="t", layout=LAYOUT)
    store.commit("s", T, pages_for(T))
    return store


def test_every_attack_is_refused_with_its_class_and_changes_nothing(filled: dss.Store, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    if is_pg(filled):  # dblink, where the server has it, in the catalog's schema
        with psycopg.connect(SUPER, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'dblink'").fetchone():
                conn.execute(f"CREATE EXTENSION IF NOT EXISTS dblink SCHEMA {schema_of(filled.catalog.url)}")
    filled.sql("SELECT 1 AS warm")  # the PostgreSQL role exists from here on: its row is in the snapshot
    before = snapshot(filled)
    wrong = []
    for text, on_sqlite, on_pg in ATTACKS:
        expected = on_pg if is_pg(filled) else on_sqlite
        try:
            got: Any = filled.sql(text.format(marker=marker) if "{marker}" in text else text)
        except dss.DssError as exc:
            got = type(exc)
        if got is not expected:
            wrong.append((text, expected.__name__, getattr(got, "__name__", got)))
    assert wrong == []
    assert snapshot(filled) == before
    assert not marker.exists()
    assert filled.check() == []


@pytest.mark.parametrize(("text", "rows"), HARMLESS)
def test_text_with_colons_percents_and_json_runs_unchanged(filled: dss.Store, text: str, rows: list[Any]) -> None:
    assert filled.sql(text).rows == rows


def test_parameters_use_the_drivers_placeholders(filled: dss.Store) -> None:
    text = (
        "SELECT tenant_id FROM tenants WHERE tenant_id = %(s)s"
        if is_pg(filled)
        else "SELECT tenant_id FROM tenants WHERE tenant_id = :s"
    )
    tenant = filled.sessions()[0].tenant_id
    assert filled.sql(text, {"s": tenant}) == dss.SqlResult(["tenant_id"], [(tenant,)])
    with pytest.raises(
        ERR,
        match="^bad parameters: query parameter missing: s$"
        if is_pg(filled)
        else "^query failed: You did not supply a value for binding parameter :s.$",
    ):
        filled.sql(text, {"t": 1})
    for bad in ([1], {1: 2}):
        with pytest.raises(ERR, match="^params must be a dict from parameter names to values$"):
            filled.sql("SELECT 1", bad)  # type: ignore[arg-type]
    with pytest.raises(ERR, match="^max_rows must be a positive integer, got 0$"):
        filled.sql("SELECT 1", max_rows=0)


def test_results_keep_their_columns_and_stop_at_max_rows(filled: dss.Store) -> None:
    assert filled.sql("SELECT head_id FROM sessions WHERE 1 = 0") == dss.SqlResult(["head_id"], [])
    three = filled.sql("SELECT page_index FROM pages ORDER BY page_index")
    assert three.rows == [(0,), (1,), (2,)]
    assert filled.sql("SELECT page_index FROM pages ORDER BY page_index", max_rows=2).rows == [(0,), (1,)]


def test_a_long_query_stops_at_the_time_limit(open_store: Any) -> None:
    store = open_store(sql_timeout_s=0.5)
    texts = [FOREVER]
    if is_pg(store):  # lifting the server's limit inside the statement does not help: the client cancels too
        texts += ["SELECT pg_sleep(5)", "SELECT set_config('statement_timeout', '0', false), pg_sleep(5)"]
    for text in texts:
        start = time.monotonic()
        with pytest.raises(ERR, match=r"^query ran longer than 0.5s$"):
            store.sql(text)
        assert time.monotonic() - start < 2.5


def test_one_expensive_call_fails_fast_with_a_typed_error(open_store: Any) -> None:
    """A single call that builds a huge value is stopped by the size limit, not left to run past the
    time limit inside one step: SQLite's length limit (and a printf() that checks its width and
    precision first) and its cap on a result's bytes; PostgreSQL's statement_timeout."""
    store = open_store(sql_timeout_s=1)
    cut = (
        f"^query failed: a value grew past {MAX_VALUE_BYTES >> 20} MiB, the most sql\\(\\) allows for one "
        "string or blob$"
    )
    if is_pg(store):
        # PostgreSQL may refuse the huge value itself (its 1 GB bound on one value) before the
        # timeout ends the query, depending on the machine's speed: either is bounded and typed
        bounded = "^query (ran longer than 1.0s|failed: out of memory)$"
        texts = {
            "SELECT length(repeat('x', 800000000))": bounded,
            "SELECT length(string_agg(repeat('x', 1000000), '')) FROM generate_series(1, 5000)": bounded,
        }
    else:
        texts = {
            "SELECT length(printf('%.*c', 800000000, 'x'))": f"^query failed: a printf\\(\\) width or precision "
            f"is larger than {MAX_VALUE_BYTES >> 20} MiB, the most sql\\(\\) allows for one string$",
            "SELECT length(format('%.800000000c', 'x'))": "^query failed: a printf",
            "SELECT length(zeroblob(800000000))": cut,
            "SELECT length(randomblob(800000000))": cut,
            "SELECT length(replace(hex(zeroblob(4000000)), '0', 'ab'))": cut,
            f"SELECT '{'x' * (200 << 10)}'": "^query failed: the query text is longer than 100 KiB, the most "
            "sql\\(\\) allows$",
        }
        big_rows = (
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 100) SELECT zeroblob(4000000) FROM c"
        )
        texts[big_rows] = (
            f"^query failed: the result holds more than {MAX_RESULT_BYTES >> 20} MiB of strings and "
            "blobs, the most sql\\(\\) returns; select fewer rows or columns$"
        )
    for text, message in texts.items():
        start = time.monotonic()
        with pytest.raises(ERR, match=message):
            store.sql(text)
        assert time.monotonic() - start < 5, text  # generous: a behavioural bound, not a benchmark
    if not is_pg(store):  # just under the limits, it runs
        assert store.sql("SELECT length(printf('%.*c', 1000000, 'x')), length(zeroblob(1000000))").rows == [
            (1000000, 1000000)
        ]


def test_the_readers_limits_stay_on_its_connection(sqlite_store: dss.Store) -> None:
    """The reader's length limits are set on its own connection; the writer's keep SQLite's defaults."""
    import sqlite3

    sqlite_store.sql("SELECT 1")
    raw = sqlite_store.catalog.engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert (
            conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH),
            conn.getlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH),
            conn.getlimit(sqlite3.SQLITE_LIMIT_ATTACHED),
        ) == (1_000_000_000, 1_000_000_000, 10)
        assert conn.execute("SELECT length(zeroblob(9000000)), fts3_tokenizer('simple') IS NOT NULL").fetchall() == [
            (9_000_000, 1)
        ]
    finally:
        raw.close()


def test_sqlite_calls_only_the_listed_functions(filled: dss.Store) -> None:
    """A function off the list is refused by name before the statement runs; the views, the operators
    that are functions (LIKE, GLOB, ->) and a sample of each family run."""
    if is_pg(filled):
        pytest.skip("PostgreSQL keeps privileged functions from the reader role itself (see the role tests)")
    for call in (
        "FTS3_TOKENIZER('simple')",
        "load_extension('x')",
        "changes()",
        "sqlite_compileoption_get(0)",
        "last_insert_rowid()",
        "sqlite_log(1, 'x')",
    ):
        name = call.split("(")[0].lower()
        with pytest.raises(
            ROV,
            match=f"^sql\\(\\) may not call {name}\\(\\): it is not on the list of functions "
            "sql\\(\\) allows \\(see the Python API documentation, section SQL\\)$",
        ):
            filled.sql(f"SELECT {call}")
    for view in VIEWS:
        filled.sql(f"SELECT * FROM {view}")
    row = filled.sql(
        "SELECT 'ab' LIKE 'a%', 'ab' GLOB 'a*', '{\"a\": 2}' ->> 'a', json_extract('[5]', '$[0]'), "
        "printf('%.1f|%3d', 2.25, 7), round(abs(-2.5)), sqrt(16), date('2024-02-29', '+1 day'), "
        "upper(coalesce(NULL, 'x')), (SELECT group_concat(x) FROM (SELECT 1 x UNION SELECT 2)), "
        "row_number() OVER ()"
    ).rows
    assert row == [(1, 1, 2, 5, "2.3|  7", 3.0, 4.0, "2024-03-01", "X", "1,2", 1)]
    assert {"count", "sum", "coalesce", "hex", "lower", "max", "json_extract", "strftime"} <= SQLITE_FUNCTIONS
    assert {"fts3_tokenizer", "load_extension", "readfile", "writefile", "edit"}.isdisjoint(SQLITE_FUNCTIONS)


def test_the_role_may_execute_no_privileged_function(pg_url: str, tmp_path: Path) -> None:
    """On PostgreSQL the reader role, not a list in dss, keeps the privileged functions out of reach:
    it has no EXECUTE on the server's files, large-object import and export, configuration or
    other backends; what it may call (pg_sleep, set_config) is bounded by the time limit and ends
    with its connection (see test_nothing_a_statement_sets_outlives_it)."""
    with dss.open(tmp_path / "s", catalog_url=pg_url) as store:
        store.sql("SELECT 1 AS warm")
    role = reader_role("test", schema_of(pg_url))
    functions = [
        "pg_read_file(text)",
        "pg_read_binary_file(text)",
        "pg_ls_dir(text)",
        "pg_stat_file(text)",
        "lo_import(text)",
        "lo_export(oid, text)",
        "pg_reload_conf()",
        "pg_rotate_logfile()",
        "pg_ls_waldir()",
        "pg_promote(boolean, integer)",
        "pg_file_write(text, text, boolean)",
    ]
    with psycopg.connect(SUPER) as conn:
        rows = conn.execute(
            "SELECT f, has_function_privilege(%s, f, 'EXECUTE') FROM unnest(%s::text[]) f "
            "WHERE to_regprocedure(f) IS NOT NULL",
            (role, functions),
        ).fetchall()
    assert len(rows) >= 9 and [f for f, may in rows if may] == []


def test_the_client_cancels_a_query_the_server_would_let_run(pg_url: str, tmp_path: Path) -> None:
    """The client's timer holds on its own: here the server is told no time limit at all."""
    with dss.open(tmp_path / "s", catalog_url=pg_url, sql_timeout_s=0.5) as store:
        store.sql("SELECT 1 AS warm")
        args = store.catalog.readonly._connect_args
        assert args is not None and "-c statement_timeout=500 " in args["options"]
        args["options"] = args["options"].replace("statement_timeout=500", "statement_timeout=0")
        start = time.monotonic()
        with pytest.raises(ERR, match=r"^query ran longer than 0.5s$"):
            store.sql("SELECT pg_sleep(5)")
        assert time.monotonic() - start < 2.5


def test_nothing_a_statement_sets_outlives_it(pg_url: str, tmp_path: Path) -> None:
    """Settings, notifications and locks taken by one statement on PostgreSQL are gone before the
    next: every statement runs on a connection of its own that is rolled back and closed."""
    store = dss.open(tmp_path / "s", catalog_url=pg_url, sql_timeout_s=0.5)
    listener = psycopg.connect(SUPER, autocommit=True)
    try:
        listener.execute("LISTEN dss")
        ran = [
            store.sql(text).rows
            for text in (
                "SELECT set_config('statement_timeout', '0', false) AS s",
                "SELECT set_config('default_transaction_read_only', 'off', false) AS s",
                "SELECT pg_notify('dss', 'x') AS n",
                "SELECT pg_advisory_lock(424242) AS l",
            )
        ]
        assert ran == [[("0",)], [("off",)], [("",)], [("",)]]
        assert list(listener.notifies(timeout=0.5)) == []
        assert listener.execute("SELECT pg_try_advisory_lock(424242)").fetchone() == (True,)
    finally:
        listener.close()
    with store:
        with pytest.raises(ROV):
            store.sql("DELETE FROM pages")
        with pytest.raises(ERR, match="ran longer"):
            store.sql(FOREVER)


# -- PostgreSQL: the role ----------------------------------------------------------------------


def schema_of(url: str) -> str:
    return sa.make_url(url).query["options"].split("=", 1)[1]


def privileges(role: str, schema: str) -> dict[str, tuple[bool, bool]]:
    """``relation -> (may select, may write)`` for every table, view and sequence of ``schema``."""
    with psycopg.connect(SUPER) as conn:
        rows = conn.execute(
            "SELECT c.relname, has_table_privilege(%s, c.oid, 'SELECT'), "
            "has_table_privilege(%s, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER') "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'v', 'm', 'p', 'S')",
            (role, role, schema),
        ).fetchall()
    return {name: (reads, writes) for name, reads, writes in rows}


def test_the_role_may_read_exactly_dss_tables_and_views(pg_url: str, tmp_path: Path) -> None:
    with dss.open(tmp_path / "s", catalog_url=pg_url) as store:
        store.sql("SELECT 1 AS warm")
    schema = schema_of(pg_url)
    role = reader_role("test", schema)
    with psycopg.connect(SUPER) as conn:
        flags = conn.execute(
            "SELECT rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolreplication, "
            "rolbypassrls, rolconfig FROM pg_roles WHERE rolname = %s",
            (role,),
        ).fetchone()
        views = {name for (name,) in conn.execute("SELECT viewname FROM pg_views WHERE schemaname = %s", (schema,))}
    assert flags == (
        True,
        False,
        False,
        False,
        False,
        False,
        ["default_transaction_read_only=on", f"search_path={schema}"],
    )
    assert views == set(VIEWS)
    granted = privileges(role, schema)
    assert {name for name, (reads, _) in granted.items() if reads} == set(readable_relations())
    assert [name for name, (_, writes) in granted.items() if writes] == []
    assert set(SECRET_TABLES) <= set(granted) and set(readable_relations()) <= set(granted)


def test_the_sqlite_catalog_has_exactly_the_known_views(sqlite_store: dss.Store) -> None:
    with sqlite_store.catalog.engine.connect() as conn:
        views = {name for (name,) in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'view'")}
    assert views == set(VIEWS)


def test_the_docs_say_what_sql_may_read() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    section = page.split("**What `sql()` may read.**", 1)[1].split("\n\n", 1)[0]
    assert [name for name in (*readable_relations(), *SECRET_TABLES) if f"`{name}`" not in section] == []


RACER = textwrap.dedent("""
    import os, sys, time
    import dss
    url, home, go = sys.argv[1:]
    with dss.open(home, catalog_url=url) as store:
        while not os.path.exists(go):
            time.sleep(0.001)
        print(store.sql("SELECT count(*) AS n FROM sessions").rows)
""")


def test_processes_starting_at_once_agree_on_one_role(pg_url: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    dss.open(tmp_path / "h0", catalog_url=pg_url).close()  # the catalog's tables, made once
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, pg_url, str(tmp_path / "h0"), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    time.sleep(3)  # every racer has opened its store
    go.touch()
    outputs = [racer.communicate(timeout=60) for racer in racers]
    assert [(racer.returncode, out, err) for racer, (out, err) in zip(racers, outputs)] == [(0, "[(0,)]\n", "")] * 4
    threads: list[threading.Thread] = []
    results: list[Any] = []
    stores = [dss.open(tmp_path / "h0", catalog_url=pg_url) for _ in range(4)]
    try:
        barrier = threading.Barrier(len(stores))

        def run(store: dss.Store) -> None:
            barrier.wait()
            results.append(store.sql("SELECT count(*) AS n FROM sessions").rows)

        threads = [threading.Thread(target=run, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in stores:
            s.close()
    assert results == [[(0,)]] * 4
    with psycopg.connect(SUPER) as conn:
        conn.execute(f"SET search_path = {schema_of(pg_url)}")
        assert conn.execute("SELECT count(*) FROM store_meta WHERE key = %s", (PASSWORD_KEY,)).fetchone() == (1,)
        assert conn.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname = %s", (reader_role("test", schema_of(pg_url)),)
        ).fetchone() == (1,)


def test_each_catalog_has_its_own_role(tmp_path: Path) -> None:
    for a in _pg_schema():
        for b in _pg_schema():
            with dss.open(tmp_path / "a", catalog_url=a) as one, dss.open(tmp_path / "b", catalog_url=b) as two:
                two.create_session("s", user_id="u", layout=LAYOUT)
                assert two.sql("SELECT count(*) AS n FROM sessions").rows == [(1,)]
                with pytest.raises(ROV, match="^sql\\(\\) may not do this: permission denied for schema t_"):
                    one.sql(f"SELECT count(*) FROM {schema_of(b)}.sessions")
                assert reader_role("test", schema_of(a)) != reader_role("test", schema_of(b))


@pytest.fixture
def plain_user(pg_url: str) -> Iterator[tuple[str, str]]:
    """A catalog user without CREATEROLE that owns a fresh schema: ``(catalog URL, schema)``."""
    user, schema = f"dss_test_{uuid.uuid4().hex[:10]}", schema_of(pg_url)
    with psycopg.connect(SUPER, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {user} LOGIN")
        conn.execute(f"ALTER SCHEMA {schema} OWNER TO {user}")
    try:
        yield pg_url.replace("postgres@", f"{user}@"), schema
    finally:
        with psycopg.connect(SUPER, autocommit=True) as conn:
            conn.execute(f"REASSIGN OWNED BY {user} TO postgres")
            conn.execute(f"DROP OWNED BY {user}")
            conn.execute(f"DROP ROLE {user}")


def test_without_createrole_sql_asks_for_a_role_and_uses_the_one_given(
    plain_user: tuple[str, str], tmp_path: Path
) -> None:
    url, schema = plain_user
    with dss.open(tmp_path / "s", catalog_url=url) as store:
        store.create_session("s", user_id="u", layout=LAYOUT)
        with pytest.raises(
            dss.ConfigError,
            match=r"^the catalog user may not create the SQL role 'dss_sql_\w+' "
            r"\(no CREATEROLE\): sql\(\) on PostgreSQL runs as a LOGIN role .* "
            r"set sql_url \(DSS_SQL_URL\)",
        ):
            store.sql("SELECT 1")
        assert store.check() == []
    reader = f"dss_test_r_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SUPER, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {reader} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {reader}")
        conn.execute(f"GRANT SELECT ON {schema}.sessions TO {reader}")
    reader_url = sa.make_url(url).set(username=reader).render_as_string(hide_password=False)
    try:
        with dss.open(tmp_path / "s", catalog_url=url, sql_url=reader_url) as store:
            assert store.sql("SELECT head_id FROM sessions").rows == [(None,)]
            with pytest.raises(ROV, match="^sql\\(\\) runs read-only queries only: cannot execute DELETE"):
                store.sql("DELETE FROM sessions")
        with psycopg.connect(SUPER, autocommit=True) as conn:
            conn.execute(f"GRANT INSERT ON {schema}.pages TO {reader}")
            conn.execute(f"GRANT SELECT ON {schema}.user_keys TO {reader}")
        with dss.open(tmp_path / "s", catalog_url=url, sql_url=reader_url) as store:
            with pytest.raises(
                dss.ConfigError,
                match=f"^the SQL role '{reader}' is not read-only \\(it may write to pages; it may read user_keys\\): ",
            ):
                store.sql("SELECT 1")
        with dss.open(tmp_path / "s", catalog_url=url, sql_url=PG_URL + f"?options=-csearch_path%3D{schema}") as store:
            with pytest.raises(
                dss.ConfigError,
                match="^the SQL role 'postgres' is not read-only \\(it has SUPERUSER; "
                "it has CREATEROLE; it has CREATEDB; it has REPLICATION; it has BYPASSRLS",
            ):
                store.sql("SELECT 1")
    finally:
        with psycopg.connect(SUPER, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {reader}")
            conn.execute(f"DROP ROLE {reader}")


def test_sql_url_needs_a_postgresql_catalog(tmp_path: Path) -> None:
    with pytest.raises(dss.ConfigError, match="sql_url applies to a PostgreSQL catalog only"):
        dss.open(tmp_path / "s", sql_url="postgresql://reader@127.0.0.1/test")
    assert not (tmp_path / "s").exists()
