"""The public Store API, on every catalog: exact answers, and bad input that changes nothing."""

from __future__ import annotations

import array

import numpy as np
import pytest

import dss
from tests.conftest import LAYOUT, page, pages_for

T = list(range(100, 110))  # 10 tokens: pages 0 and 1 full (page_tokens=4), 2 tokens of tail


def make(store: dss.Store, session_id: str = "s", **kw: object) -> dss.Session:
    return store.create_session(
        session_id, user_id=kw.pop("user_id", "u"), tenant_id=kw.pop("tenant_id", "t"), layout=kw.pop("layout", LAYOUT)
    )


def snapshot(store: dss.Store) -> tuple:
    """Everything an operation could change, to assert that a refused one changed nothing."""
    sessions = store.sessions()
    return (
        [(s.session_id, s.tenant_id, s.head_id, s.num_versions) for s in sessions],
        {s.session_id: [tuple(v[:4]) for v in store.versions(s.session_id, tenant_id=s.tenant_id)] for s in sessions},
        store.sql("SELECT page_id, size, checksum FROM pages ORDER BY page_id").rows,
        store.sql("SELECT session_ref, page_id, version_ref FROM session_pages ORDER BY session_ref, page_id").rows,
        sorted(store.disk.files()),
    )


def test_commit_then_resume_matches_stored_pages(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    assert (v1.num_tokens, v1.parent_id, v1.is_head) == (10, None, True)
    r = store.resume("s", T + [7, 8, 9])
    assert (r.matched_tokens, r.num_prompt_tokens, r.num_history_tokens, r.version_id) == (8, 13, 10, v1.version_id)
    assert [(p.index, p.tier) for p in r.pages] == [(0, "host"), (1, "host")]
    assert r.tiers == {"host": 8}
    assert store.read_pages(r.pages) == [page(1), page(2)]
    assert store.check() == []


def test_resume_matches_only_page_aligned_prefix_with_pages(store: dss.Store) -> None:
    make(store)
    store.commit("s", T, {0: page(1)})  # page 1 never stored
    r = store.resume("s", T)
    assert (r.matched_tokens, r.num_history_tokens) == (4, 10)
    assert store.resume("s", T[:3]).matched_tokens == 0
    assert store.resume("s", [5] + T).matched_tokens == 0


def test_commit_extends_head_and_diverges(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    v2 = store.commit("s", T + [1, 2, 3, 4, 5, 6], {2: page(9), 3: page(10)})
    assert v2.parent_id == v1.version_id
    r = store.resume("s", T + [1, 2, 3, 4, 5, 6, 7])
    assert (r.matched_tokens, r.version_id) == (16, v2.version_id)
    v3 = store.commit("s", T[:6] + [50, 51, 52, 53, 54, 55])  # diverges inside page 1
    assert store.resume("s", T[:6] + [50, 51, 52, 53, 54, 55]).matched_tokens == 4
    # the old branch still resumes in full, along version 2
    r = store.resume("s", T + [1, 2, 3, 4, 5, 6])
    assert (r.matched_tokens, r.version_id) == (16, v2.version_id)
    assert [v.version_id for v in store.versions("s")] == [v1.version_id, v2.version_id, v3.version_id]
    assert store.tokens("s") == T[:6] + [50, 51, 52, 53, 54, 55]
    assert store.tokens("s", v2.version_id) == T + [1, 2, 3, 4, 5, 6]
    assert store.check() == []


def test_rollback_moves_head_and_next_commit_is_its_child(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    v2 = store.commit("s", T + [1, 2])
    head = store.rollback("s", v1.version_id)
    assert (head.version_id, head.is_head) == (v1.version_id, True)
    assert store.tokens("s") == T
    v3 = store.commit("s", T + [9, 9])
    assert v3.parent_id == v1.version_id
    versions = {v.version_id: v for v in store.versions("s")}
    assert versions[v2.version_id].num_tokens == 12 and not versions[v2.version_id].is_head
    assert versions[v3.version_id].is_head


def test_resume_runs_along_the_head_when_it_can(open_store) -> None:
    """v1 = T (10 tokens, pages 0-1), v2 = T + 6 tokens (pages 0-3), then rollback to v1.

    The prompt T + [7] matches 10 tokens of history, of which 8 have pages; both v1 (10
    tokens) and v2 (16) run along those 8 tokens. v2 is the newer, but the head is v1, so
    resume names v1; without the head's preference it would name v2. Moving the head to v2
    names v2. A second handle, which loads the trie from the catalog, answers the same.
    """
    a = open_store()
    make(a)
    v1 = a.commit("s", T, pages_for(T))
    v2 = a.commit("s", T + [1, 2, 3, 4, 5, 6], {2: page(9), 3: page(10)})
    a.rollback("s", v1.version_id)
    b = open_store()
    for store in (a, b):
        r = store.resume("s", T + [7])
        assert (r.matched_tokens, r.version_id) == (8, v1.version_id)
    a.rollback("s", v2.version_id)
    assert [store.resume("s", T + [7]).version_id for store in (a, b)] == [v2.version_id, v2.version_id]


def test_old_versions_never_change(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    before = store.versions("s")[0]
    store.commit("s", T[:5] + [1, 2, 3, 4, 5, 6, 7])
    store.rollback("s", v1.version_id)
    store.commit("s", T + T)
    after = store.versions("s")[0]
    assert (after.version_id, after.parent_id, after.num_tokens, after.created_at, after.label) == (
        before.version_id,
        before.parent_id,
        before.num_tokens,
        before.created_at,
        before.label,
    )
    assert store.tokens("s", v1.version_id) == T


def test_branch_shares_pages_and_copies_none(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    files_before = store.disk.files()
    pages_before = store.sql("SELECT COUNT(*) FROM pages").rows[0][0]
    b = store.branch("s", v1.version_id, "s2", label="fork")
    assert (b.session_id, b.user_id, b.tenant_id, b.num_versions) == ("s2", "u", "t", 1)
    assert store.disk.files() == files_before
    assert store.sql("SELECT COUNT(*) FROM pages").rows[0][0] == pages_before
    r = store.resume("s2", T + [1])
    assert (r.matched_tokens, r.version_id) == (8, b.head_id)
    assert store.versions("s2")[0].parent_id == v1.version_id
    assert store.read_pages(r.pages) == [page(1), page(2)]
    assert store.check() == []


def test_delete_session_releases_only_unreferenced_pages(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    store.branch("s", v1.version_id, "s2")
    store.commit("s2", T + [1, 2, 3, 4, 5, 6], {2: page(77)})
    assert store.delete_session("s2") == 1  # page 2 only; pages 0, 1 still held by "s"
    with pytest.raises(dss.UnknownSession):
        store.resume("s2", T)
    assert store.resume("s", T).matched_tokens == 8
    assert store.delete_session("s") == 2
    assert store.sql("SELECT COUNT(*) FROM pages").rows[0][0] == 0
    assert store.disk.files() == {}
    assert store.check() == []


def test_dedup_within_namespace_across_sessions(store: dss.Store) -> None:
    make(store, "a")
    make(store, "b")
    store.commit("a", T, pages_for(T))
    files = store.disk.files()
    store.commit("b", T, pages_for(T))  # same tokens, same namespace: nothing new is written
    assert store.disk.files() == files
    assert store.sql("SELECT COUNT(*) FROM pages").rows[0][0] == 2
    assert store.sql("SELECT COUNT(*) FROM session_pages").rows[0][0] == 4


def test_new_session_finds_namespace_pages_by_chain_hash(store: dss.Store) -> None:
    make(store, "a")
    store.commit("a", T, pages_for(T))
    make(store, "fresh")
    r = store.resume("fresh", T + [1, 2, 3])
    assert (r.matched_tokens, r.version_id, r.num_history_tokens) == (8, None, 0)
    assert store.read_pages(r.pages) == [page(1), page(2)]


def test_save_pages_before_commit(store: dss.Store) -> None:
    make(store)
    first = store.save_pages("s", T, {0: page(1)})
    assert first.num_new == 1
    again = store.save_pages("s", T, {0: page(1)})
    assert again == dss.SavedPages(first.page_ids, 0)
    r = store.resume("s", T)
    assert r.matched_tokens == 4
    assert first.page_ids == {p.index: p.page_id for p in r.pages}
    assert store.check() == []
    v = store.commit("s", T + [1, 2], {1: page(2)})
    assert store.resume("s", T).matched_tokens == 8
    assert store.sql(f"SELECT COUNT(*) FROM session_pages WHERE version_ref = {v.version_id}").rows == [(2,)]


def test_sessionless_pages_resume_by_lookup_in_their_namespace_only(store: dss.Store) -> None:
    saved = store.save_pages(None, T, pages_for(T), tenant_id="t", user_id="u", layout=LAYOUT)
    assert saved.num_new == 2
    found = store.lookup(T, layout=LAYOUT, user_id="u", tenant_id="t")
    assert found.matched_tokens == 8
    assert saved.page_ids == {p.index: p.page_id for p in found.pages}
    assert store.lookup(T, layout=LAYOUT, user_id="other", tenant_id="t").matched_tokens == 0
    assert store.lookup(T, layout=LAYOUT, user_id="u", tenant_id="other").matched_tokens == 0
    other_layout = dss.Layout(name="test", page_tokens=4, page_bytes=16, model="tiny", dtype="int4")
    assert store.lookup(T, layout=other_layout, user_id="u", tenant_id="t").matched_tokens == 0
    assert store.check() == []


def test_token_buffers_match_lists(store: dss.Store) -> None:
    make(store)
    store.commit("s", T, pages_for(T))
    for prompt in (
        np.array(T + [1], dtype=np.int64),
        np.array(T + [1], dtype=np.uint32),
        array.array("I", T + [1]),
        tuple(T + [1]),
    ):
        assert store.resume("s", prompt).matched_tokens == 8


def test_pin_is_recorded(store: dss.Store) -> None:
    make(store)
    v1 = store.commit("s", T)
    assert store.pin("s", v1.version_id).is_pinned
    assert store.versions("s")[0].is_pinned
    assert not store.pin("s", v1.version_id, pinned=False).is_pinned


def test_reopen_restores_everything_committed(open_store) -> None:
    store = open_store()
    make(store)
    v1 = store.commit("s", T, pages_for(T))
    v2 = store.commit("s", T + [1, 2, 3, 4, 5, 6], {2: page(9)})
    store.rollback("s", v1.version_id)
    store.close()
    again = open_store()
    assert [v.version_id for v in again.versions("s")] == [v1.version_id, v2.version_id]
    assert again.session("s").head_id == v1.version_id
    r = again.resume("s", T + [1, 2, 3, 4, 5, 6])
    assert (r.matched_tokens, r.tiers) == (12, {"disk": 12})
    assert again.read_pages(r.pages) == [page(1), page(2), page(9)]
    assert again.resume("s", T + [1, 2, 3, 4, 5, 6]).tiers == {"host": 12}  # promoted on read
    assert again.check() == []


def test_module_level_resume_uses_default_store(tmp_path, monkeypatch) -> None:
    dss.configure(tmp_path / "home")
    try:
        store = dss.default_store()
        make(store)
        store.commit("s", T, pages_for(T))
        assert dss.resume("s", T).matched_tokens == 8
    finally:
        dss.configure(None)


# -- bad input: a typed error, and nothing changes ---------------------------------------------


BAD_TOKENS = [
    [-1],
    [1, 2.5],
    ["a"],
    [1 << 32],
    np.array([[1, 2]]),
    np.array([1.0, 2.0]),
    "abc",
    b"abc",
    None,
    [1, True],
    (0, False),
    [True] * 8,
    np.array([True, False]),
]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=repr)
def test_bad_tokens_are_refused(store: dss.Store, tokens: object) -> None:
    make(store)
    store.commit("s", T, pages_for(T))
    before = snapshot(store)
    with pytest.raises(dss.InvalidTokens):
        store.commit("s", tokens)  # type: ignore[arg-type]
    with pytest.raises(dss.InvalidTokens):
        store.resume("s", tokens)  # type: ignore[arg-type]
    assert snapshot(store) == before


@pytest.mark.parametrize(
    "pages, error",
    [
        ({0: b"short"}, dss.InvalidPage),
        ({0: page(1) + b"x"}, dss.InvalidPage),
        ({2: page(1)}, dss.InvalidPage),  # 10 tokens hold 2 full pages
        ({-1: page(1)}, dss.InvalidPage),
        ({"0": page(1)}, dss.InvalidPage),
        ({0: "not bytes"}, dss.InvalidPage),
        ([page(1)], dss.InvalidPage),
    ],
)
def test_bad_pages_are_refused(store: dss.Store, pages: object, error: type) -> None:
    make(store)
    store.commit("s", T, pages_for(T))
    before = snapshot(store)
    with pytest.raises(error):
        store.commit("s", T + [1], pages)  # type: ignore[arg-type]
    assert snapshot(store) == before


def test_unknown_session_and_foreign_version(store: dss.Store) -> None:
    make(store, "a")
    make(store, "b")
    va = store.commit("a", T)
    store.commit("b", T)
    before = snapshot(store)
    with pytest.raises(dss.UnknownSession, match="no session 'zzz'"):
        store.commit("zzz", T)
    with pytest.raises(dss.UnknownVersion, match=f"version {va.version_id} is not a version of session 'b'"):
        store.rollback("b", va.version_id)
    with pytest.raises(dss.UnknownVersion):
        store.branch("b", va.version_id, "c")
    with pytest.raises(dss.UnknownVersion):
        store.tokens("b", 10_000)
    with pytest.raises(dss.InvalidInput):
        store.rollback("b", "1")  # type: ignore[arg-type]
    assert snapshot(store) == before


def test_session_created_twice(store: dss.Store) -> None:
    first = make(store)
    assert make(store) == first  # same owner and layout: idempotent
    before = snapshot(store)
    with pytest.raises(dss.SessionExists):
        make(store, user_id="someone else")
    with pytest.raises(dss.SessionExists):
        make(store, layout=dss.Layout(name="test", page_tokens=8, page_bytes=16))
    make(store, tenant_id="other tenant")  # ids are per tenant
    with pytest.raises(dss.AmbiguousSession):
        store.resume("s", T)
    assert store.resume("s", T, tenant_id="t").matched_tokens == 0
    assert snapshot(store)[0] == before[0] + [("s", "other tenant", None, 0)]


def test_an_id_found_without_a_tenant_is_ambiguous_once_this_handle_makes_it_in_another(store: dss.Store) -> None:
    """A session found by id alone, then made with the same id in another tenant by the same
    handle: the id alone names two sessions now."""
    make(store)
    store.commit("s", T)
    assert store.session("s").tenant_id == "t"
    make(store, tenant_id="other tenant")
    with pytest.raises(dss.AmbiguousSession):
        store.session("s")
    with pytest.raises(dss.AmbiguousSession):
        store.commit("s", T)
    assert [v.num_tokens for v in store.versions("s", tenant_id="t")] == [len(T)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"session_id": ""},
        {"session_id": "x" * 257},
        {"session_id": "a\nb"},
        {"session_id": 5},
        {"session_id": "~cache-1"},
        {"user_id": ""},
        {"tenant_id": None},
        {"layout": {"name": "x"}},
    ],
)
def test_bad_names_are_refused(store: dss.Store, kwargs: dict) -> None:
    args = {"session_id": "s", "user_id": "u", "tenant_id": "t", "layout": LAYOUT, **kwargs}
    with pytest.raises(dss.InvalidInput):
        store.create_session(args.pop("session_id"), **args)
    assert store.sessions() == []


def test_branch_onto_existing_session_is_refused(store: dss.Store) -> None:
    make(store, "a")
    make(store, "b")
    v = store.commit("a", T)
    before = snapshot(store)
    with pytest.raises(dss.SessionExists):
        store.branch("a", v.version_id, "b")
    assert snapshot(store) == before


def test_commit_needs_tokens_and_a_sane_label(store: dss.Store) -> None:
    make(store)
    with pytest.raises(dss.InvalidTokens):
        store.commit("s", [])
    with pytest.raises(dss.InvalidInput):
        store.commit("s", T, label="x" * 300)
    assert store.versions("s") == []


def test_layout_is_validated_and_hashable() -> None:
    a = dss.Layout(name="x", page_tokens=32, page_bytes=10, model="m", dtype="bf16")
    b = dss.Layout(name="x", page_tokens=32, page_bytes=10, dtype="bf16", model="m")
    assert a == b and hash(a) == hash(b) and a.model == "m"
    assert dss.Layout.from_dict(a.to_dict()) == a
    assert a != dss.Layout(name="x", page_tokens=32, page_bytes=10, model="m", dtype="fp16")
    for bad in ({"name": ""}, {"page_tokens": 0}, {"page_bytes": -1}, {"page_tokens": 2.0}):
        with pytest.raises(dss.InvalidLayout):
            dss.Layout(**{"name": "x", "page_tokens": 32, "page_bytes": 10, **bad})
    with pytest.raises(dss.InvalidLayout):
        dss.Layout(name="x", page_tokens=32, page_bytes=10, shapes=[1, 2])
    with pytest.raises(dss.InvalidLayout):
        dss.Layout.from_dict({"name": "x"})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), np.float64("nan")], ids=repr)
def test_layout_fields_must_be_finite(value: float) -> None:
    """NaN and Infinity are no JSON: stored, they came back as null and broke every listing."""
    with pytest.raises(dss.InvalidLayout, match="layout field 'scale' must be a finite number"):
        dss.Layout(name="x", page_tokens=4, page_bytes=8, scale=value)
    with pytest.raises(dss.InvalidLayout, match="layout field 'scale' must be a finite number"):
        dss.Layout.from_dict({"name": "x", "page_tokens": 4, "page_bytes": 8, "scale": value})


@pytest.mark.parametrize(
    "data, message",
    [
        (None, "a layout must be a mapping of field names to values, not NoneType"),
        ([("name", "x")], "a layout must be a mapping of field names to values, not list"),
        ("name=x", "a layout must be a mapping of field names to values, not str"),
        ({"name": "x", "page_tokens": 4, "page_bytes": 8, 1: "y"}, "layout field names must be strings, got 1"),
        ({"name": "x", "page_tokens": 4}, "layout lacks the field 'page_bytes'"),
    ],
)
def test_layout_from_dict_refuses_what_is_not_a_layout(data: object, message: str) -> None:
    with pytest.raises(dss.InvalidLayout, match=message):
        dss.Layout.from_dict(data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "pages, message",
    [
        ([5], "page 0 must be a PageRef or a 16-byte page id, got 5"),
        ([True], "page 0 must be a PageRef or a 16-byte page id, got True"),
        ([b"short"], "page 0 must be a PageRef or a 16-byte page id, got b'short'"),
        ([bytes(16), "00" * 16], "page 1 must be a PageRef or a 16-byte page id, got '0000"),
        ([dss.PageRef(0, dss.PageId(b"x"), "host")], "page 0 must be a PageRef or a 16-byte page id"),
        (bytes(16), "pages must be a list of PageRef or 16-byte page ids, not bytes"),
        (7, "pages must be a list of PageRef or 16-byte page ids, not int"),
    ],
)
def test_read_pages_refuses_what_is_not_a_page_id(store: dss.Store, pages: object, message: str) -> None:
    """An int was read as that many zero bytes (a silent None), a str raised TypeError."""
    make(store)
    store.commit("s", T, pages_for(T))
    before = snapshot(store)
    with pytest.raises(dss.InvalidInput, match=message.replace("(", r"\(")):
        store.read_pages(pages)  # type: ignore[arg-type]
    assert snapshot(store) == before


def test_closed_store_refuses_calls(store: dss.Store) -> None:
    store.close()
    with pytest.raises(dss.StoreClosed):
        store.resume("s", T)
    store.close()  # idempotent
