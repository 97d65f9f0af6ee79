"""Group commit (dss/writer.py): concurrent writers of one process share one catalog
transaction and one round of fsyncs; a failing member fails alone; nothing is acknowledged
before it is durable (the SIGKILL test is in tests/writes/test_group_crash.py).

The tests make groups deterministic with a gate on the first group's fsync round: the first
writer leads a group of one and waits at the gate while the others queue behind it; once
they are all queued the gate opens and the second group holds every one of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

import dss
from dss.catalog import feed
from dss.catalog.change import Change, NewPage
from dss.core.errors import UnknownSession
from dss.core.hashing import checksum
from dss.core.types import PageId
from tests.conftest import LAYOUT


def payload(tag: int, index: int) -> bytes:
    return bytes([tag % 256, index % 256]) * (LAYOUT.page_bytes // 2)


def latest_seq(store: dss.Store) -> int:
    with store.catalog.read() as conn:
        return feed.latest_seq(conn)


class Gate:
    """Holds the first publish (the folder's fsync) of ``store``'s writer until :meth:`open` (a timing gate only:
    the real fsyncs run once it opens)."""

    def __init__(self, store: dss.Store) -> None:
        self.store = store
        self.reached = threading.Event()
        self.opened = threading.Event()
        self._publish = store.pages.publish
        self._first = True
        store.pages.publish = self._gated  # type: ignore[method-assign]

    def _gated(self, written: Any) -> None:
        if self._first:
            self._first = False
            self.reached.set()
            assert self.opened.wait(30)
        self._publish(written)

    def wait_queued(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while self.store.writer.queue.num_waiting < count:
            assert time.monotonic() < deadline, "writers never queued"
            time.sleep(0.005)

    def open(self) -> None:
        self.opened.set()
        self.store.pages.publish = self._publish  # type: ignore[method-assign]


def run(calls: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, BaseException], list[threading.Thread]]:
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def target(name: str, call: Callable[[], Any]) -> None:
        try:
            results[name] = call()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            errors[name] = exc

    threads = [threading.Thread(target=target, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    return results, errors, threads


def test_concurrent_commits_share_one_transaction(open_store: Callable[..., dss.Store]) -> None:
    """1 leader alone, then 6 writers queued behind it: exactly two transactions for 7 commits."""
    store = open_store()
    for n in range(7):
        store.create_session(f"s{n}", layout=LAYOUT)
    seq, groups = latest_seq(store), store.writer.queue.num_groups
    gate = Gate(store)
    tokens = {n: [n * 100 + i for i in range(10)] for n in range(7)}
    first = run({"s0": lambda: store.commit("s0", tokens[0], {0: payload(0, 0), 1: payload(0, 1)})})
    assert gate.reached.wait(30)
    rest = run(
        {
            f"s{n}": (lambda n=n: store.commit(f"s{n}", tokens[n], {0: payload(n, 0), 1: payload(n, 1)}))
            for n in range(1, 7)
        }
    )
    gate.wait_queued(6)
    assert store.resume("s0", tokens[0]).matched_tokens == 0  # reads go on while a group waits for its fsyncs
    gate.open()
    for results, errors, threads in (first, rest):
        for thread in threads:
            thread.join()
        assert errors == {}
    assert store.writer.queue.num_groups - groups == 2
    assert latest_seq(store) - seq == 2
    for n in range(7):
        result = store.resume(f"s{n}", tokens[n])
        assert result.matched_tokens == 8
        assert store.read_pages(result.pages) == [payload(n, 0), payload(n, 1)]
        assert [v.num_tokens for v in store.versions(f"s{n}")] == [10]
    assert store.check() == []
    assert sorted(store.disk.files()) == sorted(r[0] for r in store.sql("SELECT name FROM segments").rows)


def test_a_failing_member_fails_alone(open_store: Callable[..., dss.Store]) -> None:
    """A group of five: two commits built on the same head of ``twice`` (the second is ``Stale``
    inside the group and is built again alone), one on ``doomed`` which another handle deletes
    while the group waits (``UnknownSession``, its page files deleted), two plain commits. Four
    commits land, in three transactions after the leader's: the group, the retry."""
    store = open_store()
    other = open_store()
    for name in ("lead", "twice", "doomed", "a", "b"):
        store.create_session(name, layout=LAYOUT)
    seq = latest_seq(store)
    gate = Gate(store)
    first = run({"lead": lambda: store.commit("lead", [1, 2, 3, 4])})
    assert gate.reached.wait(30)
    calls = {
        "twice-1": lambda: store.commit("twice", [5, 5, 5, 5, 1], {0: payload(5, 0)}),
        "twice-2": lambda: store.commit("twice", [6, 6, 6, 6, 2], {0: payload(6, 0)}),
        "doomed": lambda: store.commit("doomed", [7, 7, 7, 7], {0: payload(7, 0)}),
        "a": lambda: store.commit("a", [8, 8, 8, 8], {0: payload(8, 0)}),
        "b": lambda: store.commit("b", [9, 9, 9, 9], {0: payload(9, 0)}),
    }
    rest = run(calls)
    gate.wait_queued(5)
    assert other.delete_session("doomed") == 0
    gate.open()
    for thread in first[2] + rest[2]:
        thread.join()
    results, errors, _ = rest
    assert first[1] == {}
    assert sorted(errors) == ["doomed"] and isinstance(errors["doomed"], UnknownSession)
    assert sorted(results) == ["a", "b", "twice-1", "twice-2"]
    assert latest_seq(store) - seq == 4  # lead, the delete, the group, the Stale member's retry
    twice = store.versions("twice")
    heads = sorted(tuple(store.tokens("twice", v.version_id)) for v in twice if v.num_tokens == 5)
    assert heads == [(5, 5, 5, 5, 1), (6, 6, 6, 6, 2)]
    for name, tag in (("a", 8), ("b", 9)):
        result = store.resume(name, [tag] * 4)
        assert result.matched_tokens == 4
        assert store.read_pages(result.pages) == [payload(tag, 0)]
    assert "doomed" not in {s.session_id for s in store.sessions()}
    assert store.check() == []
    assert sorted(store.disk.files()) == sorted(r[0] for r in store.sql("SELECT name FROM segments").rows)


def test_a_member_failing_part_way_is_rolled_back_alone(open_store: Callable[..., dss.Store]) -> None:
    """A change whose segment names a namespace that does not exist fails on the foreign key
    after the group's transaction wrote some of it: the transaction is rolled back and the
    group applied again without it (same sequence number: the failed one never committed).
    Its page file is deleted; the two good commits land; two transactions in all."""
    store = open_store()
    for name in ("lead", "a", "b"):
        store.create_session(name, layout=LAYOUT)
    layout_ref = store.mirror.state("a", None).record.layout_ref
    stored = payload(1, 1)
    bad = Change(
        user_ref=10**6,
        layout_ref=layout_ref,
        pages=(NewPage(PageId(b"\x01" * 16), 0, stored, stored, checksum(stored), 0),),
    )
    seq = latest_seq(store)
    files = set(store.disk.files())
    gate = Gate(store)
    first = run({"lead": lambda: store.commit("lead", [1, 2, 3, 4])})
    assert gate.reached.wait(30)
    rest = run(
        {
            "a": lambda: store.commit("a", [8, 8, 8, 8], {0: payload(8, 0)}),
            "bad": lambda: store.writer.apply(bad),
            "b": lambda: store.commit("b", [9, 9, 9, 9], {0: payload(9, 0)}),
        }
    )
    gate.wait_queued(3)
    gate.open()
    for thread in first[2] + rest[2]:
        thread.join()
    results, errors, _ = rest
    assert sorted(results) == ["a", "b"] and sorted(errors) == ["bad"]
    assert isinstance(errors["bad"], IntegrityError)
    assert latest_seq(store) - seq == 2
    for name, tag in (("a", 8), ("b", 9)):
        result = store.resume(name, [tag] * 4)
        assert store.read_pages(result.pages) == [payload(tag, 0)]
    assert len(set(store.disk.files()) - files) == 2
    assert store.check() == []
    assert sorted(store.disk.files()) == sorted(r[0] for r in store.sql("SELECT name FROM segments").rows)


@pytest.mark.parametrize("group_commit", [True, False])
def test_many_threads_commit_exactly(open_store: Callable[..., dss.Store], group_commit: bool) -> None:
    """Eight threads, ten commits each, with and without group commit: every commit there,
    exactly; with it, fewer transactions than commits."""
    store = open_store(group_commit=group_commit)
    for n in range(8):
        store.create_session(f"t{n}", layout=LAYOUT)
    seq = latest_seq(store)
    done: dict[int, list[int]] = {}

    def worker(n: int) -> list[int]:
        tokens: list[int] = []
        for turn in range(10):
            tokens = tokens + [n * 1000 + turn * 10 + i for i in range(6)]
            store.commit(f"t{n}", tokens, {i: payload(n, i) for i in range(len(tokens) // LAYOUT.page_tokens)})
        done[n] = tokens
        return tokens

    _, errors, threads = run({f"t{n}": (lambda n=n: worker(n)) for n in range(8)})
    for thread in threads:
        thread.join()
    assert errors == {}
    transactions = latest_seq(store) - seq
    assert transactions <= 80 if group_commit else transactions == 80
    for n, tokens in done.items():
        assert [v.num_tokens for v in store.versions(f"t{n}")][-10:] == [6 * (t + 1) for t in range(10)]
        result = store.resume(f"t{n}", tokens)
        assert result.matched_tokens == 60
        assert store.read_pages(result.pages) == [payload(n, i) for i in range(15)]
    assert store.check() == []


def test_sessions_of_a_known_namespace_are_made_in_commit_groups(open_store: Callable[..., dss.Store]) -> None:
    """The first session of a namespace is made in a transaction of its own (with the
    namespace and its key); later ones, made by eight threads at once, share transactions, and
    each is made exactly once; one made again with another layout is refused."""
    store = open_store()
    store.create_session("first", user_id="u", layout=LAYOUT)
    seq, groups = latest_seq(store), store.writer.queue.num_groups
    names = [f"s{n}-{i}" for n in range(8) for i in range(5)]

    def worker(n: int) -> None:
        for i in range(5):
            store.create_session(f"s{n}-{i}", user_id="u", layout=LAYOUT)
            store.create_session(f"s{n}-{i}", user_id="u", layout=LAYOUT)  # idempotent

    _, errors, threads = run({f"t{n}": (lambda n=n: worker(n)) for n in range(8)})
    for thread in threads:
        thread.join()
    assert errors == {}
    assert latest_seq(store) - seq <= len(names) and 1 <= store.writer.queue.num_groups - groups <= len(names)
    assert sorted(s.session_id for s in store.sessions(user_id="u")) == sorted(["first", *names])
    with pytest.raises(dss.SessionExists):
        store.create_session("s0-0", user_id="u", layout=dss.Layout(name="other", page_tokens=4, page_bytes=8))
    assert store.check() == []


def test_group_commit_setting() -> None:
    from dss.core.config import load_config

    assert load_config("/tmp/x").group_commit is True
    assert load_config("/tmp/x", group_commit=False).group_commit is False
    with pytest.raises(dss.ConfigError, match="group_commit"):
        load_config("/tmp/x", group_commit="sometimes")
