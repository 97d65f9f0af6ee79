"""Tenant isolation through the HTTP API (dss.service.tenancy): two keys, identical session ids and tokens,
no cross visibility on any endpoint; another tenant's data answers exactly like missing data."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dss.service.apikeys import add_key
from tests.service.test_server import LAYOUT_JSON, Service, T, b64, page

X = [1, 2, 3, 4]  # one more page


@pytest.fixture
def twins(tmp_path: Path) -> Iterator[Service]:
    """Tenants t1 and t2 each hold session "chat" with the same tokens and pages; t1 also "only1"
    (versions 1-2 are t1's chat, 3 is t2's chat, 4 is t1's only1)."""
    svc = Service(tmp_path / "home")
    with svc.http:
        for who in ("t1", "t2"):
            svc.create("chat", who=who)
            svc.commit(T, "chat", who=who, pages={0: page(1), 1: page(2)})
            if who == "t1":
                svc.commit(T + X, "chat", who=who, pages={2: page(3)})
        svc.create("only1", who="t1")
        svc.commit(T, "only1", who="t1", pages={0: page(1), 1: page(2)})
        yield svc


Request = Callable[[str, int], tuple[str, str, dict[str, Any]]]
"""(session_id, version_id) -> (method, path, request keywords)."""

SESSION_REQUESTS: dict[str, Request] = {
    "get": lambda s, v: ("GET", "/v1/session", {"params": {"session_id": s}}),
    "versions": lambda s, v: ("GET", "/v1/versions", {"params": {"session_id": s}}),
    "tokens": lambda s, v: ("GET", "/v1/tokens", {"params": {"session_id": s}}),
    "tokens_of_version": lambda s, v: ("GET", "/v1/tokens", {"params": {"session_id": s, "version_id": v}}),
    "commit": lambda s, v: ("POST", "/v1/commit", {"json": {"session_id": s, "tokens": T}}),
    "save_pages": lambda s, v: (
        "POST",
        "/v1/pages",
        {"json": {"session_id": s, "tokens": T, "pages": {"0": b64(page(1))}}},
    ),
    "resume": lambda s, v: ("POST", "/v1/resume", {"json": {"session_id": s, "tokens": T}}),
    "rollback": lambda s, v: ("POST", "/v1/rollback", {"json": {"session_id": s, "version_id": v}}),
    "branch": lambda s, v: (
        "POST",
        "/v1/branch",
        {"json": {"session_id": s, "version_id": v, "new_session_id": "fork"}},
    ),
    "pin": lambda s, v: ("POST", "/v1/pin", {"json": {"session_id": s, "version_id": v}}),
    "delete": lambda s, v: ("DELETE", "/v1/session", {"params": {"session_id": s}}),
    "residency": lambda s, v: ("GET", "/v1/residency", {"params": {"session_id": s}}),
    "prefetch_candidates": lambda s, v: ("POST", "/v1/prefetch_candidates", {"json": {"session_id": s, "tokens": T}}),
}


def fingerprint(svc: Service) -> Any:
    """Everything t1 holds, as the store sees it."""
    return [
        (
            s.session_id,
            s.head_id,
            [tuple(v[:4]) + (v.is_pinned,) for v in svc.store.versions(s.session_id, tenant_id="t1")],
        )
        for s in svc.store.sessions(tenant_id="t1")
    ]


def same_answer(a: httpx.Response, b: httpx.Response, a_id: str, b_id: str) -> None:
    assert a.status_code == b.status_code
    assert a.headers["content-type"] == b.headers["content-type"]
    assert json.loads(a.text.replace(a_id, b_id)) == b.json()


@pytest.mark.parametrize("name", sorted(SESSION_REQUESTS))
def test_another_tenants_session_answers_like_a_missing_one(twins: Service, name: str) -> None:
    before = fingerprint(twins)
    method, path, kw = SESSION_REQUESTS[name]("only1", 4)
    theirs = twins.call(method, path, "t2", **kw)
    method, path, kw = SESSION_REQUESTS[name]("never", 4)
    missing = twins.call(method, path, "t2", **kw)
    assert theirs.status_code == 404
    same_answer(theirs, missing, "only1", "never")
    assert fingerprint(twins) == before


@pytest.mark.parametrize("name", ["tokens_of_version", "rollback", "branch", "pin"])
def test_another_tenants_version_answers_like_a_missing_one(twins: Service, name: str) -> None:
    before = fingerprint(twins)
    method, path, kw = SESSION_REQUESTS[name]("chat", 1)  # version 1 is t1's
    theirs = twins.call(method, path, "t2", **kw)
    method, path, kw = SESSION_REQUESTS[name]("chat", 999)
    missing = twins.call(method, path, "t2", **kw)
    assert theirs.status_code == 404
    assert theirs.json()["kind"] == "UnknownVersion"
    same_answer(theirs, missing, "version 1 ", "version 999 ")
    assert fingerprint(twins) == before


def test_identical_session_ids_hold_separate_histories(twins: Service) -> None:
    one = twins.ok("GET", "/v1/session", "t1", params={"session_id": "chat"})
    two = twins.ok("GET", "/v1/session", "t2", params={"session_id": "chat"})
    assert (one["tenant_id"], one["head_id"], one["num_versions"]) == ("t1", 2, 2)
    assert (two["tenant_id"], two["head_id"], two["num_versions"]) == ("t2", 3, 1)
    assert [s["session_id"] for s in twins.ok("GET", "/v1/sessions", "t1")] == ["chat", "only1"]
    assert [s["session_id"] for s in twins.ok("GET", "/v1/sessions", "t2")] == ["chat"]
    assert [v["version_id"] for v in twins.ok("GET", "/v1/versions", "t2", params={"session_id": "chat"})] == [3]
    assert twins.ok("GET", "/v1/tokens", "t2", params={"session_id": "chat"})["tokens"] == T


def test_resume_and_pages_never_cross_tenants(twins: Service) -> None:
    r1 = twins.ok("POST", "/v1/resume", "t1", json={"session_id": "chat", "tokens": T + X})
    r2 = twins.ok("POST", "/v1/resume", "t2", json={"session_id": "chat", "tokens": T + X})
    assert (r1["matched_tokens"], r2["matched_tokens"]) == (12, 8)
    ids1 = [p["page_id"] for p in r1["pages"]]
    ids2 = [p["page_id"] for p in r2["pages"]]
    assert not set(ids1) & set(ids2)  # identical tokens, different namespaces: different pages
    assert twins.ok("POST", "/v1/pages/read", "t2", json={"page_ids": ids1}) == {"pages": [None, None, None]}
    assert twins.ok("POST", "/v1/pages/read", "t1", json={"page_ids": ids2}) == {"pages": [None, None]}
    assert twins.ok("POST", "/v1/pages/read", "t2", json={"page_ids": ids2}) == {"pages": [b64(page(1)), b64(page(2))]}
    assert twins.ok("POST", "/v1/pages/read", "admin", json={"page_ids": ids2}) == {
        "pages": [b64(page(1)), b64(page(2))]
    }


def test_lookup_without_a_session_stays_in_the_tenant(twins: Service) -> None:
    saved = {"session_id": None, "tokens": T, "pages": {"0": b64(page(5))}, "user_id": "u", "layout": LAYOUT_JSON}
    assert twins.ok("POST", "/v1/pages", "t1", json=saved)["num_new_pages"] == 0  # chat already stored it
    query = {"tokens": T, "layout": LAYOUT_JSON, "user_id": "u"}
    assert twins.ok("POST", "/v1/lookup", "t1", json=query)["matched_tokens"] == 8  # chat's pages of user u too
    assert twins.ok("POST", "/v1/lookup", "t2", json={**query, "tokens": [9] * 8})["matched_tokens"] == 0
    t2_view = twins.ok("POST", "/v1/lookup", "t2", json=query)
    t1_view = twins.ok("POST", "/v1/lookup", "t1", json=query)
    assert not {p["page_id"] for p in t2_view["pages"]} & {p["page_id"] for p in t1_view["pages"]}


def test_names_taken_in_one_tenant_are_free_in_the_other(twins: Service) -> None:
    assert (
        twins.ok(
            "POST",
            "/v1/branch",
            "t2",
            status=201,
            json={"session_id": "chat", "version_id": 3, "new_session_id": "only1"},
        )["tenant_id"]
        == "t2"
    )
    twins.create("only1b", who="t2")
    assert twins.ok("DELETE", "/v1/session", "t2", params={"session_id": "chat"})["num_pages_released"] == 0
    assert twins.ok("GET", "/v1/session", "t1", params={"session_id": "chat"})["num_versions"] == 2
    assert twins.store.check() == []


@pytest.mark.parametrize("session_id", ["only1", "never"])
def test_naming_another_tenant_is_403_whether_or_not_it_holds_the_session(twins: Service, session_id: str) -> None:
    for name, request in SESSION_REQUESTS.items():
        method, path, kw = request(session_id, 4)
        where = "params" if "params" in kw else "json"
        kw = {where: {**kw[where], "tenant_id": "t1"}}
        answer = twins.call(method, path, "t2", **kw)
        assert answer.status_code == 403, name
        assert answer.json()["detail"] in (
            "this API key may read only its own tenant 't2'",
            "writes go to the API key's own tenant 't2', not 't1'",
        )


def test_an_admin_key_reads_other_tenants_but_writes_only_its_own(twins: Service) -> None:
    got = twins.ok("GET", "/v1/session", "admin", params={"session_id": "chat", "tenant_id": "t2"})
    assert (got["tenant_id"], got["head_id"]) == ("t2", 3)
    r = twins.ok("POST", "/v1/resume", "admin", json={"session_id": "chat", "tokens": T + X, "tenant_id": "t2"})
    assert r["matched_tokens"] == 8
    assert twins.ok("GET", "/v1/tokens", "admin", params={"session_id": "chat", "tenant_id": "t2"})["tokens"] == T
    for name in ("commit", "rollback", "pin", "delete", "save_pages", "branch"):
        method, path, kw = SESSION_REQUESTS[name]("chat", 3)
        where = "params" if "params" in kw else "json"
        answer = twins.call(method, path, "admin", **{where: {**kw[where], "tenant_id": "t2"}})
        assert (answer.status_code, answer.json()["detail"]) == (
            403,
            "writes go to the API key's own tenant 't1', not 't2'",
        ), name
    assert twins.ok("GET", "/v1/session", "t2", params={"session_id": "chat"})["num_versions"] == 1


def test_forgetting_a_user_in_one_tenant_leaves_the_same_user_id_in_the_other(twins: Service) -> None:
    twins.keys["admin2"] = add_key(twins.home / "api-keys.json", "t2", is_admin=True)[0]
    receipt = twins.ok("POST", "/v1/forget_user", "admin2", json={"user_id": "u", "tenant_id": "t2"})
    assert (receipt["tenant_id"], receipt["removed"]["sessions"]) == ("t2", 1)
    assert twins.ok("GET", "/v1/sessions", "t2") == []
    assert [s["session_id"] for s in twins.ok("GET", "/v1/sessions", "t1")] == ["chat", "only1"]
    assert twins.ok("POST", "/v1/resume", "t1", json={"session_id": "chat", "tokens": T + X})["matched_tokens"] == 12
    assert twins.ok("GET", "/v1/audit", "t1") == []
    assert twins.store.check() == []


def test_shared_prefixes_and_page_sizes_stay_in_the_tenant(twins: Service) -> None:
    """t1's shared prefix is listed for t1 only; t2 sees none of t1's page sizes, and may not name t1."""
    shared = twins.ok(
        "POST",
        "/v1/prefixes",
        "t1",
        status=201,
        json={"tokens": X, "pages": {"0": b64(page(9))}, "layout": LAYOUT_JSON},
    )
    assert [v["version_id"] for v in twins.ok("GET", "/v1/prefixes", "t1")] == [shared["version_id"]]
    assert twins.ok("GET", "/v1/prefixes", "t2") == []
    ids = [
        p["page_id"] for p in twins.ok("POST", "/v1/resume", "t1", json={"session_id": "only1", "tokens": T})["pages"]
    ]
    assert twins.ok("POST", "/v1/pages/sizes", "t1", json={"page_ids": ids}) == {"sizes": {i: 16 for i in ids}}
    assert twins.ok("POST", "/v1/pages/sizes", "t2", json={"page_ids": ids}) == {"sizes": {}}  # t2's own ids differ
    answer = twins.call("POST", "/v1/pages/sizes", "t2", json={"page_ids": ids, "tenant_id": "t1"})
    assert (answer.status_code, answer.json()["detail"]) == (403, "this API key may read only its own tenant 't2'")
    assert (
        twins.ok("POST", "/v1/prefixes", "admin", status=201, json={"tokens": X, "pages": {}, "layout": LAYOUT_JSON})[
            "num_tokens"
        ]
        == 4
    )
    refused = twins.call(
        "POST", "/v1/prefixes", "admin", json={"tokens": X, "pages": {}, "layout": LAYOUT_JSON, "tenant_id": "t2"}
    )
    assert (refused.status_code, refused.json()["detail"]) == (
        403,
        "writes go to the API key's own tenant 't1', not 't2'",
    )
