"""The HTTP API (dss.service.server) in process: every endpoint, its happy path and each error class,
with exact status codes and bodies. A real store and the real app (FastAPI's TestClient)."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

import dss
from dss.service.apikeys import KeyRing, add_key
from dss.service.config import load_server_config
from dss.service.problems import problem
from dss.service.server import create_app
from tests.catalog.test_readonly_sql import ATTACKS, snapshot

LAYOUT = dss.Layout(name="test", page_tokens=4, page_bytes=16, model="tiny")
LAYOUT_JSON = {"name": "test", "page_tokens": 4, "page_bytes": 16, "model": "tiny"}
T = list(range(100, 110))  # 10 tokens: two full pages of 4, and 2 tokens of tail


def page(tag: int) -> bytes:
    return bytes([tag]) * LAYOUT.page_bytes


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Service:
    """The app on a fresh store, with keys: ``admin`` (tenant t1, admin), ``t1`` and ``t2``."""

    def __init__(
        self, home: Path, catalog_url: str | None = None, store_options: dict[str, Any] | None = None, **config: Any
    ) -> None:
        self.home = home
        self.keys = {
            "admin": add_key(home / "api-keys.json", "t1", is_admin=True)[0],
            "t1": add_key(home / "api-keys.json", "t1")[0],
            "t2": add_key(home / "api-keys.json", "t2")[0],
        }
        self.store = dss.open(home, fsync=False, catalog_url=catalog_url, **(store_options or {}))
        self.config = load_server_config(home, **config)
        self.app = create_app(
            self.store, self.config, KeyRing(self.config.keys_file, reload_interval_s=0), close_store=True
        )
        self.http = TestClient(self.app)

    def call(self, method: str, path: str, who: str | None = "t1", **kw: Any) -> httpx.Response:
        headers = kw.pop("headers", {})
        if who is not None:
            headers["Authorization"] = f"Bearer {self.keys[who]}"
        return self.http.request(method, path, headers=headers, **kw)

    def ok(self, method: str, path: str, who: str | None = "t1", status: int = 200, **kw: Any) -> Any:
        response = self.call(method, path, who, **kw)
        assert response.status_code == status, response.text
        return response.json()

    def create(self, session_id: str = "s", who: str = "t1", user_id: str = "u") -> dict[str, Any]:
        return self.ok(
            "POST", "/v1/sessions", who, json={"session_id": session_id, "user_id": user_id, "layout": LAYOUT_JSON}
        )

    def commit(
        self,
        tokens: list[int],
        session_id: str = "s",
        who: str = "t1",
        pages: dict[int, bytes] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        body = {"session_id": session_id, "tokens": tokens, **extra}
        if pages is not None:
            body["pages"] = {str(i): b64(p) for i, p in pages.items()}
        return self.ok("POST", "/v1/commit", who, status=201, json=body)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "home")
    with svc.http:
        yield svc


def expect_problem(response: httpx.Response, kind: str, status: int, detail: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json() == problem(kind, status, detail)


def when(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


# -- service endpoints -------------------------------------------------------------------------


def test_healthz_answers_without_a_key_and_503_once_the_store_closes(service: Service) -> None:
    assert service.ok("GET", "/healthz", who=None) == {"status": "ok", "version": dss.__version__}
    service.store.close()
    expect_problem(service.call("GET", "/healthz", who=None), "StoreClosed", 503, "this store is closed")


def test_openapi_lists_every_endpoint_with_its_error_responses(service: Service) -> None:
    doc = service.ok("GET", "/openapi.json", who=None)
    paths = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert paths == {
        ("/healthz", "get"),
        ("/metrics", "get"),
        ("/v1/info", "get"),
        ("/v1/sessions", "post"),
        ("/v1/sessions", "get"),
        ("/v1/session", "get"),
        ("/v1/session", "delete"),
        ("/v1/versions", "get"),
        ("/v1/tokens", "get"),
        ("/v1/commit", "post"),
        ("/v1/pages", "post"),
        ("/v1/pages/read", "post"),
        ("/v1/resume", "post"),
        ("/v1/lookup", "post"),
        ("/v1/nearest", "post"),
        ("/v1/explain", "post"),
        ("/v1/rollback", "post"),
        ("/v1/branch", "post"),
        ("/v1/pin", "post"),
        ("/v1/sql", "post"),
        ("/v1/check", "get"),
        ("/v1/stats", "get"),
        ("/v1/forget_user", "post"),
        ("/v1/audit", "get"),
        ("/v1/prefetch", "post"),
        ("/v1/pages/sizes", "post"),
        ("/v1/prefixes", "post"),
        ("/v1/prefixes", "get"),
        ("/v1/prefetch_candidates", "post"),
        ("/v1/residency", "get"),
        ("/v1/engines/resident", "post"),
        ("/v1/engines/evicted", "post"),
        ("/v1/engines/forget", "post"),
        ("/v1/sessions/count", "get"),
        ("/v1/compact", "post"),
        ("/v1/mover", "post"),
    }
    for path, item in doc["paths"].items():
        if path.startswith("/v1/"):
            for operation in item.values():
                assert {"400", "401", "403", "404", "409", "413", "503"} <= set(operation["responses"]), path


def test_openapi_declares_the_bearer_key_on_every_protected_route(service: Service) -> None:
    """The document names the bearer scheme, so /docs' "Authorize" and "Try it out" send the key:
    every /v1 route and /metrics require it; /healthz, which needs no key, does not."""
    doc = service.ok("GET", "/openapi.json", who=None)
    assert doc["components"]["securitySchemes"] == {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key of `dss keys add`, sent as `Authorization: Bearer <key>`.",
        }
    }
    security = {
        (path, method): operation.get("security")
        for path, item in doc["paths"].items()
        for method, operation in item.items()
    }
    assert security.pop(("/healthz", "get")) is None
    assert {route: value for route, value in security.items() if value != [{"bearer": []}]} == {}
    assert all(path.startswith("/v1/") or path == "/metrics" for path, _ in security)


def test_docs_pages_load_only_assets_the_service_serves_itself(service: Service) -> None:
    """/docs and /redoc work offline: every script, style sheet and icon they reference is a path of
    this service, answered 200 with the right type and the real asset, and no key is needed."""
    expected = {".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
    for page, marker in (("/docs", "SwaggerUIBundle("), ("/redoc", "<redoc spec-url=")):
        answer = service.call("GET", page, who=None)
        assert (answer.status_code, answer.headers["content-type"]) == (200, "text/html; charset=utf-8")
        assert marker in answer.text and "/openapi.json" in answer.text
        urls = re.findall(r'(?:src|href)="([^"]+)"', answer.text)
        assert urls and all(url.startswith("/docs/assets/") for url in urls), urls
        assert "http://" not in answer.text and "https://" not in answer.text
        for url in urls:
            asset = service.call("GET", url, who=None)
            kind = expected[url[url.rindex(".") :]]
            assert (asset.status_code, asset.headers["content-type"].split(";")[0]) == (200, kind), url
            assert len(asset.content) > 1000
    assert service.call("GET", "/docs/assets/swagger-ui-bundle.js", who=None).text.find("SwaggerUIBundle") > 0
    assert service.call("GET", "/docs/assets/swagger-ui.css", who=None).text.startswith(".swagger-ui{")
    expect_problem(
        service.call("GET", "/docs/assets/nope.js", who=None), "NotFound", 404, "no endpoint GET /docs/assets/nope.js"
    )


def test_info_names_the_key_its_tenant_and_the_limits(service: Service) -> None:
    body = service.ok("GET", "/v1/info", who="t2")
    key_id = service.keys["t2"].split("_")[1]
    assert body == {
        "version": dss.__version__,
        "key_id": key_id,
        "tenant_id": "t2",
        "is_admin": False,
        "limits": {"max_body_bytes": 32 << 20, "max_tokens": 1 << 20},
        "rates": {"tier_bytes_per_s": {"host": 8e9, "disk": 1e9}, "recompute_tokens_per_s": 4000.0},
    }


# -- authentication and routing ----------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer "}, {"Authorization": "Basic dXNlcjpwdw=="}])
def test_requests_without_a_bearer_key_are_401(service: Service, headers: dict[str, str]) -> None:
    response = service.call("GET", "/v1/sessions", who=None, headers=headers)
    expect_problem(response, "Unauthorized", 401, "this endpoint needs an API key: send 'Authorization: Bearer <key>'")
    assert response.headers["www-authenticate"] == 'Bearer realm="dss"'


def test_an_unknown_or_revoked_key_is_401_and_a_new_key_works_at_once(service: Service) -> None:
    bad = service.call("GET", "/v1/sessions", who=None, headers={"Authorization": "Bearer dss_000000000000_nope"})
    expect_problem(bad, "Unauthorized", 401, "unknown API key")
    key, entry = add_key(service.config.keys_file, "t3")
    assert service.http.get("/v1/sessions", headers={"Authorization": f"Bearer {key}"}).json() == []
    from dss.service.apikeys import remove_key

    remove_key(service.config.keys_file, entry.key_id)
    gone = service.http.get("/v1/sessions", headers={"Authorization": f"Bearer {key}"})
    expect_problem(gone, "Unauthorized", 401, "unknown API key")


def test_unknown_paths_wrong_methods_and_malformed_bodies(service: Service) -> None:
    expect_problem(service.call("GET", "/v1/nope"), "NotFound", 404, "no endpoint GET /v1/nope")
    expect_problem(service.call("GET", "/nope", who=None), "NotFound", 404, "no endpoint GET /nope")
    expect_problem(service.call("PUT", "/v1/commit"), "MethodNotAllowed", 405, "/v1/commit does not answer PUT")
    bad_json = service.call("POST", "/v1/commit", content=b"{", headers={"content-type": "application/json"})
    expect_problem(bad_json, "InvalidInput", 400, "invalid request: body.1: JSON decode error")
    text = service.call("POST", "/v1/commit", content=b"hello", headers={"content-type": "text/plain"})
    assert (text.status_code, text.json()["kind"]) == (400, "InvalidInput")
    missing = service.call("POST", "/v1/commit", json={"tokens": [1]})
    expect_problem(missing, "InvalidInput", 400, "invalid request: body.session_id: Field required")
    extra = service.call("POST", "/v1/commit", json={"session_id": "s", "tokens": [1], "colour": 1})
    expect_problem(extra, "InvalidInput", 400, "invalid request: body.colour: Extra inputs are not permitted")


def test_bodies_over_the_limit_are_413_before_anything_runs(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", max_body_bytes=4096)
    with svc.http:
        svc.create()
        big = {"session_id": "s", "tokens": [1] * 3000}
        expect_problem(
            svc.call("POST", "/v1/commit", json=big),
            "PayloadTooLarge",
            413,
            "request bodies are limited to 4096 bytes (max_body_bytes)",
        )

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
            yield b'{"session_id": "s", "tokens": ['
            for _ in range(2000):
                yield b"1, "
            yield b"1]}"

        streamed = svc.call("POST", "/v1/commit", content=chunks(), headers={"content-type": "application/json"})
        expect_problem(streamed, "PayloadTooLarge", 413, "request bodies are limited to 4096 bytes (max_body_bytes)")
        assert svc.ok("GET", "/v1/versions", params={"session_id": "s"}) == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/commit", b'{"session_id": "s", "tokens": [1], "label": "\\ud800"}'),
        ("/v1/sessions", b'{"session_id": "s", "user_id": "\\ud800", "layout": {"name": "x", "page_tokens": 1}}'),
        ("/v1/sessions", b'{"session_id": "s", "layout": {"name": "x", "page_tokens": 1, "dtype": "\\udfff"}}'),
        ("/v1/sql", b'{"query": "SELECT :p", "params": {"p": "\\ud800"}}'),
    ],
)
def test_text_that_is_not_unicode_is_400_not_500(service: Service, path: str, body: bytes) -> None:
    """JSON can escape a lone surrogate; no catalog can store one and no response can carry it."""
    response = service.call("POST", path, "admin", content=body, headers={"content-type": "application/json"})
    expect_problem(
        response,
        "InvalidInput",
        400,
        "invalid request: body: Value error, text must be valid Unicode (no lone surrogates)",
    )
    assert service.store.sessions() == []


def test_an_unexpected_failure_is_a_500_problem_without_internals(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kw: Any) -> None:
        raise RuntimeError("disk on fire at /secret/path")

    monkeypatch.setattr(service.store, "versions", broken)
    http = TestClient(service.app, raise_server_exceptions=False)
    response = http.get(
        "/v1/versions", params={"session_id": "s"}, headers={"Authorization": f"Bearer {service.keys['t1']}"}
    )
    expect_problem(response, "InternalError", 500, "the service failed on its own; see its log")


# -- sessions ----------------------------------------------------------------------------------


def test_create_session_is_idempotent_and_returns_the_session(service: Service) -> None:
    body = service.create()
    stored = service.store.session("s", tenant_id="t1")
    assert body == {
        "session_id": "s",
        "tenant_id": "t1",
        "user_id": "u",
        "layout": LAYOUT_JSON,
        "head_id": None,
        "num_versions": 0,
        "created_at": body["created_at"],
        "last_access": body["last_access"],
    }
    assert when(body["created_at"]) == stored.created_at
    assert service.create() == body
    conflict = service.call("POST", "/v1/sessions", json={"session_id": "s", "user_id": "other", "layout": LAYOUT_JSON})
    expect_problem(conflict, "SessionExists", 409, "session 's' exists in tenant 't1' with another owner or layout")


@pytest.mark.parametrize(
    ("body", "kind", "detail"),
    [
        (
            {"session_id": "~x", "layout": LAYOUT_JSON},
            "InvalidInput",
            "session ids starting with '~' are reserved for dss",
        ),
        (
            {"session_id": "", "layout": LAYOUT_JSON},
            "InvalidInput",
            "session_id must be a printable string of 1 to 256 characters, got ''",
        ),
        (
            {"session_id": "s", "user_id": "a\nb", "layout": LAYOUT_JSON},
            "InvalidInput",
            "user_id must be a printable string of 1 to 256 characters, got 'a\\nb'",
        ),
        (
            {"session_id": "s", "layout": {**LAYOUT_JSON, "page_tokens": 0}},
            "InvalidLayout",
            "layout page_tokens must be an integer in [1, 65536], got 0",
        ),
        (
            {"session_id": "s", "layout": {**LAYOUT_JSON, "dtype": [1]}},
            "InvalidLayout",
            "layout field 'dtype' must be str, int, float or bool, got list",
        ),
    ],
)
def test_create_session_refuses_bad_input(service: Service, body: dict[str, Any], kind: str, detail: str) -> None:
    expect_problem(service.call("POST", "/v1/sessions", json=body), kind, 400, detail)
    assert service.store.sessions() == []


def test_create_session_in_another_tenant_is_403_even_for_admin(service: Service) -> None:
    body = {"session_id": "s", "layout": LAYOUT_JSON, "tenant_id": "t2"}
    expect_problem(
        service.call("POST", "/v1/sessions", json=body),
        "Forbidden",
        403,
        "writes go to the API key's own tenant 't1', not 't2'",
    )
    expect_problem(
        service.call("POST", "/v1/sessions", "admin", json=body),
        "Forbidden",
        403,
        "writes go to the API key's own tenant 't1', not 't2'",
    )
    assert service.ok("POST", "/v1/sessions", json={**body, "tenant_id": "t1"})["tenant_id"] == "t1"


def test_get_list_and_delete_sessions(service: Service) -> None:
    service.create("a", user_id="u1")
    service.create("b", user_id="u2")
    service.create("c", who="t2")
    service.commit(T, "a", pages={0: page(1), 1: page(2)})
    got = service.ok("GET", "/v1/session", params={"session_id": "a"})
    assert (got["session_id"], got["head_id"], got["num_versions"]) == ("a", 1, 1)
    assert [s["session_id"] for s in service.ok("GET", "/v1/sessions")] == ["a", "b"]
    assert [s["session_id"] for s in service.ok("GET", "/v1/sessions", params={"user_id": "u2"})] == ["b"]
    assert [s["session_id"] for s in service.ok("GET", "/v1/sessions", "t2")] == ["c"]
    everyone = service.ok("GET", "/v1/sessions", "admin", params={"all_tenants": "true"})
    assert [(s["tenant_id"], s["session_id"]) for s in everyone] == [("t1", "a"), ("t1", "b"), ("t2", "c")]
    assert [s["session_id"] for s in service.ok("GET", "/v1/sessions", "admin", params={"tenant_id": "t2"})] == ["c"]
    expect_problem(
        service.call("GET", "/v1/sessions", params={"all_tenants": "true"}),
        "Forbidden",
        403,
        "listing every tenant's sessions needs an admin API key",
    )
    expect_problem(
        service.call("GET", "/v1/sessions", params={"tenant_id": "t2"}),
        "Forbidden",
        403,
        "this API key may read only its own tenant 't1'",
    )
    assert service.ok("DELETE", "/v1/session", params={"session_id": "a"}) == {
        "session_id": "a",
        "num_pages_released": 2,
    }
    expect_problem(
        service.call("DELETE", "/v1/session", params={"session_id": "a"}),
        "UnknownSession",
        404,
        "no session 'a' in tenant 't1'",
    )
    expect_problem(
        service.call("GET", "/v1/session", params={"session_id": "a"}),
        "UnknownSession",
        404,
        "no session 'a' in tenant 't1'",
    )
    expect_problem(
        service.call("GET", "/v1/session"), "InvalidInput", 400, "invalid request: query.session_id: Field required"
    )
    assert service.store.check() == []


# -- versions ----------------------------------------------------------------------------------


def test_commit_returns_the_new_head_and_stores_pages(service: Service) -> None:
    service.create()
    v1 = service.commit(T, pages={0: page(1), 1: page(2)}, label="turn 1")
    assert v1 == {
        "version_id": 1,
        "session_id": "s",
        "parent_id": None,
        "num_tokens": 10,
        "created_at": v1["created_at"],
        "label": "turn 1",
        "is_head": True,
        "is_pinned": False,
    }
    v2 = service.commit(T + [1, 2])
    assert (v2["version_id"], v2["parent_id"], v2["num_tokens"], v2["label"]) == (2, 1, 12, None)
    stored = service.store.versions("s", tenant_id="t1")
    assert [when(v["created_at"]) for v in (v1, v2)] == [v.created_at for v in stored]
    assert service.store.read_pages(service.store.resume("s", T, tenant_id="t1").pages) == [page(1), page(2)]


@pytest.mark.parametrize(
    ("body", "kind", "detail"),
    [
        ({"tokens": []}, "InvalidTokens", "commit needs at least one token"),
        (
            {"tokens": [1, -1]},
            "InvalidTokens",
            "invalid request: body.tokens.1: Input should be greater than or equal to 0",
        ),
        (
            {"tokens": [2**32]},
            "InvalidTokens",
            "invalid request: body.tokens.0: Input should be less than or equal to 4294967295",
        ),
        ({"tokens": ["1"]}, "InvalidTokens", "invalid request: body.tokens.0: Input should be a valid integer"),
        ({"tokens": [1.5]}, "InvalidTokens", "invalid request: body.tokens.0: Input should be a valid integer"),
        ({"tokens": T, "pages": {"0": "!!"}}, "InvalidPage", "page 0 is not valid base64"),
        ({"tokens": T, "pages": {"0": b64(b"abc")}}, "InvalidPage", "page 0 has 3 bytes; layout 'test' pages have 16"),
        (
            {"tokens": T, "pages": {"2": b64(page(1))}},
            "InvalidPage",
            "page index 2 is out of range: 10 tokens hold 2 full pages of 4 tokens",
        ),
        (
            {"tokens": T, "pages": {"x": b64(page(1))}},
            "InvalidInput",
            (
                "invalid request: body.pages.x.[key]: a page index is a decimal integer from 0, without sign, spaces or "
                "leading zeros, got 'x'"
            ),
        ),
        (
            {"tokens": T, "label": "x" * 257},
            "InvalidInput",
            f"label must be a string of at most 256 characters, got {'x' * 257!r}",
        ),
    ],
)
def test_commit_refuses_bad_input_and_changes_nothing(
    service: Service, body: dict[str, Any], kind: str, detail: str
) -> None:
    service.create()
    expect_problem(service.call("POST", "/v1/commit", json={"session_id": "s", **body}), kind, 400, detail)
    assert service.store.versions("s", tenant_id="t1") == []


def test_commit_to_an_unknown_session_is_404(service: Service) -> None:
    expect_problem(
        service.call("POST", "/v1/commit", json={"session_id": "nope", "tokens": [1]}),
        "UnknownSession",
        404,
        "no session 'nope' in tenant 't1'",
    )


def test_token_count_is_bounded_by_config(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", max_tokens=8)
    with svc.http:
        svc.create()
        for path in ("/v1/commit", "/v1/resume"):
            expect_problem(
                svc.call("POST", path, json={"session_id": "s", "tokens": list(range(9))}),
                "InvalidTokens",
                400,
                "a request may carry at most 8 tokens (max_tokens), got 9",
            )
        assert svc.commit(list(range(8)))["num_tokens"] == 8


def test_versions_and_tokens(service: Service) -> None:
    service.create()
    service.create("other")
    service.commit(T)
    service.commit(T + [7])
    service.commit([5], "other")
    versions = service.ok("GET", "/v1/versions", params={"session_id": "s"})
    assert [(v["version_id"], v["parent_id"], v["num_tokens"], v["is_head"]) for v in versions] == [
        (1, None, 10, False),
        (2, 1, 11, True),
    ]
    assert service.ok("GET", "/v1/tokens", params={"session_id": "s"}) == {
        "session_id": "s",
        "version_id": 2,
        "tokens": T + [7],
    }
    assert service.ok("GET", "/v1/tokens", params={"session_id": "s", "version_id": 1}) == {
        "session_id": "s",
        "version_id": 1,
        "tokens": T,
    }
    expect_problem(
        service.call("GET", "/v1/tokens", params={"session_id": "s", "version_id": 3}),
        "UnknownVersion",
        404,
        "version 3 is not a version of session 's'",
    )
    expect_problem(
        service.call("GET", "/v1/tokens", params={"session_id": "s", "version_id": "x"}),
        "InvalidInput",
        400,
        "invalid request: query.version_id: Input should be a valid integer, unable to parse string as an integer",
    )
    service.create("empty")
    assert service.ok("GET", "/v1/tokens", params={"session_id": "empty"}) == {
        "session_id": "empty",
        "version_id": None,
        "tokens": [],
    }
    expect_problem(
        service.call("GET", "/v1/versions", params={"session_id": "nope"}),
        "UnknownSession",
        404,
        "no session 'nope' in tenant 't1'",
    )


def test_rollback_moves_the_head_and_the_next_commit_branches_from_it(service: Service) -> None:
    service.create()
    service.commit(T)
    service.commit(T + [1, 2])
    head = service.ok("POST", "/v1/rollback", json={"session_id": "s", "version_id": 1})
    assert (head["version_id"], head["is_head"]) == (1, True)
    v3 = service.commit(T + [9])
    assert (v3["version_id"], v3["parent_id"]) == (3, 1)
    expect_problem(
        service.call("POST", "/v1/rollback", json={"session_id": "s", "version_id": 99}),
        "UnknownVersion",
        404,
        "version 99 is not a version of session 's'",
    )
    expect_problem(
        service.call("POST", "/v1/rollback", json={"session_id": "s", "version_id": "1"}),
        "InvalidInput",
        400,
        "invalid request: body.version_id: Input should be a valid integer",
    )
    assert service.store.session("s", tenant_id="t1").head_id == 3


def test_branch_starts_a_new_session_sharing_pages(service: Service) -> None:
    service.create()
    service.commit(T, pages={0: page(1), 1: page(2)})
    b = service.ok(
        "POST",
        "/v1/branch",
        status=201,
        json={"session_id": "s", "version_id": 1, "new_session_id": "b", "label": "fork"},
    )
    assert (b["session_id"], b["tenant_id"], b["user_id"], b["head_id"], b["num_versions"]) == ("b", "t1", "u", 2, 1)
    assert service.ok("POST", "/v1/resume", json={"session_id": "b", "tokens": T})["matched_tokens"] == 8
    expect_problem(
        service.call("POST", "/v1/branch", json={"session_id": "s", "version_id": 1, "new_session_id": "b"}),
        "SessionExists",
        409,
        "session 'b' already exists in tenant 't1'",
    )
    expect_problem(
        service.call("POST", "/v1/branch", json={"session_id": "s", "version_id": 1, "new_session_id": "~b"}),
        "InvalidInput",
        400,
        "session ids starting with '~' are reserved for dss",
    )
    expect_problem(
        service.call("POST", "/v1/branch", json={"session_id": "s", "version_id": 7, "new_session_id": "c"}),
        "UnknownVersion",
        404,
        "version 7 is not a version of session 's'",
    )


def test_pin_and_unpin(service: Service) -> None:
    service.create()
    service.commit(T)
    assert service.ok("POST", "/v1/pin", json={"session_id": "s", "version_id": 1})["is_pinned"] is True
    assert service.store.versions("s", tenant_id="t1")[0].is_pinned is True
    assert (
        service.ok("POST", "/v1/pin", json={"session_id": "s", "version_id": 1, "pinned": False})["is_pinned"] is False
    )
    expect_problem(
        service.call("POST", "/v1/pin", json={"session_id": "s", "version_id": 2}),
        "UnknownVersion",
        404,
        "version 2 is not a version of session 's'",
    )


# -- resume and pages --------------------------------------------------------------------------


def test_resume_reports_matched_tokens_tiers_version_and_pages(service: Service) -> None:
    service.create()
    service.commit(T, pages={0: page(1), 1: page(2)})
    r = service.ok("POST", "/v1/resume", json={"session_id": "s", "tokens": T + [1, 2, 3]})
    expected = service.store.resume("s", T + [1, 2, 3], tenant_id="t1")
    assert r == {
        "session_id": "s",
        "version_id": 1,
        "matched_tokens": 8,
        "num_prompt_tokens": 13,
        "num_history_tokens": 10,
        "num_new_tokens": 5,
        "page_tokens": 4,
        "page_bytes": 16,
        "tiers": {"host": 8},
        "load_seconds": expected.load_seconds,
        "recompute_seconds": expected.recompute_seconds,
        "should_load": True,
        "pages": [
            {"index": 0, "page_id": expected.pages[0].page_id.hex(), "tier": "host"},
            {"index": 1, "page_id": expected.pages[1].page_id.hex(), "tier": "host"},
        ],
        "source": "session",
        "num_candidates": 0,
        "near": None,
        "encodings": {},
        "lossy_tokens": 0,
    }
    miss = service.ok("POST", "/v1/resume", json={"session_id": "s", "tokens": [1, 2, 3, 4, 5]})
    assert (miss["matched_tokens"], miss["version_id"], miss["pages"], miss["tiers"]) == (0, None, [], {})
    expect_problem(
        service.call("POST", "/v1/resume", json={"session_id": "x", "tokens": T}),
        "UnknownSession",
        404,
        "no session 'x' in tenant 't1'",
    )


def test_explain_and_nearest_over_http(service: Service) -> None:
    """A prompt with token 5 changed: explain names position 5 and the pages it costs; the
    search stays in the key's tenant (t1's versions are never a candidate for t2)."""
    tokens = list(range(100, 400))  # long enough that one changed token leaves the Jaccard near 0.97: always proposed
    service.create()
    service.commit(tokens, pages={k: page(k + 1) for k in range(10)})
    prompt = tokens[:5] + [7] + tokens[6:]
    why = service.ok("POST", "/v1/explain", json={"session_id": "s", "tokens": prompt, "context": 2})
    assert (why["divergence"], why["matched_tokens"], why["would_reuse_tokens"], why["lost_tokens"]) == (5, 4, 40, 36)
    assert (why["prompt_window"], why["stored_window"], why["recurring"]) == (
        [103, 104, 7, 106],
        [103, 104, 105, 106],
        [[5, 1]],
    )
    found = service.ok("POST", "/v1/nearest", json={"tokens": prompt, "user_id": "u", "layout": LAYOUT_JSON})
    assert [(c["session_id"], c["common_prefix"], c["divergence"]) for c in found["candidates"]] == [("s", 5, 5)]
    other = service.ok("POST", "/v1/nearest", json={"tokens": prompt, "user_id": "u", "layout": LAYOUT_JSON}, who="t2")
    assert other == {"candidates": []}
    expect_problem(
        service.call("POST", "/v1/nearest", json={"tokens": prompt, "k": 0, "session_id": "s"}),
        "InvalidInput",
        400,
        "k must be an int from 1 to 100, got 0",
    )


def test_save_pages_then_lookup_without_a_session(service: Service) -> None:
    body = {"session_id": None, "tokens": T, "pages": {"0": b64(page(3))}, "user_id": "u", "layout": LAYOUT_JSON}
    saved = service.ok("POST", "/v1/pages", json=body)
    assert saved["num_new_pages"] == 1
    assert service.ok("POST", "/v1/pages", json=body) == {**saved, "num_new_pages": 0}
    found = service.ok("POST", "/v1/lookup", json={"tokens": T, "layout": LAYOUT_JSON, "user_id": "u"})
    assert (found["session_id"], found["matched_tokens"], found["tiers"]) == (None, 4, {"host": 4})
    assert saved["page_ids"] == {"0": found["pages"][0]["page_id"]}
    other = service.ok("POST", "/v1/lookup", json={"tokens": T, "layout": LAYOUT_JSON, "user_id": "v"})
    assert other["matched_tokens"] == 0
    expect_problem(
        service.call("POST", "/v1/pages", json={**body, "layout": None}),
        "InvalidInput",
        400,
        "save_pages without a session needs tenant_id, user_id and layout",
    )
    payloads = service.ok("POST", "/v1/pages/read", json={"page_ids": [p["page_id"] for p in found["pages"]]})
    assert payloads == {"pages": [b64(page(3))]}


def test_save_pages_into_a_session_before_its_commit(service: Service) -> None:
    service.create()
    body = {"session_id": "s", "tokens": T, "pages": {"0": b64(page(1)), "1": b64(page(2))}}
    saved = service.ok("POST", "/v1/pages", json=body)
    assert saved["num_new_pages"] == 2
    r = service.ok("POST", "/v1/resume", json={"session_id": "s", "tokens": T})
    assert r["matched_tokens"] == 8
    assert saved["page_ids"] == {str(p["index"]): p["page_id"] for p in r["pages"]}
    expect_problem(
        service.call("POST", "/v1/pages", json={**body, "pages": {"0": b64(b"x")}}),
        "InvalidPage",
        400,
        "page 0 has 1 bytes; layout 'test' pages have 16",
    )


def test_read_pages_returns_payloads_and_null_for_unknown_ids(service: Service) -> None:
    service.create()
    service.commit(T, pages={0: page(1), 1: page(2)})
    ids = [p.page_id.hex() for p in service.store.resume("s", T, tenant_id="t1").pages]
    got = service.ok("POST", "/v1/pages/read", json={"page_ids": [ids[1], "00" * 16, ids[0]]})
    assert got == {"pages": [b64(page(2)), None, b64(page(1))]}
    assert service.ok("POST", "/v1/pages/read", json={"page_ids": []}) == {"pages": []}
    bad = service.call("POST", "/v1/pages/read", json={"page_ids": ["xyz"]})
    assert (bad.status_code, bad.json()["kind"]) == (400, "InvalidInput")


def test_read_pages_is_bounded_by_the_body_limit(tmp_path: Path) -> None:
    svc = Service(tmp_path / "home", max_body_bytes=4096)
    big = dss.Layout(name="big", page_tokens=1, page_bytes=1024)
    with svc.http:
        svc.store.create_session("s", user_id="u", tenant_id="t1", layout=big)
        svc.store.commit("s", [1, 2, 3, 4, 5], {i: bytes([i]) * 1024 for i in range(5)})
        ids = [p.page_id.hex() for p in svc.store.resume("s", [1, 2, 3, 4, 5], tenant_id="t1").pages]
        expect_problem(
            svc.call("POST", "/v1/pages/read", json={"page_ids": ids}),
            "PayloadTooLarge",
            413,
            "the pages asked for hold 5120 bytes; read at most 4096 bytes per request",
        )
        four = svc.ok("POST", "/v1/pages/read", json={"page_ids": ids[:4] + ids[:4]})["pages"]
        assert four == [b64(bytes([i]) * 1024) for i in range(4)] * 2


# -- admin endpoints ---------------------------------------------------------------------------


def test_sql_needs_an_admin_key_and_refuses_writes(service: Service) -> None:
    service.create()
    query = {"query": "SELECT num_versions, tenant_id FROM session_summary"}
    assert service.ok("POST", "/v1/sql", "admin", json=query) == {
        "columns": ["num_versions", "tenant_id"],
        "rows": [[0, "t1"]],
    }
    expect_problem(service.call("POST", "/v1/sql", json=query), "Forbidden", 403, "SQL needs an admin API key")
    write = service.call("POST", "/v1/sql", "admin", json={"query": "DELETE FROM sessions"})
    assert (write.status_code, write.json()["kind"]) == (403, "ReadOnlyViolation")
    broken = service.call("POST", "/v1/sql", "admin", json={"query": "SELEC 1"})
    assert (broken.status_code, broken.json()["kind"]) == (400, "SqlError")
    assert len(service.store.sessions()) == 1


def test_sql_checks_the_key_before_it_reads_the_body(service: Service) -> None:
    """A non-admin key learns nothing from the body it sent: garbage, a wrong shape or a valid
    query all get the same 403; the admin key gets the body's own error."""
    garbage = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    for body in (
        garbage,
        {"content": b"\xff\xfe", "headers": {"content-type": "text/plain"}},
        {"json": {"query": 5}},
        {"json": ["SELECT 1"]},
        {"json": {"query": "SELECT 1"}},
    ):
        expect_problem(service.call("POST", "/v1/sql", "t1", **body), "Forbidden", 403, "SQL needs an admin API key")
    broken = service.call("POST", "/v1/sql", "admin", **garbage)
    expect_problem(broken, "InvalidInput", 400, "invalid request: body.1: JSON decode error")
    shape = service.call("POST", "/v1/sql", "admin", json={"query": 5})
    assert (shape.status_code, shape.json()["kind"]) == (400, "InvalidInput")
    assert service.ok("POST", "/v1/sql", "admin", json={"query": "SELECT 1 AS one"}) == {
        "columns": ["one"],
        "rows": [[1]],
    }


def test_sql_cells_json_cannot_carry_are_tagged(service: Service) -> None:
    out = service.ok(
        "POST",
        "/v1/sql",
        "admin",
        json={
            "query": "SELECT x'00ff' AS b, 1e999 AS f, 1.5 AS g, NULL AS n, :p AS p, :q AS q",
            "params": {"p": "text", "q": 2},
            "max_rows": 1,
        },
    )
    assert out == {
        "columns": ["b", "f", "g", "n", "p", "q"],
        "rows": [[{"type": "bytes", "value": "AP8="}, {"type": "float", "value": "inf"}, 1.5, None, "text", 2]],
    }
    big = service.ok("POST", "/v1/sql", "admin", json={"query": "SELECT :p AS p", "params": {"p": 2**63}})
    assert big == {"columns": ["p"], "rows": [[float(2**63)]]}  # past int64: bound as a float, as SQLite would
    nested = service.call("POST", "/v1/sql", "admin", json={"query": "SELECT :p", "params": {"p": [1]}})
    assert (nested.status_code, nested.json()["kind"]) == (400, "InvalidInput")


def test_sql_answers_every_attack_with_its_4xx_and_changes_nothing(tmp_path: Path, catalog_url: str | None) -> None:
    # no mover thread: every 5 s it rewrites its tier_policy row (updated_at), which is not the attacks' doing
    svc = Service(tmp_path / "home", catalog_url=catalog_url, store_options={"mover": False})
    with svc.http:
        svc.create()
        svc.commit(T, pages={0: page(1), 1: page(2)})
        svc.ok("POST", "/v1/sql", "admin", json={"query": "SELECT 1 AS warm"})  # the PostgreSQL role exists now
        before = snapshot(svc.store)
        wrong = []
        for text, on_sqlite, on_pg in ATTACKS:
            expected = on_sqlite if catalog_url is None else on_pg
            body = json.dumps({"query": text.format(marker=tmp_path / "marker") if "{marker}" in text else text})
            answer = svc.call("POST", "/v1/sql", "admin", content=body, headers={"content-type": "application/json"})
            kind = answer.json().get("kind") if answer.headers["content-type"] == "application/problem+json" else None
            name = "InvalidInput" if "\ud800" in text else expected.__name__  # the API refuses it before the store
            if (answer.status_code, kind) != (expected.status, name):
                wrong.append((text, expected.__name__, answer.status_code, answer.text[:200]))
        assert wrong == []
        assert snapshot(svc.store) == before
        assert not (tmp_path / "marker").exists()
        assert svc.store.check() == []


def admin_only_endpoints() -> set[tuple[str, str]]:
    """The HTTP API page's list of admin-only endpoints: ``{(method, path)}``."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    paragraph = page.split("**Admin-only endpoints.**", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[\w/.]*)`", paragraph))


def test_exactly_the_documented_endpoints_need_an_admin_key(service: Service) -> None:
    """Every route of the app (a new one is walked automatically), asked by a non-admin key with an
    empty body and no parameters: exactly the documented admin-only endpoints answer "needs an admin
    API key", and the admin key is refused by none."""
    routes = sorted(
        {
            (method, route.path)
            for route in service.app.routes
            for method in getattr(route, "methods", None) or ()
            if method != "HEAD"
        }
    )
    assert {path for _, path in routes} >= set(service.app.openapi()["paths"])

    def refused_for_admin(who: str) -> set[tuple[str, str]]:
        out = set()
        for method, path in routes:
            answer = service.call(method, path, who, **({"json": {}} if method in ("POST", "PUT", "PATCH") else {}))
            is_problem = answer.headers.get("content-type") == "application/problem+json"
            if is_problem and answer.status_code == 403 and answer.json()["detail"].endswith("needs an admin API key"):
                out.add((method, path))
        return out

    assert refused_for_admin("t1") == admin_only_endpoints()
    assert ("POST", "/v1/forget_user") in admin_only_endpoints()
    assert refused_for_admin("admin") == set()
    assert service.store.sessions() == [] and service.store.audit() == []


def test_check_and_stats_need_an_admin_key(service: Service) -> None:
    service.create()
    service.commit(T, pages={0: page(1)})
    assert service.ok("GET", "/v1/check", "admin") == {"problems": []}
    stats = service.ok("GET", "/v1/stats", "admin")
    assert {k: stats["host"][k] for k in ("pages", "bytes", "capacity")} == {
        "pages": 1,
        "bytes": 16,
        "capacity": 1 << 30,
    }
    for path, what in (("/v1/check", "check"), ("/v1/stats", "stats")):
        expect_problem(service.call("GET", path), "Forbidden", 403, f"{what} needs an admin API key")


# -- erasure -----------------------------------------------------------------------------------


def test_forget_user_plans_erases_and_records_a_receipt(service: Service) -> None:
    service.create("a", user_id="gone")
    service.create("b", user_id="stays")
    service.commit(T, "a", pages={0: page(1), 1: page(2)})
    service.commit(T, "b", pages={0: page(3)})
    for body in ({"user_id": "gone", "tenant_id": "t1", "dry_run": True}, {"user_id": "gone", "tenant_id": "t1"}, {}):
        expect_problem(
            service.call("POST", "/v1/forget_user", json=body), "Forbidden", 403, "forget_user needs an admin API key"
        )
    assert len(service.store.sessions(tenant_id="t1")) == 2 and service.store.audit() == []
    plan = service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "gone", "tenant_id": "t1", "dry_run": True})
    assert (plan["tenant_id"], plan["user_id"], plan["sessions"], plan["versions"], plan["pages"]) == (
        "t1",
        "gone",
        1,
        1,
        2,
    )
    assert len(service.store.sessions(tenant_id="t1")) == 2  # a plan changes nothing
    receipt = service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "gone", "tenant_id": "t1"})
    assert (receipt["kind"], receipt["tenant_id"], receipt["user_id"], receipt["status"], receipt["key_destroyed"]) == (
        "forget-user",
        "t1",
        "gone",
        "verified",
        True,
    )
    assert receipt["removed"]["sessions"] == 1 and receipt["verification"]["ok"] is True
    expect_problem(
        service.call("GET", "/v1/session", params={"session_id": "a"}),
        "UnknownSession",
        404,
        "no session 'a' in tenant 't1'",
    )
    assert service.ok("GET", "/v1/session", params={"session_id": "b"})["head_id"] == 2
    [row] = service.ok("GET", "/v1/audit")
    assert (row["kind"], row["tenant_id"], row["user_id"], row["receipt"]) == ("forget-user", "t1", "gone", receipt)
    assert service.ok("GET", "/v1/audit", "t2") == []
    assert len(service.ok("GET", "/v1/audit", "admin", params={"all_tenants": "true"})) == 1
    expect_problem(
        service.call("GET", "/v1/audit", params={"all_tenants": "true"}),
        "Forbidden",
        403,
        "reading every tenant's audit needs an admin API key",
    )
    expect_problem(
        service.call("POST", "/v1/forget_user", "admin", json={"user_id": "x", "tenant_id": "t2"}),
        "Forbidden",
        403,
        "writes go to the API key's own tenant 't1', not 't2'",
    )
    expect_problem(
        service.call("POST", "/v1/forget_user", "admin", json={"user_id": "", "tenant_id": "t1"}),
        "InvalidInput",
        400,
        "user_id must be a printable string of 1 to 256 characters, got ''",
    )
    assert service.store.check() == []


def test_forget_user_names_its_tenant_in_the_body_and_nothing_in_the_query(service: Service) -> None:
    """The tenant is required in the body; a query parameter (``?tenant_id=``) is refused, not
    ignored; a key erases only in its own tenant; nothing was erased by any refused request."""
    service.create("a", user_id="gone")
    service.commit(T, "a", pages={0: page(1)})
    expect_problem(
        service.call("POST", "/v1/forget_user", "admin", json={"user_id": "gone"}),
        "InvalidInput",
        400,
        "invalid request: body.tenant_id: Field required",
    )
    expect_problem(
        service.call(
            "POST", "/v1/forget_user", "admin", params={"tenant_id": "t1"}, json={"user_id": "gone", "tenant_id": "t1"}
        ),
        "InvalidInput",
        400,
        "unknown query parameter 'tenant_id' for POST /v1/forget_user: it takes none",
    )
    expect_problem(
        service.call("POST", "/v1/forget_user", "admin", json={"user_id": "gone", "tenant_id": "t2"}),
        "Forbidden",
        403,
        "writes go to the API key's own tenant 't1', not 't2'",
    )
    expect_problem(
        service.call("GET", "/v1/sessions", "t1", params={"tenant": "t1"}),
        "InvalidInput",
        400,
        "unknown query parameter 'tenant' for GET /v1/sessions: it takes all_tenants, tenant_id, user_id",
    )
    assert service.store.audit() == [] and service.ok("GET", "/v1/session", params={"session_id": "a"})["head_id"] == 1
    plan = service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "gone", "tenant_id": "t2", "dry_run": True})
    assert (plan["tenant_id"], plan["user_known"], plan["sessions"]) == ("t2", False, 0)  # an admin may read t2


def test_forget_user_of_no_such_user_says_so_in_the_receipt_and_the_audit(service: Service) -> None:
    service.create("a", user_id="here")
    plan = service.ok(
        "POST", "/v1/forget_user", "admin", json={"user_id": "nobody", "tenant_id": "t1", "dry_run": True}
    )
    assert (plan["user_known"], plan["sessions"], plan["pages"]) == (False, 0, 0)
    receipt = service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "nobody", "tenant_id": "t1"})
    assert (receipt["status"], receipt["user_known"], receipt["key_destroyed"], "verification" in receipt) == (
        "no_such_user",
        False,
        False,
        False,
    )
    [row] = service.ok("GET", "/v1/audit")
    assert (row["user_id"], row["receipt"]["status"], row["receipt"]) == ("nobody", "no_such_user", receipt)
    assert [s["session_id"] for s in service.ok("GET", "/v1/sessions")] == ["a"]
    assert service.store.check() == []


NOT_AN_INDEX = "a page index is a decimal integer from 0, without sign, spaces or leading zeros"


@pytest.mark.parametrize("key", ["00", "01", "+1", " 1", "1 ", "1.0", "-0", "1_0", "1e0", "\u0661", "x"])
@pytest.mark.parametrize("path", ["/v1/commit", "/v1/pages"])
def test_a_page_key_that_is_not_a_canonical_index_is_refused_and_changes_nothing(
    service: Service, path: str, key: str
) -> None:
    """A key pydantic would read as an index ("00" and "+1" as 0 and 1) is refused as it is sent:
    with "0" beside it, "00" would replace page 0's payload without a word."""
    service.create()
    body = {"session_id": "s", "tokens": T, "pages": {"0": b64(page(1)), key: b64(page(2))}}
    expect_problem(
        service.call("POST", path, json=body),
        "InvalidInput",
        400,
        f"invalid request: body.pages.{key}.[key]: {NOT_AN_INDEX}, got {key!r}",
    )
    assert service.store.versions("s", tenant_id="t1") == []
    assert service.store.resume("s", T, tenant_id="t1").matched_tokens == 0
    assert service.store.check() == []


def test_canonical_page_keys_are_the_indexes(service: Service) -> None:
    service.create()
    body = {"session_id": "s", "tokens": T + T, "pages": {"0": b64(page(1)), "1": b64(page(2)), "3": b64(page(4))}}
    saved = service.ok("POST", "/v1/pages", json=body)
    assert (sorted(saved["page_ids"]), saved["num_new_pages"]) == (["0", "1", "3"], 3)
    expect_problem(
        service.call("POST", "/v1/commit", json={**body, "pages": {"10": b64(page(1))}}),
        "InvalidPage",
        400,
        "page index 10 is out of range: 20 tokens hold 5 full pages of 4 tokens",
    )
    expect_problem(
        service.call("POST", "/v1/commit", json={**body, "pages": {"9" * 30: b64(page(1))}}),
        "InvalidPage",
        400,
        f"page index {'9' * 30} is out of range: 20 tokens hold 5 full pages of 4 tokens",
    )
    service.commit(T + T)
    assert service.store.resume("s", T + T, tenant_id="t1").matched_tokens == 8
