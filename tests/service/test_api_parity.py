"""The same API-level tests against ``dss.open(...)`` and ``dss.connect(...)``.

``api`` is an embedded :class:`dss.Store`, or a :class:`dss.service.client.Client` of a real
``dss serve`` process on loopback (SQLite catalog, and PostgreSQL), so code can switch
between them by one line. Every test acts in a fresh tenant (``tenant``): the client's
admin key belongs to it, and the store is passed it explicitly, so both see exactly the
same sessions. Version ids are compared relative to each other: the service's store is
shared by all tests of the module.
"""

from __future__ import annotations

import array
import inspect
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import dss
from dss.service.client import Client
from dss.service.process import ServiceProcess
from tests.conftest import _pg_schema

LAYOUT = dss.Layout(name="parity", page_tokens=4, page_bytes=32, model="tiny", dtype="int8")
T = list(range(200, 210))  # two full pages and two tokens of tail


def page(tag: int) -> bytes:
    return bytes([tag]) * LAYOUT.page_bytes


@pytest.fixture(scope="module")
def sqlite_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("service")) as service:
        yield service


@pytest.fixture(scope="module")
def pg_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    for url in _pg_schema():
        with ServiceProcess(tmp_path_factory.mktemp("pg-service"), env={"DSS_CATALOG_URL": url}) as service:
            yield service


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["store", "client", "client-postgresql"])
def api(request: pytest.FixtureRequest, tmp_path: Path, tenant: str) -> Iterator[Any]:
    if request.param == "store":
        with dss.open(tmp_path / "store", fsync=False) as store:
            yield store
        return
    service = request.getfixturevalue("pg_service" if request.param == "client-postgresql" else "sqlite_service")
    with dss.connect(service.url, api_key=service.add_key(tenant, is_admin=True)) as client:
        yield client


def make(api: Any, tenant: str, session_id: str = "s", user_id: str = "u") -> dss.Session:
    return api.create_session(session_id, user_id=user_id, tenant_id=tenant, layout=LAYOUT)


# -- sessions ----------------------------------------------------------------------------------


def test_create_session_returns_the_session_and_is_idempotent(api: Any, tenant: str) -> None:
    s = make(api, tenant)
    assert isinstance(s, dss.Session)
    assert (s.session_id, s.tenant_id, s.user_id, s.layout, s.head_id, s.num_versions) == (
        "s",
        tenant,
        "u",
        LAYOUT,
        None,
        0,
    )
    assert s.created_at.tzinfo is not None
    assert make(api, tenant) == s
    assert api.session("s") == s
    with pytest.raises(dss.SessionExists, match=f"session 's' exists in tenant '{tenant}' with another owner"):
        make(api, tenant, user_id="v")


@pytest.mark.parametrize(
    ("session_id", "layout", "error", "message"),
    [
        ("~x", LAYOUT, dss.InvalidInput, "session ids starting with '~' are reserved for dss"),
        ("", LAYOUT, dss.InvalidInput, "session_id must be a printable string of 1 to 256 characters"),
        ("x" * 257, LAYOUT, dss.InvalidInput, "session_id must be a printable string of 1 to 256 characters"),
        (
            "s",
            {"name": "x", "page_tokens": 4, "page_bytes": 8},
            dss.InvalidInput,
            "layout must be a dss.Layout, not dict",
        ),
    ],
)
def test_create_session_refuses_bad_input(
    api: Any, tenant: str, session_id: str, layout: Any, error: type[dss.DssError], message: str
) -> None:
    with pytest.raises(error, match=message):
        api.create_session(session_id, user_id="u", tenant_id=tenant, layout=layout)
    assert api.sessions(tenant_id=tenant) == []


def test_sessions_list_filters_by_user_and_delete_releases_pages(api: Any, tenant: str) -> None:
    make(api, tenant, "a", user_id="u1")
    make(api, tenant, "b", user_id="u2")
    api.commit("a", T, {0: page(1), 1: page(2)})
    assert [s.session_id for s in api.sessions(tenant_id=tenant)] == ["a", "b"]
    assert [s.session_id for s in api.sessions(tenant_id=tenant, user_id="u2")] == ["b"]
    assert api.delete_session("a") == 2
    with pytest.raises(dss.UnknownSession, match="no session 'a'"):
        api.session("a")
    with pytest.raises(dss.UnknownSession, match="no session 'a'"):
        api.delete_session("a")
    assert api.check() == []


# -- versions ----------------------------------------------------------------------------------


def test_commit_versions_and_tokens(api: Any, tenant: str) -> None:
    make(api, tenant)
    v1 = api.commit("s", T, label="turn 1")
    v2 = api.commit("s", T + [1, 2, 3])
    assert isinstance(v1, dss.Version)
    assert (v1.session_id, v1.parent_id, v1.num_tokens, v1.label, v1.is_head, v1.is_pinned) == (
        "s",
        None,
        10,
        "turn 1",
        True,
        False,
    )
    assert (v2.parent_id, v2.num_tokens, v2.label, v2.is_head) == (v1.version_id, 13, None, True)
    assert api.versions("s") == [v1._replace(is_head=False), v2]
    assert api.tokens("s") == T + [1, 2, 3]
    assert api.tokens("s", v1.version_id) == T
    assert api.session("s").head_id == v2.version_id
    with pytest.raises(dss.UnknownVersion, match=f"version {v2.version_id + 1000} is not a version of session 's'"):
        api.tokens("s", v2.version_id + 1000)
    with pytest.raises(dss.UnknownSession, match="no session 'x'"):
        api.commit("x", T)


@pytest.mark.parametrize("tokens", [array.array("I", T), np.array(T, dtype=np.int64), tuple(T)])
def test_commit_accepts_integer_buffers(api: Any, tenant: str, tokens: Any) -> None:
    make(api, tenant)
    assert api.commit("s", tokens).num_tokens == 10
    assert api.tokens("s") == T


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "commit needs at least one token"),
        ([1, -1], r"token 1 is -1: ids must lie in \[0, 4294967295\]"),
        ([2**32], r"token 0 is 4294967296: ids must lie in \[0, 4294967295\]"),
        ([1, "2"], r"token 1 is '2' \(str\): ids must be integers"),
        (np.array([1.5]), "tokens must have an integer dtype, got float64"),
        ("abc", "tokens must be integer ids, not str"),
    ],
)
def test_commit_refuses_bad_tokens_and_changes_nothing(api: Any, tenant: str, tokens: Any, message: str) -> None:
    make(api, tenant)
    with pytest.raises(dss.InvalidTokens, match=message):
        api.commit("s", tokens)
    assert api.versions("s") == []


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ({0: b"short"}, "page 0 has 5 bytes; layout 'parity' pages have 32"),
        ({2: page(1)}, "page index 2 is out of range: 10 tokens hold 2 full pages of 4 tokens"),
        ({0: "text"}, "page 0 must be bytes-like, not str"),
        ([page(1)], "pages must be a mapping of page index to bytes, not list"),
    ],
)
def test_commit_refuses_bad_pages_and_changes_nothing(api: Any, tenant: str, pages: Any, message: str) -> None:
    make(api, tenant)
    with pytest.raises(dss.InvalidPage, match=message):
        api.commit("s", T, pages)
    assert api.versions("s") == []
    assert api.check() == []


def test_rollback_then_commit_forks_from_the_old_version(api: Any, tenant: str) -> None:
    make(api, tenant)
    v1 = api.commit("s", T)
    v2 = api.commit("s", T + [1])
    back = api.rollback("s", v1.version_id)
    assert back == v1._replace(is_head=True)
    v3 = api.commit("s", T + [2])
    assert v3.parent_id == v1.version_id
    assert [v.is_head for v in api.versions("s")] == [False, False, True]
    assert api.tokens("s", v2.version_id) == T + [1]
    with pytest.raises(dss.UnknownVersion):
        api.rollback("s", v3.version_id + 1000)
    with pytest.raises(dss.InvalidInput, match="version_id must be an int"):
        api.rollback("s", "1")


def test_branch_shares_pages_and_refuses_taken_names(api: Any, tenant: str) -> None:
    make(api, tenant)
    v1 = api.commit("s", T, {0: page(1), 1: page(2)})
    b = api.branch("s", v1.version_id, "b", label="regenerate")
    assert isinstance(b, dss.Session)
    assert (b.session_id, b.tenant_id, b.user_id, b.layout, b.num_versions) == ("b", tenant, "u", LAYOUT, 1)
    assert api.tokens("b") == T
    assert api.versions("b")[0].label == "regenerate"
    r = api.resume("b", T + [5])
    assert (r.matched_tokens, r.tiers) == (8, {"host": 8})
    assert api.read_pages(r.pages) == [page(1), page(2)]
    with pytest.raises(dss.SessionExists, match=f"session 'b' already exists in tenant '{tenant}'"):
        api.branch("s", v1.version_id, "b")
    with pytest.raises(dss.InvalidInput, match="reserved"):
        api.branch("s", v1.version_id, "~b")
    assert api.check() == []


def test_pin_and_unpin(api: Any, tenant: str) -> None:
    make(api, tenant)
    v1 = api.commit("s", T)
    assert api.pin("s", v1.version_id) == v1._replace(is_pinned=True)
    assert api.versions("s")[0].is_pinned is True
    assert api.pin("s", v1.version_id, pinned=False).is_pinned is False


# -- resume and pages --------------------------------------------------------------------------


def test_prefetch_answers_at_once(api: Any, tenant: str) -> None:
    make(api, tenant)
    assert api.prefetch("s") == 0  # no version yet
    api.commit("s", T, {0: page(1), 1: page(2)})
    assert api.prefetch("s") == 0  # host holds both pages already
    with pytest.raises(dss.UnknownSession):
        api.prefetch("nope")


def test_resume_reports_page_aligned_matches_on_their_tiers(api: Any, tenant: str) -> None:
    make(api, tenant)
    v1 = api.commit("s", T, {0: page(1), 1: page(2)})
    r = api.resume("s", T + [7, 8, 9])
    assert isinstance(r, dss.ResumeResult)
    assert (
        r.session_id,
        r.version_id,
        r.matched_tokens,
        r.num_prompt_tokens,
        r.num_history_tokens,
        r.num_new_tokens,
        r.page_tokens,
        r.page_bytes,
    ) == ("s", v1.version_id, 8, 13, 10, 5, 4, 32)
    assert [(p.index, p.tier, len(p.page_id)) for p in r.pages] == [(0, "host", 16), (1, "host", 16)]
    assert r.tiers == {"host": 8}
    assert (r.load_seconds, r.recompute_seconds, r.should_load) == (64 / 8e9, 8 / 4000, True)
    assert api.read_pages(r.pages) == [page(1), page(2)]
    assert api.read_pages([r.pages[1].page_id, bytes(16)]) == [page(2), None]
    assert api.read_pages([]) == []
    miss = api.resume("s", [1, 2, 3, 4, 5])
    assert (miss.matched_tokens, miss.version_id, miss.pages, miss.tiers, miss.should_load) == (0, None, [], {}, False)
    with pytest.raises(dss.UnknownSession):
        api.resume("nope", T)
    with pytest.raises(dss.InvalidTokens):
        api.resume("s", [-5])


def test_resume_stops_at_the_first_page_no_tier_holds(api: Any, tenant: str) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1)})
    r = api.resume("s", T)
    assert (r.matched_tokens, r.num_history_tokens, [p.index for p in r.pages]) == (4, 10, [0])


def test_save_pages_before_commit_and_lookup_without_session(api: Any, tenant: str) -> None:
    make(api, tenant)
    saved = api.save_pages("s", T, {0: page(1), 1: page(2)})
    assert saved.num_new == 2
    assert api.save_pages("s", T, {0: page(1)}) == dss.SavedPages({0: saved.page_ids[0]}, 0)
    r = api.resume("s", T)
    assert r.matched_tokens == 8
    assert saved.page_ids == {p.index: p.page_id for p in r.pages}
    alone = api.save_pages(None, [9] * 8, {0: page(3), 1: page(4)}, tenant_id=tenant, user_id="w", layout=LAYOUT)
    assert alone.num_new == 2
    found = api.lookup([9] * 8 + [1], layout=LAYOUT, user_id="w", tenant_id=tenant)
    assert alone.page_ids == {p.index: p.page_id for p in found.pages}
    assert (found.session_id, found.version_id, found.matched_tokens, found.tiers) == (None, None, 8, {"host": 8})
    assert api.read_pages(found.pages) == [page(3), page(4)]
    assert api.lookup([9] * 8, layout=LAYOUT, user_id="nobody", tenant_id=tenant).matched_tokens == 0
    with pytest.raises(dss.InvalidInput, match="save_pages without a session needs tenant_id, user_id and layout"):
        api.save_pages(None, T, {0: page(1)}, tenant_id=tenant, user_id="w")
    assert api.check() == []


# -- inspection --------------------------------------------------------------------------------


def test_sql_reads_the_catalog_views_and_refuses_writes(api: Any, tenant: str, request: pytest.FixtureRequest) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    placeholder = "%(t)s" if request.node.callspec.params["api"] == "client-postgresql" else ":t"  # the driver's
    out = api.sql(
        "SELECT user_id, num_versions, head_tokens, num_pages, page_bytes FROM session_summary "
        f"WHERE tenant_id = {placeholder}",
        {"t": tenant},
    )
    assert out == dss.SqlResult(
        ["user_id", "num_versions", "head_tokens", "num_pages", "page_bytes"], [("u", 1, 10, 2, 64)]
    )
    ids = api.sql("SELECT page_id FROM pages ORDER BY page_index", max_rows=1).rows
    assert len(ids) == 1 and isinstance(ids[0][0], bytes) and len(ids[0][0]) == 16
    with pytest.raises(dss.ReadOnlyViolation):
        api.sql("DELETE FROM sessions")
    with pytest.raises(dss.SqlError):
        api.sql("SELEC 1")
    if placeholder != ":t":  # PostgreSQL's json and arrays come back as Python values through the client too
        assert api.sql("SELECT '{\"a\": [1, 2.5, null]}'::jsonb AS j, ARRAY[1, 2] AS a").rows == [
            ({"a": [1, 2.5, None]}, [1, 2])
        ]
    assert [s.session_id for s in api.sessions(tenant_id=tenant)] == ["s"]


def test_check_and_stats(api: Any, tenant: str) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1)})
    assert api.check() == []
    stats = api.stats()
    assert set(stats) == {"host", "disk", "prefetch", "policy", "erasures", "lsh"}
    assert stats["erasures"] == {"open": 0, "oldest_open_s": 0.0}
    assert stats["host"]["pages"] >= 1 and stats["disk"]["bytes"] >= 32
    assert stats["host"]["high_watermark"] == round(0.85 * stats["host"]["capacity"])
    assert set(stats["prefetch"]) == {"issued", "hits", "wasted"} and stats["policy"]["name"] == "dss"


def test_a_multi_turn_conversation_with_undo_and_regenerate(api: Any, tenant: str) -> None:
    """A chat backend's turn loop: resume, commit, undo (rollback), regenerate (branch)."""
    make(api, tenant, "chat")
    history: list[int] = []
    heads = []
    for turn in range(4):
        prompt = history + [1000 + turn] * 6
        assert api.resume("chat", prompt).matched_tokens == len(history) // 4 * 4
        history = prompt + [2000 + turn] * 5
        pages = {i: page(turn * 10 + i) for i in range(len(history) // 4)}
        heads.append(api.commit("chat", history, pages))
    api.rollback("chat", heads[1].version_id)
    assert api.tokens("chat") == api.tokens("chat", heads[1].version_id)
    regenerated = api.branch("chat", heads[2].version_id, "chat-regen")
    assert api.tokens("chat-regen") == api.tokens("chat", heads[2].version_id)
    r = api.resume("chat", api.tokens("chat", heads[3].version_id))
    assert (r.matched_tokens, r.version_id) == (heads[3].num_tokens // 4 * 4, heads[3].version_id)
    assert regenerated.head_id is not None
    assert api.check() == []


# -- erasure -----------------------------------------------------------------------------------


def test_forget_user_erases_only_that_user_and_leaves_a_receipt(api: Any, tenant: str) -> None:
    make(api, tenant, "a", user_id="gone")
    make(api, tenant, "b", user_id="stays")
    api.commit("a", T, {0: page(1), 1: page(2)})
    api.commit("b", T, {0: page(3)})
    plan = api.forget_user("gone", tenant_id=tenant, dry_run=True)
    assert (plan.user_id, plan.sessions, plan.versions, plan.pages) == ("gone", 1, 1, 2)
    receipt = api.forget_user("gone", tenant_id=tenant)
    assert (receipt.kind, receipt.tenant_id, receipt.user_id, receipt.key_destroyed) == (
        "forget-user",
        tenant,
        "gone",
        True,
    )
    assert receipt.removed.pages == 2 and receipt.verification.ok is True
    assert [s.session_id for s in api.sessions(tenant_id=tenant)] == ["b"]
    with pytest.raises(dss.UnknownSession):
        api.resume("a", T)
    assert api.resume("b", T).matched_tokens == 4
    assert [(r.kind, r.user_id, r.receipt) for r in api.audit(tenant_id=tenant)] == [("forget-user", "gone", receipt)]
    assert api.check() == []


# -- input the Python API cannot even express -----------------------------------------------------


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("service_name", ["sqlite_service", "pg_service"])
def test_a_layout_with_a_non_finite_number_is_refused_over_http(
    request: pytest.FixtureRequest, tenant: str, service_name: str, literal: str
) -> None:
    """Python's JSON reads NaN and Infinity; stored, they came back as null and every listing of
    the tenant failed. The layout is refused, and the tenant's sessions still list."""
    service = request.getfixturevalue(service_name)
    key = service.add_key(tenant, is_admin=True)
    body = (
        '{"session_id": "s", "user_id": "u", "layout": {"name": "x", "page_tokens": 4, "page_bytes": 8, '
        f'"scale": {literal}}}}}'
    )
    answer = httpx.post(
        f"{service.url}/v1/sessions",
        content=body,
        timeout=30,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert (answer.status_code, answer.json()["kind"]) == (400, "InvalidLayout")
    assert answer.json()["detail"].startswith("layout field 'scale' must be a finite number")
    with dss.connect(service.url, api_key=key) as client:
        assert client.sessions() == []
        make(client, tenant)
        assert [s.session_id for s in client.sessions()] == ["s"]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda api: api.commit("s", [1, True]), dss.InvalidTokens, r"token 1 is True \(bool\)"),
        (lambda api: api.read_pages([7]), dss.InvalidInput, "page 0 must be a PageRef or a 16-byte page id, got 7"),
        (lambda api: api.pin("s", 1, pinned=1), dss.InvalidInput, "pinned must be True or False, not int"),
        (
            lambda api: api.forget_user("u", tenant_id="t", dry_run="yes"),
            dss.InvalidInput,
            "dry_run must be True or False, not str",
        ),
        (
            lambda api: api.create_session("x", layout=dss.Layout.from_dict),
            dss.InvalidInput,
            "layout must be a dss.Layout",
        ),
    ],
)
def test_wrong_types_are_refused_alike(
    api: Any, tenant: str, call: Any, error: type[dss.DssError], message: str
) -> None:
    make(api, tenant)
    with pytest.raises(error, match=message):
        call(api)
    assert [(s.session_id, s.num_versions) for s in api.sessions(tenant_id=tenant)] == [("s", 0)]


def test_nearest_explain_and_approximate_resume(api: Any, tenant: str) -> None:
    """The same near-duplicate answers embedded and over HTTP: a prompt with one token changed at 40."""
    tokens = list(range(6000, 6300))
    make(api, tenant)
    api.commit("s", tokens, {k: page(k + 1) for k in range(len(tokens) // 4)})
    prompt = tokens[:40] + [7] + tokens[41:]
    make(api, tenant, "fresh")
    result = api.resume("fresh", prompt, approximate=True)
    assert (result.matched_tokens, result.source, result.num_candidates) == (40, "namespace", 1)
    assert result.near == dss.Candidate(
        "s", result.near.version_id, 300, result.near.estimated_jaccard, 293 / 301, 40, 40, 40, 293 / 297
    )
    found = api.nearest(prompt, user_id="u", layout=LAYOUT, tenant_id=tenant, k=3)
    assert found == [result.near]
    why = api.explain("fresh", prompt, decode=lambda ids: ",".join(map(str, ids)), context=2)
    assert (why.divergence, why.matched_tokens, why.would_reuse_tokens, why.lost_tokens) == (40, 40, 300, 260)
    assert (why.prompt_window, why.stored_window, why.prompt_text) == (
        [6038, 6039, 7, 6041],
        [6038, 6039, 6040, 6041],
        "6038,6039,7,6041",
    )
    assert (why.resync_prompt, why.resync_stored, why.num_shared_after) == (41, 41, 259)
    assert why.recurring[0] == (40, 2)


# -- the two surfaces --------------------------------------------------------------------------

EMBEDDED_ONLY: dict[str, str] = {}
"""Public ``dss.Store`` methods a client does not have, with the reason for each. None today:
every method has an endpoint (engines' residency, compaction, the mover and shared prefixes
included), so code written against ``dss.open`` runs against ``dss.connect`` unchanged."""

CLIENT_DEFAULTS = {"tenant_id"}
"""Parameters whose default differs on purpose: the client's ``tenant_id`` defaults to the API
key's tenant (``None``), the store's to ``"default"`` or every tenant."""


def public_members(cls: type) -> dict[str, Any]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


def test_the_client_has_every_public_method_of_the_store_with_the_same_parameters() -> None:
    """Every public method (and property) of ``dss.Store`` is on the client, with the store's
    parameters in the same order, of the same kinds and with the same defaults (``tenant_id``
    excepted); the client may add keyword-only parameters with defaults (``all_tenants``)."""
    store, client = public_members(dss.Store), public_members(Client)
    assert sorted(set(store) - set(client)) == sorted(EMBEDDED_ONLY)
    mismatched = {}
    for name, member in store.items():
        if name in EMBEDDED_ONLY:
            continue
        theirs = client[name]
        if isinstance(member, property):
            if not isinstance(theirs, property):
                mismatched[name] = "a property on the store, not on the client"
            continue
        ours = list(inspect.signature(member).parameters.values())
        other = list(inspect.signature(theirs).parameters.values())
        wanted = [(p.name, p.kind, p.default if p.name not in CLIENT_DEFAULTS else None) for p in ours]
        got = [(p.name, p.kind, p.default if p.name not in CLIENT_DEFAULTS else None) for p in other[: len(ours)]]
        extra = [p for p in other[len(ours) :] if p.kind is not p.KEYWORD_ONLY or p.default is p.empty]
        if got != wanted or extra:
            mismatched[name] = f"store {[p.name for p in ours]}, client {[p.name for p in other]}"
    assert mismatched == {}


# -- shared prefixes, engines' residency, compaction, the mover ---------------------------------


def test_register_prefix_shares_its_pages_with_every_session_of_the_tenant(api: Any, tenant: str) -> None:
    make(api, tenant)
    shared = api.register_prefix(T[:8], {0: page(7), 1: page(8)}, layout=LAYOUT, tenant_id=tenant, label="system")
    assert isinstance(shared, dss.Version)
    assert (shared.parent_id, shared.num_tokens, shared.label, shared.is_head, shared.is_pinned) == (
        None,
        8,
        "system",
        True,
        True,
    )
    assert api.shared_prefixes(tenant_id=tenant) == [shared]
    r = api.resume("s", T)
    assert (r.matched_tokens, r.version_id, r.tiers) == (8, None, {"host": 8})
    assert api.read_pages(r.pages) == [page(7), page(8)]
    with pytest.raises(dss.InvalidTokens, match="a shared prefix needs at least one token"):
        api.register_prefix([], {}, layout=LAYOUT, tenant_id=tenant)
    with pytest.raises(dss.InvalidPage, match="page 0 has 5 bytes; layout 'parity' pages have 32"):
        api.register_prefix(T[:8], {0: b"short"}, layout=LAYOUT, tenant_id=tenant)
    assert api.shared_prefixes(tenant_id=tenant) == [shared]
    assert api.check() == []


def test_engines_residency_steers_a_session_to_the_engine_holding_its_pages(api: Any, tenant: str) -> None:
    engine = f"engine-{tenant}"  # the service's engines outlive a test: one of its own
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    ids = [ref.page_id for ref in api.resume("s", T).pages]
    assert api.residency("s") == {}
    assert api.mark_resident(engine, ids) is None
    assert api.residency("s") == {engine: 2}
    assert api.resume("s", T).tiers == {"device": 8}
    assert api.evicted(engine, ids[:1]) is None
    assert api.residency("s", tenant_id=tenant) == {engine: 1}
    assert api.forget_engine(engine) == 1
    assert api.forget_engine(engine) == 0
    assert api.residency("s") == {}
    with pytest.raises(dss.UnknownSession, match="no session 'nope'"):
        api.residency("nope")
    with pytest.raises(dss.InvalidInput, match="engine_id must be a printable string of 1 to 256 characters"):
        api.mark_resident("", ids)
    with pytest.raises(dss.InvalidInput, match="page 0 must be a PageRef or a 16-byte page id, got 7"):
        api.evicted(engine, [7])


def test_page_sizes_and_reads_of_one_tenant(api: Any, tenant: str) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    refs = api.resume("s", T).pages
    ids = [ref.page_id for ref in refs]
    assert api.page_sizes([*ids, bytes(16)], tenant_id=tenant) == {ids[0]: 32, ids[1]: 32}
    assert api.page_sizes(ids, tenant_id=f"{tenant}-other") == {}
    assert api.read_pages(refs, tenant_id=tenant, load=False) == [page(1), page(2)]
    assert api.read_pages(refs, tenant_id=f"{tenant}-other") == [None, None]
    with pytest.raises(dss.InvalidInput, match="load must be True or False, not str"):
        api.read_pages(refs, load="no")


def test_reads_into_the_callers_buffers(api: Any, tenant: str) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    refs = api.resume("s", T).pages
    rows = [bytearray(32), bytearray(32)]
    got = api.read_pages([*refs, bytes(16)], into=[*rows, bytearray(32)])
    assert [bytes(v) if v is not None else None for v in got] == [page(1), page(2), None]
    assert rows == [bytearray(page(1)), bytearray(page(2))]
    assert got[0].obj is rows[0]  # the caller's buffer, not a copy
    told: list[int] = []
    api.read_pages([bytes(16), *refs], tenant_id=tenant, into=[bytearray(32) for _ in range(3)], ready=told.extend)
    assert sorted(told) == [1, 2]  # indexes into the pages asked for, each filled
    with pytest.raises(dss.InvalidInput, match="ready is told which buffers are filled: give it with into"):
        api.read_pages(refs, ready=told.extend)
    short = [bytearray(32), bytearray(31)]
    with pytest.raises(dss.InvalidInput, match="buffer 1 has 31 bytes; its page has 32"):
        api.read_pages(refs, into=short)
    assert short == [bytearray(32), bytearray(31)]  # nothing written
    with pytest.raises(dss.InvalidInput, match="into must be a list of 2 writable buffers, one per page"):
        api.read_pages(refs, into=[bytearray(32)])
    with pytest.raises(dss.InvalidInput, match=r"into\[0\] must be a writable, contiguous buffer"):
        api.read_pages(refs, into=[b"x" * 32, bytearray(32)])


def test_prefetch_waits_when_asked(api: Any, tenant: str) -> None:
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    assert api.prefetch("s", wait=True) == 0  # host holds both pages already
    with pytest.raises(dss.InvalidInput, match="wait must be True or False, not str"):
        api.prefetch("s", wait="yes")


def test_prefetch_candidates_name_the_pages_a_near_duplicate_lets_a_prompt_reuse(api: Any, tenant: str) -> None:
    tokens = list(range(6000, 6300))
    make(api, tenant)
    api.commit("s", tokens, {k: page(k + 1) for k in range(len(tokens) // 4)})
    stored = [ref.page_id for ref in api.resume("s", tokens).pages]
    prompt = tokens[:40] + [7] + tokens[41:]
    make(api, tenant, "fresh")
    assert api.prefetch_candidates(prompt, session_id="fresh") == stored[:10]
    assert api.prefetch_candidates(prompt, user_id="u", layout=LAYOUT, tenant_id=tenant, promote=False) == stored[:10]
    assert api.prefetch_candidates(prompt, user_id="nobody", layout=LAYOUT, tenant_id=tenant) == []


def test_compact_count_sessions_and_the_mover(api: Any, tenant: str) -> None:
    before = api.count_sessions()
    make(api, tenant)
    api.commit("s", T, {0: page(1), 1: page(2)})
    assert api.count_sessions() == before + 1
    done = api.compact()
    assert isinstance(done, dss.Compaction) and done.dry_run is False
    assert api.compact(dry_run=True) == dss.Compaction(True, 0, 0, 0, done.bytes_after, done.bytes_after, 0)
    with pytest.raises(dss.InvalidInput, match="dry_run must be True or False, not str"):
        api.compact(dry_run="yes")
    assert api.run_mover() == {"host": 0, "disk": 0}  # both tiers far below their high marks
    assert api.check() == []
    assert api.is_closed is False
    api.close()
    assert api.is_closed is True
