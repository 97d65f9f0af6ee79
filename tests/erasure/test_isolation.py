"""Namespaces and layouts never share: identical tokens under two of them never match.

Every combination of (tenant, user, layout) differing from the writer's is checked through
every lookup path of the core (a session's chain lookup, a sessionless lookup) and on both
tiers (host in the writing process, disk after a reopen).
"""

from __future__ import annotations

import itertools

import pytest

import dss
from tests.conftest import LAYOUT, pages_for

TOKENS = list(range(500, 532))  # 8 pages
OTHER_LAYOUT = dss.Layout(name="test", page_tokens=4, page_bytes=16, model="tiny", dtype="int4")
WRITER = ("acme", "alice", LAYOUT)
READERS = [
    (tenant, user, layout)
    for tenant, user, layout in itertools.product(["acme", "globex"], ["alice", "bob"], [LAYOUT, OTHER_LAYOUT])
]


def expected(reader: tuple) -> int:
    return len(TOKENS) if reader == WRITER else 0


@pytest.mark.parametrize("reopen", [False, True], ids=["host", "disk"])
def test_only_the_writers_namespace_and_layout_match(open_store, reopen: bool) -> None:
    store = open_store()
    tenant, user, layout = WRITER
    store.create_session("w", user_id=user, tenant_id=tenant, layout=layout)
    store.commit("w", TOKENS, pages_for(TOKENS))
    if reopen:
        store.close()
        store = open_store()
    for n, reader in enumerate(READERS):
        tenant, user, layout = reader
        session = f"r{n}"
        store.create_session(session, user_id=user, tenant_id=tenant, layout=layout)
        result = store.resume(session, TOKENS + [1], tenant_id=tenant)
        assert result.matched_tokens == expected(reader), reader
        assert store.lookup(TOKENS + [1], layout=layout, user_id=user, tenant_id=tenant).matched_tokens == expected(
            reader
        ), reader
    assert store.check() == []


def test_identical_tokens_in_two_namespaces_are_stored_twice(store: dss.Store) -> None:
    for user in ("alice", "bob"):
        store.create_session(f"s-{user}", user_id=user, tenant_id="acme", layout=LAYOUT)
        store.commit(f"s-{user}", TOKENS, pages_for(TOKENS, tag=1 if user == "alice" else 2))
    assert store.sql("SELECT COUNT(DISTINCT page_id) FROM pages").rows == [(16,)]
    a = store.resume("s-alice", TOKENS)
    b = store.resume("s-bob", TOKENS)
    assert not {p.page_id for p in a.pages} & {p.page_id for p in b.pages}
    assert store.read_pages(a.pages) == list(pages_for(TOKENS, tag=1).values())
    assert store.read_pages(b.pages) == list(pages_for(TOKENS, tag=2).values())


def test_page_ids_depend_on_the_store_secret(tmp_path) -> None:
    ids = []
    for name in ("one", "two"):
        with dss.open(tmp_path / name) as store:
            store.create_session("s", user_id="u", layout=LAYOUT)
            store.commit("s", TOKENS, pages_for(TOKENS))
            ids.append({p.page_id for p in store.resume("s", TOKENS).pages})
    assert not ids[0] & ids[1]
