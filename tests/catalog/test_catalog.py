"""The catalog: migrations equal the models, schema revisions are checked, views are right (read-only SQL
is tests/catalog/test_readonly_sql.py)."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

import dss
import dss.catalog.database as catalog_module
from dss.catalog.database import Catalog
from dss.catalog.schema import SCHEMA_REVISION, Base
from dss.core.crypto import OVERHEAD
from tests.conftest import LAYOUT, pages_for

T = list(range(1, 13))


def test_migrations_create_exactly_the_models(store: dss.Store) -> None:
    with store.catalog.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_fresh_catalog_is_at_the_current_revision(store: dss.Store) -> None:
    assert store.catalog.revision() == catalog_module.SCHEMA_REVISION


def test_older_schema_is_refused_then_upgraded(tmp_path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    old = Catalog(url)
    with old.engine.begin() as conn:
        config = catalog_module._alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
    old.close()
    with pytest.raises(dss.SchemaOutdated, match=r"at schema revision 0001, this dss needs 0007: run `dss db upgrade`"):
        dss.open(tmp_path)
    upgraded = Catalog(url)
    assert upgraded.upgrade() == ("0001", "0007")
    upgraded.close()
    with dss.open(tmp_path) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", T, pages_for(T))
        assert store.resume("s", T).matched_tokens == 12
        assert store.check() == []


def test_unknown_newer_schema_is_refused(store: dss.Store) -> None:
    with store.catalog.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0999'"))
    with pytest.raises(dss.SchemaTooNew, match="made by a newer dss"):
        Catalog(store.catalog.url).ensure_schema()


def test_upgrade_of_an_empty_database(tmp_path) -> None:
    catalog = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    assert catalog.revision() is None
    assert catalog.upgrade() == (None, "0007")
    assert catalog.upgrade() == ("0007", "0007")
    catalog.close()


def test_views_summarise_sessions_and_users(store: dss.Store) -> None:
    store.create_session("s", user_id="alice", tenant_id="acme", layout=LAYOUT)
    v1 = store.commit("s", T, pages_for(T))  # 3 pages of 16 bytes
    store.commit("s", T + [1, 2, 3, 4], {3: b"z" * 16})
    store.branch("s", v1.version_id, "s2")
    key = {store.keys.session_key(name).hex(): name for name in ("s", "s2")}  # views name sessions by key
    rows = store.sql(
        "SELECT session_key, tenant_id, user_id, layout, num_versions, head_tokens, num_pages, "
        "page_bytes, disk_bytes FROM session_summary"
    ).rows
    record = 32 + OVERHEAD + 16  # record header, nonce and tag, payload
    assert sorted((key[r[0]], *r[1:]) for r in rows) == [
        ("s", "acme", "alice", "test", 2, 16, 4, 64, 4 * record),
        ("s2", "acme", "alice", "test", 1, 12, 3, 48, 3 * record),
    ]
    users = store.sql(
        "SELECT tenant_id, user_id, num_sessions, num_versions, num_pages, page_bytes, disk_bytes FROM user_summary"
    ).rows
    assert users == [("acme", "alice", 2, 3, 4, 64, 2 * 32 + 4 * record)]
    tiers = store.sql("SELECT tier, num_segments, num_pages, bytes, live_bytes FROM tier_usage").rows
    assert tiers == [("disk", 2, 4, 2 * 32 + 4 * record, 4 * record)]
    heads = store.sql("SELECT session_key, version_id FROM version_summary WHERE is_head = 1").rows
    assert sorted((key[k], v) for k, v in heads) == [("s", v1.version_id + 1), ("s2", v1.version_id + 2)]


OPENER = """
import sys
import dss
try:
    dss.open(sys.argv[2], catalog_url=sys.argv[1]).close()
except dss.ConfigError as exc:
    print(type(exc).__name__)
"""


def test_processes_opening_an_empty_postgresql_catalog_at_once(pg_url: str, tmp_path) -> None:
    """Four folders race to one empty catalog: they used to race to create its tables too
    (UniqueViolation); now one creates them and binds its folder, the others are refused."""
    import subprocess
    import sys

    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, pg_url, str(tmp_path / f"h{i}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    results = sorted(p.communicate(timeout=120) + (p.returncode,) for p in procs)
    assert results == [("", "", 0)] + [("ConfigError\n", "", 0)] * 3


def test_pending_revisions_are_what_upgrade_would_apply(tmp_path) -> None:
    from alembic import command

    catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    assert catalog.pending_revisions() == ["0001", "0002", "0003", "0004", "0005", "0006", "0007"]
    with catalog.engine.begin() as conn:
        config = catalog_module._alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
    assert catalog.pending_revisions() == ["0002", "0003", "0004", "0005", "0006", "0007"]
    applied: list[str] = []
    assert catalog.upgrade(progress=applied.append) == ("0001", "0007")
    assert applied == ["0002", "0003", "0004", "0005", "0006", "0007"]
    assert catalog.pending_revisions() == []
    with catalog.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0999'"))
    assert catalog.pending_revisions() == []
    catalog.close()


def test_a_single_folder_store_becomes_node_1_of_its_catalog_on_upgrade(catalog_url: str | None, tmp_path) -> None:
    """Revision 0004 on a store made at 0003: its folder is node 1, named after the folder's
    id, and keeps its page files (made here by downgrading a current store, then upgrading)."""
    from alembic import command

    from dss.catalog import namespaces
    from dss.store.folder import ID_FILE

    home = tmp_path / "store"
    url = catalog_url or f"sqlite:///{home / 'catalog.db'}"
    tokens = list(range(1, 13))
    with dss.open(home, catalog_url=url) as store:
        store.create_session("s", layout=LAYOUT)
        store.commit("s", tokens, pages_for(tokens))
        with store.catalog.engine.connect() as conn:
            if store.catalog.is_sqlite:  # as Catalog.upgrade does: tables are rebuilt
                conn.connection.driver_connection.execute("PRAGMA foreign_keys = OFF")
            with conn.begin():
                namespaces.set_meta(conn, "store_id", bytes.fromhex((home / ID_FILE).read_text().split()[-1]))
                config = catalog_module._alembic_config()
                config.attributes["connection"] = conn
                command.downgrade(config, "0003")
    assert Catalog(url).upgrade() == ("0003", SCHEMA_REVISION)
    folder_id = (home / ID_FILE).read_text().split()[-1]
    with dss.open(home, catalog_url=url) as store:
        assert store.node == (1, folder_id[:16])
        result = store.resume("s", tokens)
        assert result.matched_tokens == 12
        assert store.read_pages(result.pages) == list(pages_for(tokens).values())
        assert store.check() == []
