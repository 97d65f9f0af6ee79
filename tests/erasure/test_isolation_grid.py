"""The isolation grid: identical tokens under every (tenant, user, layout), through every lookup path, on every tier.

A writer ``(acme, alice, L1)`` stores a prefix; each of the 8 readers (2 tenants x 2 users x 2
layouts) then asks for the same tokens through one path:

* ``trie``   — the reader's own session holds the same token history (committed without KV);
* ``chain``  — a fresh session of the reader (exact chain-hash lookup in its namespace);
* ``lookup`` — a request without a session;
* ``shared`` — the writer's tenant registered the prefix as a shared prefix instead;
* ``lsh``    — a fresh session of the reader, resumed with ``approximate=True`` (MinHash-LSH
  candidates verified exactly), and ``nearest``/``explain``/``prefetch_candidates`` for it:
  a candidate is only ever a version of the reader's own namespace and layout.

Expected: the writer's own namespace hits on the private paths; a shared prefix hits for
every user of the writer's tenant and layout; everything else misses. ``host`` is the
writing process; ``disk`` is a fresh process after a restart.
"""

from __future__ import annotations

import itertools

import pytest

import dss

L1 = dss.Layout(name="grid", page_tokens=4, page_bytes=32, model="m1")
L2 = dss.Layout(name="grid", page_tokens=4, page_bytes=32, model="m2")
TOKENS = list(range(7000, 7032))  # 8 pages
WRITER = ("acme", "alice", L1)
READERS = list(itertools.product(["acme", "globex"], ["alice", "bob"], [L1, L2]))
PAGES = {i: bytes([i + 1]) * 32 for i in range(8)}


def expected(path: str, reader: tuple) -> int:
    tenant, _, layout = reader
    if path == "shared":
        return len(TOKENS) if (tenant, layout) == (WRITER[0], WRITER[2]) else 0
    return len(TOKENS) if reader == WRITER else 0


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("path", ["trie", "chain", "lookup", "shared", "lsh"])
def test_isolation_grid(open_store, path: str, tier: str) -> None:
    store = open_store()
    tenant, user, layout = WRITER
    if path == "shared":
        store.register_prefix(TOKENS, PAGES, layout=layout, tenant_id=tenant)
    else:
        store.create_session("writer", user_id=user, tenant_id=tenant, layout=layout)
        store.commit("writer", TOKENS, PAGES)
    for n, (r_tenant, r_user, r_layout) in enumerate(READERS):
        if path == "trie":
            store.create_session(f"r{n}", user_id=r_user, tenant_id=r_tenant, layout=r_layout)
            store.commit(f"r{n}", TOKENS, tenant_id=r_tenant)  # the history, without KV
    if tier == "disk":
        store.close()
        store = open_store()
    got, hits = {}, []
    for n, (r_tenant, r_user, r_layout) in enumerate(READERS):
        if path == "lookup":
            result = store.lookup(TOKENS + [1], layout=r_layout, user_id=r_user, tenant_id=r_tenant)
        else:
            session = f"r{n}" if path == "trie" else f"fresh{n}"
            store.create_session(session, user_id=r_user, tenant_id=r_tenant, layout=r_layout)
            result = store.resume(session, TOKENS + [1], tenant_id=r_tenant, approximate=path == "lsh")
        if path == "lsh":
            own = (r_tenant, r_user, r_layout) == WRITER
            near = store.nearest(TOKENS + [1], session_id=session, tenant_id=r_tenant)
            assert [(c.session_id, c.common_prefix) for c in near] == ([("writer", len(TOKENS))] if own else [])
            why = store.explain(session, TOKENS + [1], tenant_id=r_tenant)
            assert (why.nearest is not None, why.matched_tokens) == (own, len(TOKENS) if own else 0)
            prefetched = store.prefetch_candidates(TOKENS + [1], session_id=session, tenant_id=r_tenant)
            assert len(prefetched) == (8 if own else 0)
        got[(r_tenant, r_user, r_layout.model)] = result.matched_tokens
        if result.matched_tokens:
            assert set(result.tiers) == {tier}
            hits.append(result)
    assert got == {(t, u, lay.model): expected(path, (t, u, lay)) for t, u, lay in READERS}
    for result in hits:
        assert store.read_pages(result.pages) == list(PAGES.values())
    assert store.check() == []


def test_page_ids_and_rows_are_keyed_per_namespace(store: dss.Store) -> None:
    """Same tokens in four namespaces: four sets of page ids, four files, no shared row."""
    for tenant, user in itertools.product(["acme", "globex"], ["alice", "bob"]):
        session = "same-id" if user == "alice" else f"same-id-{user}"  # alice's id is the same in both tenants
        store.create_session(session, user_id=user, tenant_id=tenant, layout=L1)
        store.commit(session, TOKENS, PAGES, tenant_id=tenant)
    rows = store.sql("SELECT user_ref, COUNT(*) FROM pages GROUP BY user_ref ORDER BY user_ref").rows
    assert [n for _, n in rows] == [8, 8, 8, 8]
    assert store.sql("SELECT COUNT(DISTINCT page_id) FROM pages").rows == [(32,)]
    assert store.sql("SELECT COUNT(DISTINCT user_ref) FROM segments").rows == [(4,)]
