"""Several handles (and processes) on one store folder see each other's acknowledged writes.

Two ``Store`` objects in one process share nothing but the folder and the catalog, exactly
as two processes do; the last test uses a real second process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dss
from tests.conftest import LAYOUT, page, pages_for

T = list(range(1, 21))  # 5 pages


def test_commit_in_one_is_seen_by_resume_in_the_other(open_store) -> None:
    a, b = open_store(), open_store()
    a.create_session("s", user_id="u", layout=LAYOUT)
    assert b.resume("s", T).matched_tokens == 0
    v1 = a.commit("s", T, pages_for(T))
    r = b.resume("s", T + [1])
    assert (r.matched_tokens, r.version_id, r.tiers) == (20, v1.version_id, {"disk": 20})
    assert b.read_pages(r.pages) == list(pages_for(T).values())
    v2 = b.commit("s", T + [7, 7, 7, 7], {5: page(99)})
    assert v2.parent_id == v1.version_id  # b saw a's head
    assert a.resume("s", T + [7, 7, 7, 7, 1]).matched_tokens == 24
    a.rollback("s", v1.version_id)
    assert b.session("s").head_id == v1.version_id
    v3 = b.commit("s", T + [8])
    assert v3.parent_id == v1.version_id
    assert a.check() == [] and b.check() == []


def test_deletes_and_releases_propagate(open_store) -> None:
    a, b = open_store(), open_store()
    a.create_session("s", user_id="u", layout=LAYOUT)
    a.commit("s", T, pages_for(T))
    assert b.resume("s", T).matched_tokens == 20
    b.read_pages(b.resume("s", T).pages)  # b now holds the pages in its host tier too
    a.delete_session("s")
    b.create_session("s", user_id="u", layout=LAYOUT)
    assert b.resume("s", T).matched_tokens == 0  # released pages are gone from b's host tier as well
    assert b.host.used_bytes == 0
    assert a.check() == [] and b.check() == []


def test_stale_handle_commits_on_top_of_the_real_head(open_store) -> None:
    a, b = open_store(), open_store()
    a.create_session("s", user_id="u", layout=LAYOUT)
    v1 = a.commit("s", T)
    assert b.versions("s")[0].version_id == v1.version_id
    v2 = a.commit("s", T + [1])
    v3 = b.commit("s", T + [2])  # b's cached head is v1, the catalog's is v2
    assert v3.parent_id == v2.version_id
    assert [v.version_id for v in a.versions("s")] == [v1.version_id, v2.version_id, v3.version_id]


def test_a_second_process_sees_commits_at_once(tmp_path: Path, catalog_url) -> None:
    folder = tmp_path / "store"
    with dss.open(folder, catalog_url=catalog_url) as store:
        store.create_session("s", user_id="u", layout=LAYOUT)
        script = textwrap.dedent(f"""
            import sys, dss
            store = dss.open({str(folder)!r}, catalog_url={catalog_url!r})
            print(store.resume("s", {T!r}).matched_tokens, flush=True)
            for line in sys.stdin:
                print(store.resume("s", {T!r}).matched_tokens, store.session("s").head_id, flush=True)
        """)
        child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "0\n"
        version = store.commit("s", T, pages_for(T))
        child.stdin.write("again\n")
        child.stdin.flush()
        assert child.stdout.readline() == f"20 {version.version_id}\n"
        child.stdin.close()
        assert child.wait(30) == 0


def test_a_handle_behind_the_pruned_change_feed_reloads_everything(open_store, monkeypatch) -> None:
    import dss.catalog

    monkeypatch.setattr(dss.catalog, "CHANGES_KEPT", 3)
    monkeypatch.setattr(dss.catalog, "PRUNE_EVERY", 2)
    a, b = open_store(), open_store()
    a.create_session("s", user_id="u", layout=LAYOUT)
    a.create_session("gone", user_id="u", layout=LAYOUT)
    g = [t + 100 for t in T]  # its own tokens: its pages are its own
    a.commit("gone", g, pages_for(g, tag=3))
    gone = b.resume("gone", g).pages
    assert len(gone) == 5
    b.read_pages(gone)  # b holds those pages in its host tier
    assert all(ref.page_id in b.host for ref in gone)
    v1 = a.commit("s", T, pages_for(T))
    for n in range(6):  # many more writes than the feed keeps
        a.commit("s", T + [n] * 4, {5: page(50 + n)})
    a.rollback("s", v1.version_id)
    a.delete_session("gone")
    floor = a.sql("SELECT floor FROM catalog_seq").rows[0][0]
    assert floor > 0 and a.sql(f"SELECT COUNT(*) FROM changes WHERE seq <= {floor}").rows == [(0,)]
    r = b.resume("s", T + [5] * 4)
    assert (r.matched_tokens, b.session("s").head_id, len(b.versions("s"))) == (24, v1.version_id, 7)
    assert b.read_pages(r.pages)[5] == page(55)
    with pytest.raises(dss.UnknownSession):
        b.resume("gone", g)
    assert not any(ref.page_id in b.host for ref in gone)  # released pages left b's host tier too
    assert b.check() == []


def test_a_reused_row_id_never_answers_for_a_deleted_session(open_store) -> None:
    """SQLite hands a deleted row's id to the next insert: a cached name must not follow it."""
    a, b = open_store(), open_store()
    a.create_session("old", user_id="alice", layout=LAYOUT)
    a.commit("old", T, pages_for(T))
    assert b.resume("old", T, tenant_id="default").matched_tokens == 20  # b caches ("old", "default") -> row
    a.delete_session("old")
    a.create_session("new", user_id="mallory", layout=LAYOUT)
    a.commit("new", T, pages_for(T, tag=9))
    assert a.sql("SELECT COUNT(*) FROM sessions").rows == [(1,)]
    with pytest.raises(dss.UnknownSession):
        b.resume("old", T, tenant_id="default")
    assert b.session("new").user_id == "mallory"
