"""Changes built without the store's lock (``Writer.write``): a change built from a state that
moved on — here or in another handle — is refused by its transaction and built again under the
lock; one read while this process changed the state in place is never applied."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import pytest

import dss
from dss.core.errors import InvalidInput
from dss.core.tokens import pack
from dss.sessions import versions
from dss.sessions.state import SessionState
from tests.conftest import LAYOUT


def payload(tag: int, index: int) -> bytes:
    return bytes([tag % 256, index % 256]) * (LAYOUT.page_bytes // 2)


def test_a_change_read_while_its_state_changed_is_built_again(open_store: Callable[..., dss.Store]) -> None:
    """A build that read the trie before another thread's commit changed the state in place,
    and the session's sequence number after it (what an unlocked read can see), would pass the
    transaction's check with a stale parent: it is built again under the lock instead."""
    store = open_store()
    store.create_session("s", layout=LAYOUT)
    first = store.commit("s", [1, 2, 3, 4])
    builds: list[int] = []

    def torn(state: SessionState, ctx: versions.Context, *args: Any) -> Any:
        change = versions.commit(state, ctx, *args)  # read before the other commit
        builds.append(state.generation)
        if len(builds) == 1:
            other = threading.Thread(target=store.commit, args=("s", [1, 2, 3, 4, 5, 6]))
            other.start()
            other.join()
        return dataclasses.replace(change, base_seq=state.record.seq)  # read after it

    applied = store.writer.write("s", None, torn, pack([1, 2, 3, 4, 7, 8]), None, None)
    assert len(builds) == 2  # the second under the lock
    history = store.versions("s")
    assert [(v.num_tokens, v.parent_id) for v in history] == [
        (4, None),
        (6, first.version_id),
        (6, history[1].version_id),
    ]
    assert applied.version_id == history[2].version_id and history[2].is_head
    assert store.tokens("s") == [1, 2, 3, 4, 7, 8]
    again = open_store()
    assert [(v.num_tokens, v.parent_id) for v in again.versions("s")] == [(v.num_tokens, v.parent_id) for v in history]


def test_a_build_failing_while_its_state_changed_is_built_again(open_store: Callable[..., dss.Store]) -> None:
    """An error raised by a build that read a changing state is not the caller's: the change
    is built again under the lock. The same error from a state that did not change is."""
    store = open_store()
    store.create_session("s", layout=LAYOUT)
    calls: list[int] = []

    def shaky(state: SessionState, ctx: versions.Context, *args: Any) -> Any:
        calls.append(state.generation)
        if len(calls) == 1:
            state.generation += 2  # as the mirror leaves a state it changed in place
            raise KeyError("half-made trie")
        return versions.commit(state, ctx, *args)

    store.writer.write("s", None, shaky, pack([5, 6, 7, 8]), None, None)
    assert len(calls) == 2 and store.tokens("s") == [5, 6, 7, 8]

    def invalid(state: SessionState, ctx: versions.Context, *args: Any) -> Any:
        raise InvalidInput("bad")

    with pytest.raises(InvalidInput):
        store.writer.write("s", None, invalid)
    assert len(store.versions("s")) == 1


def test_a_state_being_changed_is_not_read_without_the_lock(open_store: Callable[..., dss.Store]) -> None:
    """An odd generation (the mirror is changing the state in place): the change is built
    under the lock at once."""
    store = open_store()
    store.create_session("s", layout=LAYOUT)
    store.commit("s", [1])
    state = store.mirror.cached("s", None)
    assert state is not None
    assert store.writer._built_unlocked("s", None, versions.commit, (pack([1, 2]), None, None)) is not None
    state.generation += 1
    try:
        assert store.writer._built_unlocked("s", None, versions.commit, (pack([1, 2]), None, None)) is None
    finally:
        state.generation += 1
    store.commit("s", [1, 2])
    assert store.tokens("s") == [1, 2]


def test_a_handle_with_a_stale_state_commits_after_the_other(open_store: Callable[..., dss.Store]) -> None:
    """Two handles on one store: the second's commit moves the session on behind the first's
    cached state; the first's next commit is built again and follows it."""
    one, two = open_store(), open_store()
    one.create_session("s", layout=LAYOUT)
    a = one.commit("s", list(range(8)), {0: payload(1, 0), 1: payload(1, 1)})
    b = two.commit("s", list(range(12)), {0: payload(1, 0), 1: payload(1, 1), 2: payload(1, 2)})
    c = one.commit("s", [*range(12), 99, 98, 97, 96], {3: payload(1, 3)})
    assert (b.parent_id, c.parent_id) == (a.version_id, b.version_id)
    for handle in (one, two):
        result = handle.resume("s", [*range(12), 99, 98, 97, 96])
        assert result.matched_tokens == 16
        assert handle.read_pages(result.pages) == [payload(1, i) for i in range(4)]
    assert one.check() == []


@pytest.mark.parametrize("group_commit", [True, False])
def test_many_threads_commit_to_one_session(open_store: Callable[..., dss.Store], group_commit: bool) -> None:
    """Six threads commit eight versions each to one session at once: every commit is a child
    of the head it found, so the versions form one chain in the order they were made, and no
    commit is lost."""
    store = open_store(group_commit=group_commit)
    store.create_session("s", layout=LAYOUT)
    made: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        for turn in range(8):
            tokens = [n * 1000 + turn * 10 + i for i in range(8)]
            made[store.commit("s", tokens, {0: payload(n, turn), 1: payload(n, turn + 100)}).version_id] = tokens

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    history = store.versions("s")
    assert len(history) == len(made) == 48
    assert [v.parent_id for v in history] == [None, *(v.version_id for v in history[:-1])]
    assert history[-1].is_head
    for version in history:
        assert store.tokens("s", version.version_id) == made[version.version_id]
        result = store.resume("s", made[version.version_id])
        assert result.matched_tokens == 8
    assert store.check() == []
