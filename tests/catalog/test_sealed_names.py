"""Session ids and version labels are never stored in clear; ids are never handed out twice.

The PostgreSQL tests read the server's own files (this machine's data directory, as CI's):
a canary session id and label must never reach them, before or after an erasure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa

import dss
from tests.conftest import LAYOUT, PG_URL, pages_for

T = list(range(1, 13))
CANARY_ID = "canary-session-7f3a9c"
CANARY_LABEL = "canary-label-52be01"


def _pg_files() -> list[Path]:
    engine = sa.create_engine(PG_URL)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("CHECKPOINT"))  # every dirty page on disk, so the scan sees what the server holds
        data = Path(conn.execute(sa.text("SHOW data_directory")).scalar())
        oid = conn.execute(sa.text("SELECT oid FROM pg_database WHERE datname = current_database()")).scalar()
    engine.dispose()
    return [p for folder in (data / "base" / str(oid), data / "pg_wal") for p in folder.rglob("*") if p.is_file()]


def _found(files: list[Path], needles: list[bytes]) -> list[str]:
    hits = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:  # a WAL segment recycled while we read
            continue
        hits += [f"{needle!r} in {path}" for needle in needles if needle in data]
    return hits


def test_session_ids_and_labels_never_reach_postgresql_in_clear(pg_url: str, tmp_path: Path) -> None:
    needles = [CANARY_ID.encode(), CANARY_LABEL.encode(), CANARY_ID.encode("utf-16-le")]
    with dss.open(tmp_path / "store", catalog_url=pg_url) as store:
        store.create_session(CANARY_ID, user_id="alice", tenant_id="acme", layout=LAYOUT)
        v1 = store.commit(CANARY_ID, T, pages_for(T), label=CANARY_LABEL)
        store.branch(CANARY_ID, v1.version_id, CANARY_ID + "-b", label=CANARY_LABEL)
        assert [s.session_id for s in store.sessions(tenant_id="acme")] == [CANARY_ID, CANARY_ID + "-b"]
        assert [v.label for v in store.versions(CANARY_ID)] == [CANARY_LABEL]
        assert _found(_pg_files(), needles) == []
        receipt = store.forget_user("alice", tenant_id="acme")
        assert receipt.removed.sessions == 2
        assert _found(_pg_files(), needles) == []
        assert store.check() == []


def test_names_and_labels_round_trip_through_a_reopen(open_store) -> None:
    store = open_store()
    store.create_session("naïve ✓ chat", user_id="u", tenant_id="t", layout=LAYOUT)
    store.commit("naïve ✓ chat", T, label="first ✓")
    store.commit("naïve ✓ chat", T + [1], label=None)
    other = open_store()
    assert other.session("naïve ✓ chat", tenant_id="t").session_id == "naïve ✓ chat"
    assert [(v.label, v.num_tokens) for v in other.versions("naïve ✓ chat")] == [("first ✓", 12), (None, 13)]
    assert other.check() == []


def test_a_session_is_found_only_in_its_own_tenant(store: dss.Store) -> None:
    store.create_session("s", user_id="u", tenant_id="t1", layout=LAYOUT)
    store.create_session("s", user_id="u", tenant_id="t2", layout=LAYOUT)
    with pytest.raises(dss.AmbiguousSession):
        store.session("s")
    assert store.session("s", tenant_id="t2").tenant_id == "t2"
    with pytest.raises(dss.UnknownSession):
        store.session("s", tenant_id="t3")


def test_the_views_name_sessions_by_their_key(store: dss.Store) -> None:
    store.create_session("chat-1", user_id="u", tenant_id="t", layout=LAYOUT)
    v1 = store.commit("chat-1", T, label="hello")
    rows = store.sql("SELECT session_key, tenant_id, num_versions FROM session_summary").rows
    assert rows == [(store.keys.session_key("chat-1").hex(), "t", 1)]
    rows = store.sql("SELECT session_key, version_id, has_label FROM version_summary").rows
    assert [(k, v, bool(h)) for k, v, h in rows] == [(store.keys.session_key("chat-1").hex(), v1.version_id, True)]


# -- ids are never handed out twice -----------------------------------------------------------


def test_version_and_session_ids_are_not_reused_after_a_delete(open_store) -> None:
    """SQLite without AUTOINCREMENT gives a new row the largest id present plus one: deleting the
    newest session (and its version) used to hand both ids to the next session made."""
    store = open_store()
    store.create_session("a", user_id="u1", layout=LAYOUT)
    store.create_session("b", user_id="u2", layout=LAYOUT)
    store.commit("a", T)
    vb = store.commit("b", T)
    ref_b = store.mirror.state("b", None).ref
    store.delete_session("b")
    store.create_session("c", user_id="u3", layout=LAYOUT)
    vc = store.commit("c", T)
    assert vc.version_id > vb.version_id
    assert store.mirror.state("c", None).ref > ref_b
    reopened = open_store()
    reopened.create_session("d", user_id="u3", layout=LAYOUT)
    assert reopened.commit("d", T).version_id > vc.version_id


def test_user_rows_are_not_reused_after_an_erasure(open_store) -> None:
    store = open_store()
    store.create_session("a", user_id="alice", layout=LAYOUT)
    alice = store.mirror.user_ref("default", "alice")
    store.forget_user("alice", tenant_id="default")
    store.create_session("b", user_id="bob", layout=LAYOUT)
    assert store.mirror.user_ref("default", "bob") > alice  # type: ignore[operator]
    assert [entry.receipt.erasure_id for entry in store.audit()] == [1]


def test_sqlite_tables_with_surrogate_keys_use_autoincrement(sqlite_store: dss.Store) -> None:
    with sqlite_store.catalog.engine.connect() as conn:
        tables = dict(conn.exec_driver_sql("SELECT name, sql FROM sqlite_master WHERE type = 'table'").all())
    assert {name for name, sql in tables.items() if "AUTOINCREMENT" in sql} == {
        "tenants",
        "users",
        "layouts",
        "sessions",
        "versions",
        "segments",
        "quarantine",
        "feed",
        "erasures",
        "audit",
        "nodes",
    }
    assert [name for name, sql in tables.items() if "id INTEGER NOT NULL" in sql and "AUTOINCREMENT" not in sql] == [
        "catalog_seq"
    ]  # one row, id 1, never deleted


# -- the upgrade from revision 0002 ------------------------------------------------------------


def test_upgrade_from_0002_seals_names_and_labels_and_keeps_ids_above_old_ones(tmp_path: Path) -> None:
    """A 0002 catalog with a clear session id and label, and a deleted version 9 above the
    last one present: after ``upgrade`` the names read back, the clear text is gone from the
    file, and new version ids start above 9 (``catalog_seq`` bounds every id ever given)."""
    from alembic import command

    from dss.catalog.database import Catalog, _alembic_config
    from dss.core.crypto import master_check, new_data_key, wrap
    from dss.pages.keys import owner_tag

    master = bytes(range(32))
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    old = Catalog(url)
    with old.engine.begin() as conn:
        config = _alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "0002")
        stamp = "2026-11-30 00:00:00"
        for statement, values in [
            ("INSERT INTO tenants (id, tenant_id, created_at) VALUES (1, 't', :s)", {}),
            ("INSERT INTO users (id, tenant_ref, user_id, created_at) VALUES (1, 1, 'u', :s)", {}),
            (
                "INSERT INTO user_keys (user_ref, wrapped, created_at) VALUES (1, :w, :s)",
                {"w": wrap(master, new_data_key(), owner_tag(1))},
            ),
            ("INSERT INTO store_meta (key, value) VALUES ('master_check', :m)", {"m": master_check(master)}),
            (
                "INSERT INTO layouts (id, digest, name, page_tokens, page_bytes, spec) VALUES (1, :d, :n, 4, 16, :j)",
                {"d": LAYOUT.digest, "n": LAYOUT.name, "j": __import__("json").dumps(LAYOUT.to_dict())},
            ),
            (
                (
                    "INSERT INTO sessions (id, session_id, tenant_ref, user_ref, layout_ref, head_id, created_at, "
                    "last_access, seq) VALUES (1, 'old-clear-session', 1, 1, 1, 3, :s, :s, 9)"
                ),
                {},
            ),
            (
                (
                    "INSERT INTO versions (id, session_ref, parent_id, base_id, base_len, num_tokens, suffix, label, "
                    "pinned, created_at, sealed) VALUES (3, 1, NULL, NULL, 0, 2, :b, 'old-clear-label', 0, :s, 0)"
                ),
                {"b": bytes([1, 0, 0, 0, 2, 0, 0, 0])},
            ),
            ("UPDATE catalog_seq SET seq = 9", {}),
        ]:
            conn.execute(sa.text(statement), {"s": stamp, **values})
    with pytest.raises(dss.ConfigError, match="needs the store's master key"):
        old.upgrade()
    assert old.revision() == "0002"
    assert old.upgrade(master) == ("0002", "0007")
    with old.engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    old.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("catalog.db*"))
    assert b"old-clear-session" not in raw and b"old-clear-label" not in raw
    with dss.open(tmp_path, master_key=master.hex()) as store:
        assert [s.session_id for s in store.sessions()] == ["old-clear-session"]
        assert [(v.version_id, v.label) for v in store.versions("old-clear-session")] == [(3, "old-clear-label")]
        assert store.tokens("old-clear-session") == [1, 2]
        assert store.commit("old-clear-session", [1, 2, 3]).version_id == 10
        assert store.check() == []


def test_cli_upgrade_passes_the_master_key(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dss.cli.main import main

    result = CliRunner().invoke(
        main, ["--home", str(tmp_path), "db", "upgrade"], env={"DSS_MASTER_KEY_FILE": os.environ["DSS_MASTER_KEY_FILE"]}
    )
    assert result.exit_code == 0, result.output
    assert result.output == "catalog upgraded from empty to 0007\n"


def test_upgrade_scrubs_the_page_ids_and_file_names_older_erasure_jobs_kept(tmp_path: Path) -> None:
    import json

    from alembic import command

    from dss.catalog.database import Catalog, _alembic_config
    from dss.core.rawscan import needle

    page_id = bytes(range(16))
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    old = Catalog(url)
    with old.engine.begin() as conn:
        config = _alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "0002")
        for job_id, state in ((1, "done"), (2, "catalog_purged")):
            plan = {"removed": {"sample": [page_id.hex()], "files": ["w-0000000001.seg"], "pages": 1}}
            conn.execute(
                sa.text(
                    "INSERT INTO erasures (id, tenant_id, user_id, user_ref, state, plan, started_at) "
                    "VALUES (:id, 't', 'u', NULL, :state, :plan, '2026-11-30')"
                ),
                {"id": job_id, "state": state, "plan": json.dumps(plan)},
            )
    old.upgrade()
    with old.engine.connect() as conn:
        plans = dict(conn.exec_driver_sql("SELECT id, plan FROM erasures").all())
    old.close()
    digest = __import__("hashlib").sha256(b"w-0000000001.seg").hexdigest()
    assert json.loads(plans[1]) == {"removed": {"sample": [needle(page_id)], "file_digests": [digest], "pages": 1}}
    assert json.loads(plans[2]) == {
        "removed": {"sample": [needle(page_id)], "files": ["w-0000000001.seg"], "pages": 1}
    }  # its files are still to delete
