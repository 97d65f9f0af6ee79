"""Several handles (and processes) on one store folder see each other's acknowledged writes.

Two ``Store`` objects in one process share nothing but the folder and the catalog, exactly
as two processes do; the last test uses a real second process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dss
from tests.conftest import LAYOUT, page, pages_for
from tests.crash_child import LAYOUT as CRASH_LAYOUT
from tests.crash_child import payload

ROOT = Path(__file__).resolve().parents[2]

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
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "0\n"
        version = store.commit("s", T, pages_for(T))
        child.stdin.write("again\n")
        child.stdin.flush()
        assert child.stdout.readline() == f"20 {version.version_id}\n"
        child.stdin.close()
        assert child.wait(30) == 0


def test_a_handle_behind_the_pruned_change_feed_reloads_everything(open_store, monkeypatch) -> None:
    import dss.catalog.feed

    monkeypatch.setattr(dss.catalog.feed, "KEPT", 3)
    monkeypatch.setattr(dss.catalog.feed, "PRUNE_EVERY", 2)
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
    assert floor > 0 and a.sql(f"SELECT COUNT(*) FROM feed WHERE seq <= {floor}").rows == [(0,)]
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


class Child:
    """A ``tests.store_child`` process on the store: one command a line, one answer a line."""

    def __init__(self, folder: Path, url: str | None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.store_child", str(folder), url or "-"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask(None) == "ready"

    def ask(self, command: str | None) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def exit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("exit\n")
        self.process.stdin.close()
        assert self.process.wait(60) == 0

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        assert self.process.wait(60) == -signal.SIGKILL


def assert_kept(folder: Path, url: str | None, acked: dict[str, list[str]]) -> None:
    """Every acknowledged commit (``ack <version_id> <num_tokens>`` per session) is there, exact."""
    with dss.open(folder, catalog_url=url) as store:
        for session_id, answers in acked.items():
            versions = {v.version_id: v for v in store.versions(session_id)}
            for answer in answers:
                _, version_id, num_tokens = answer.split()
                assert int(version_id) in versions, f"acknowledged {answer} of {session_id} is lost"
                tokens = [i % 1000 for i in range(int(num_tokens))]
                assert store.tokens(session_id, int(version_id)) == tokens
            tokens = store.tokens(session_id)
            full = len(tokens) // CRASH_LAYOUT.page_tokens
            result = store.resume(session_id, tokens + [1])
            assert result.matched_tokens == full * CRASH_LAYOUT.page_tokens
            assert store.read_pages(result.pages) == [payload(tokens, i) for i in range(full)]
        assert store.check() == []


def test_commits_after_an_erasure_survive_another_process(tmp_path: Path, catalog_url) -> None:
    """A commits, forgets a user (here an unknown one), B opens and closes the store, A commits
    again. Every acknowledged commit of A is seen by a fresh process and survives SIGKILL of A.

    The erasure's raw-byte scan once read catalog.db with ``open()``: closing that file dropped
    A's SQLite locks, so B, closing, took itself for the last user, checkpointed and deleted the
    WAL under A, and A's later commits went to a deleted file.
    """
    folder = tmp_path / "store"
    a = Child(folder, catalog_url)
    acked = {"s": [a.ask("commit s u 20")]}
    assert a.ask("forget nobody") == "forgot 0 no_such_user"
    Child(folder, catalog_url).exit()
    acked["s"] += [a.ask("commit s u 12") for _ in range(3)]
    assert all(answer.startswith("ack ") for answer in acked["s"])
    assert_kept(folder, catalog_url, acked)
    acked["s"].append(a.ask("commit s u 5"))
    a.kill()
    assert_kept(folder, catalog_url, acked)


def test_commits_interleaved_with_erasures_in_several_processes(tmp_path: Path, catalog_url) -> None:
    """Three processes take turns: each commits to its own session, then either gives a user
    pages and erases it, or this process (which holds no other handle) opens and closes the
    store. Every acknowledged commit is kept, seen by a fresh process and after SIGKILL of all
    three; every erased user is gone."""
    folder = tmp_path / "store"
    children = [Child(folder, catalog_url) for _ in range(3)]
    acked: dict[str, list[str]] = {f"p{n}": [] for n in range(3)}
    for turn in range(12):
        for n, child in enumerate(children):
            acked[f"p{n}"].append(child.ask(f"commit p{n} u{n} {4 + turn}"))
            if (turn + n) % 2 == 0:
                assert child.ask(f"commit gone-{turn}-{n} gone-{turn}-{n} 16").startswith("ack ")
                assert child.ask(f"forget gone-{turn}-{n}") == "forgot 2 verified"
            else:
                dss.open(folder, catalog_url=catalog_url).close()
    assert all(answer.startswith("ack ") for answers in acked.values() for answer in answers)
    assert_kept(folder, catalog_url, acked)
    for child in children:
        child.kill()
    assert_kept(folder, catalog_url, acked)
    with dss.open(folder, catalog_url=catalog_url) as store:
        assert sorted(s.session_id for s in store.sessions()) == ["p0", "p1", "p2"]
        assert len(store.audit()) == 18
