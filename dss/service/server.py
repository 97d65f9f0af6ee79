"""The dss service: the store's API over HTTP/JSON (FastAPI), run by ``dss serve`` (uvicorn).

:func:`create_app` builds the app on an open :class:`~dss.store.Store`; :func:`serve` opens
the store, serves until SIGTERM or SIGINT, lets in-flight requests finish (up to
``graceful_timeout_s``) and closes the store. A response is sent only after the store call
returned, so an acknowledged commit is durable: a ``kill -9`` of the service loses none.

Every ``/v1`` endpoint needs ``Authorization: Bearer <key>``; the key's tenant scopes the
request (see :mod:`dss.service.tenancy`). Errors are problem details (see :mod:`dss.service.problems`) with
the ``DssError`` kind and message; bad input is a 4xx, never a 500. The endpoints mirror the
:class:`~dss.store.Store` methods, one to one (see :mod:`dss.service.client`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio.to_thread
from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dss.core.config import StoreConfig
from dss.core.errors import DssError, ErasureIncomplete, InvalidInput, InvalidTokens, NotFound, StoreClosed
from dss.core.version import VERSION
from dss.erasure import AuditEntry, Plan, Receipt
from dss.service import models as m
from dss.service.apikeys import KeyRing, Principal
from dss.service.config import ServerConfig
from dss.service.docs import BEARER, add_docs
from dss.service.metrics import Metrics
from dss.service.middleware import PRINCIPAL, AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware, problem_response
from dss.service.problems import PROBLEM_MEDIA_TYPE, InternalError, MethodNotAllowed, error_class
from dss.service.tenancy import TenantScope
from dss.store import Store

log = logging.getLogger("dss.service.server")

_PROBLEM_CONTENT = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/ProblemOut"}}}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": _PROBLEM_CONTENT}
    for code, text in (
        (400, "Bad input (InvalidInput, InvalidTokens, InvalidPage, InvalidLayout, SqlError)"),
        (401, "Missing or unknown API key (Unauthorized)"),
        (403, "Not allowed for this key (Forbidden, ReadOnlyViolation)"),
        (404, "Not found, or another tenant's (UnknownSession, UnknownVersion)"),
        (409, "Conflict (SessionExists, ErasureInProgress)"),
        (413, "Request body too large (PayloadTooLarge)"),
        (503, "The store is closing or needs an upgrade (StoreClosed, SchemaOutdated)"),
    )
}


class Call(NamedTuple):
    """What a request handler needs: the store, the caller's scope, the limits, the metrics."""

    store: Store
    scope: TenantScope
    config: ServerConfig
    metrics: Metrics


def _call(request: Request, _key: Any = Security(BEARER)) -> Call:
    state = request.app.state
    principal: Principal = request.scope[PRINCIPAL]
    return Call(state.store, TenantScope(principal), state.config, state.metrics)


def _admin(what: str) -> Any:
    """A route dependency: the key must be an admin key (``Forbidden`` otherwise), checked before
    the request body is validated, so a non-admin key learns nothing from the endpoint."""

    def require_admin(request: Request) -> None:
        TenantScope(request.scope[PRINCIPAL]).require_admin(what)

    return Depends(require_admin)


def _admin_first(what: str) -> type[APIRoute]:
    """A route class whose handler checks for an admin key (``Forbidden`` otherwise) before it reads
    the request body: FastAPI parses a declared body before any dependency runs, so with
    :func:`_admin` alone a non-admin key would learn how its body was refused."""

    class AdminFirst(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handle = super().get_route_handler()

            async def admin_first(request: Request) -> Response:
                TenantScope(request.scope[PRINCIPAL]).require_admin(what)
                return await handle(request)

            return admin_first

    return AdminFirst


def _known_query(request: Request) -> None:
    """An app-wide dependency: a query parameter the route does not take is refused
    (``InvalidInput``, 400) instead of being ignored, so a misspelt or misplaced parameter
    (``?tenant_id=`` on a route that takes the tenant in its body) never goes unnoticed."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    known: set[str] = set()
    stack = [dependant]
    while stack:
        one = stack.pop()
        known.update(param.alias for param in one.query_params)
        stack.extend(one.dependencies)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise InvalidInput(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} for {request.method} {request.url.path}: {takes}"
        )


def _tokens(call: Call, tokens: list[int]) -> list[int]:
    if len(tokens) > call.config.max_tokens:
        raise InvalidTokens(
            f"a request may carry at most {call.config.max_tokens} tokens (max_tokens), got {len(tokens)}"
        )
    return tokens


def create_app(store: Store, config: ServerConfig, keys: KeyRing, *, close_store: bool = False) -> FastAPI:
    """The FastAPI app serving ``store``; it closes the store on shutdown when ``close_store``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = config.threads
        try:
            yield
        finally:
            if close_store:
                await anyio.to_thread.run_sync(store.close)
                log.info("store closed")

    app = FastAPI(
        title="dss",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(_known_query)],
        description="Dialogue state store: sessions, versions, resume, rollback and branch over HTTP.",
    )
    app.state.store = store
    app.state.config = config
    app.state.metrics = metrics = Metrics(store)
    _add_routes(app)
    add_docs(app)
    _add_error_handlers(app)
    _document_problems(app)
    routes = frozenset(getattr(r, "path", "") for r in app.routes)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(
        AuthMiddleware,
        keys=keys,
        protected=lambda path: path.startswith("/v1/") or (path == "/metrics" and not config.public_metrics),
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)
    return app


def _document_problems(app: FastAPI) -> None:
    """Errors are documented as problem details (``ProblemOut``); the 422 FastAPI documents is never sent."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = generate()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas["ProblemOut"] = m.ProblemOut.model_json_schema()
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for item in doc["paths"].values():
                for operation in item.values():
                    operation["responses"].pop("422", None)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI) -> None:
    async def dss_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, DssError)
        return problem_response(exc)

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = exc.errors()
        fields = {str(part) for e in errors for part in e.get("loc", ())}
        cls = InvalidTokens if "tokens" in fields else InvalidInput
        detail = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', 'invalid')}" for e in errors[:5])
        return problem_response(cls(f"invalid request: {detail}"))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return problem_response(NotFound(f"no endpoint {request.method} {request.url.path}"))
        if exc.status_code == 405:
            return problem_response(MethodNotAllowed(f"{request.url.path} does not answer {request.method}"))
        return problem_response(error_class("", exc.status_code)(str(exc.detail)))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unexpected %s answering %s %s", type(exc).__name__, request.method, request.url.path)
        return problem_response(InternalError("the service failed on its own; see its log"))

    app.add_exception_handler(DssError, dss_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)


def _add_routes(app: FastAPI) -> None:
    v1: dict[str, Any] = {"responses": _ERRORS}
    call_dep = Depends(_call)

    @app.get("/healthz", response_model=m.HealthOut, tags=["service"], responses={503: _ERRORS[503]})
    def healthz(request: Request) -> dict[str, Any]:
        """Liveness and readiness: 200 while the store is open, 503 once it is closing."""
        if request.app.state.store.is_closed:
            raise StoreClosed("this store is closed")
        return {"status": "ok", "version": VERSION}

    @app.get(
        "/metrics",
        tags=["service"],
        response_class=Response,
        dependencies=[Security(BEARER)],
        responses={
            200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
            401: _ERRORS[401],
            403: _ERRORS[403],
        },
    )
    def metrics(request: Request) -> Response:
        """Prometheus metrics (see :mod:`dss.service.metrics`); needs an admin key unless public_metrics."""
        if not request.app.state.config.public_metrics:
            TenantScope(request.scope[PRINCIPAL]).require_admin("/metrics")
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info", response_model=m.InfoOut, tags=["service"], **v1)
    def info(call: Call = call_dep) -> dict[str, Any]:
        """The caller's key (tenant, admin), the service's limits and the rates resume estimates use."""
        p = call.scope.principal
        return {
            "version": VERSION,
            "key_id": p.key_id,
            "tenant_id": p.tenant_id,
            "is_admin": p.is_admin,
            "limits": {"max_body_bytes": call.config.max_body_bytes, "max_tokens": call.config.max_tokens},
            "rates": m.rates_out(call.store.rates),
        }

    @app.post("/v1/sessions", response_model=m.SessionOut, tags=["sessions"], **v1)
    def create_session(body: m.CreateSessionIn, call: Call = call_dep) -> dict[str, Any]:
        """Create a session (idempotent for the same owner and layout: returns the existing one)."""
        tenant = call.scope.writing(body.tenant_id)
        return m.session_out(
            call.store.create_session(
                body.session_id, user_id=body.user_id, tenant_id=tenant, layout=m.layout_of(body.layout)
            )
        )

    @app.get("/v1/sessions", response_model=list[m.SessionOut], tags=["sessions"], **v1)
    def sessions(
        call: Call = call_dep, tenant_id: str | None = None, user_id: str | None = None, all_tenants: bool = False
    ) -> list[dict[str, Any]]:
        """The tenant's sessions (optionally one user's), oldest first; ``all_tenants`` needs an admin key."""
        if all_tenants:
            call.scope.require_admin("listing every tenant's sessions")
            tenant: str | None = None
        else:
            tenant = call.scope.reading(tenant_id)
        return [m.session_out(s) for s in call.store.sessions(tenant_id=tenant, user_id=user_id)]

    @app.get("/v1/session", response_model=m.SessionOut, tags=["sessions"], **v1)
    def session(session_id: str, tenant_id: str | None = None, call: Call = call_dep) -> dict[str, Any]:
        """One session: owner, layout, head and number of versions."""
        return m.session_out(call.store.session(session_id, tenant_id=call.scope.reading(tenant_id)))

    @app.delete("/v1/session", response_model=m.DeleteOut, tags=["sessions"], **v1)
    def delete_session(session_id: str, tenant_id: str | None = None, call: Call = call_dep) -> dict[str, Any]:
        """Delete a session and its versions; pages no other session holds are released."""
        released = call.store.delete_session(session_id, tenant_id=call.scope.writing(tenant_id))
        return {"session_id": session_id, "num_pages_released": released}

    @app.get("/v1/versions", response_model=list[m.VersionOut], tags=["versions"], **v1)
    def versions(session_id: str, tenant_id: str | None = None, call: Call = call_dep) -> list[dict[str, Any]]:
        """Every version of a session, oldest first (the head has ``is_head``)."""
        return [m.version_out(v) for v in call.store.versions(session_id, tenant_id=call.scope.reading(tenant_id))]

    @app.get("/v1/tokens", response_model=m.TokensOut, tags=["versions"], **v1)
    def tokens(
        session_id: str, version_id: int | None = Query(None), tenant_id: str | None = None, call: Call = call_dep
    ) -> dict[str, Any]:
        """The tokens of a version (default the head; empty if the session has none)."""
        tenant = call.scope.reading(tenant_id)
        if version_id is None:
            version_id = call.store.session(session_id, tenant_id=tenant).head_id
        out = call.store.tokens(session_id, version_id, tenant_id=tenant)
        return {"session_id": session_id, "version_id": version_id, "tokens": out}

    @app.post("/v1/commit", response_model=m.VersionOut, status_code=201, tags=["versions"], **v1)
    def commit(body: m.CommitIn, call: Call = call_dep) -> dict[str, Any]:
        """Record tokens (and optionally their full pages) as a new version, child of the head; it becomes
        the head. Answered only once durable."""
        tenant = call.scope.writing(body.tenant_id)
        pages = m.decode_pages(body.pages) if body.pages is not None else None
        version = call.store.commit(
            body.session_id, _tokens(call, body.tokens), pages, label=body.label, tenant_id=tenant
        )
        call.metrics.observe_commit(version.num_tokens)
        return m.version_out(version)

    @app.post("/v1/pages", response_model=m.SavePagesOut, tags=["pages"], **v1)
    def save_pages(body: m.SavePagesIn, call: Call = call_dep) -> dict[str, Any]:
        """Store pages of tokens ahead of the commit that will contain them (or, with no session, for the
        namespace (user_id, layout))."""
        tenant = call.scope.writing(body.tenant_id)
        layout = m.layout_of(body.layout) if body.layout is not None else None
        saved = call.store.save_pages(
            body.session_id,
            _tokens(call, body.tokens),
            m.decode_pages(body.pages),
            tenant_id=tenant,
            user_id=body.user_id,
            layout=layout,
        )
        return m.saved_out(saved)

    @app.post("/v1/pages/read", response_model=m.ReadPagesOut, tags=["pages"], **v1)
    def read_pages(body: m.ReadPagesIn, call: Call = call_dep) -> dict[str, Any]:
        """Payloads of pages by id (null for a page no tier holds, or one the key may not read, or one of
        another tenant than ``tenant_id``)."""
        ids = [bytes.fromhex(p) for p in body.page_ids]
        payloads = call.scope.read_pages(
            call.store, ids, call.config.max_body_bytes, tenant_id=body.tenant_id, load=body.load
        )
        return {"pages": [m.encode_page(p) for p in payloads]}

    @app.post("/v1/pages/sizes", response_model=m.PageSizesOut, tags=["pages"], **v1)
    def page_sizes(body: m.PageSizesIn, call: Call = call_dep) -> dict[str, Any]:
        """Sizes of the pages the catalog holds, of those the key may read (of ``tenant_id`` if named)."""
        ids = [bytes.fromhex(p) for p in body.page_ids]
        sizes = call.store.page_sizes(ids, tenant_id=call.scope.page_tenant(body.tenant_id))
        return {"sizes": {page_id.hex(): size for page_id, size in sizes.items()}}

    @app.post("/v1/prefixes", response_model=m.VersionOut, status_code=201, tags=["pages"], **v1)
    def register_prefix(body: m.RegisterPrefixIn, call: Call = call_dep) -> dict[str, Any]:
        """Share a prefix (a system prompt, tool definitions) with every user of the tenant: its pages
        belong to the tenant, are pinned and stay when a user is erased."""
        tenant = call.scope.writing(body.tenant_id)
        return m.version_out(
            call.store.register_prefix(
                _tokens(call, body.tokens),
                m.decode_pages(body.pages),
                layout=m.layout_of(body.layout),
                tenant_id=tenant,
                label=body.label,
            )
        )

    @app.get("/v1/prefixes", response_model=list[m.VersionOut], tags=["pages"], **v1)
    def shared_prefixes(tenant_id: str | None = None, call: Call = call_dep) -> list[dict[str, Any]]:
        """The tenant's shared prefixes (every layout), oldest first."""
        return [m.version_out(v) for v in call.store.shared_prefixes(tenant_id=call.scope.reading(tenant_id))]

    @app.post("/v1/resume", response_model=m.ResumeOut, tags=["resume"], **v1)
    def resume(body: m.ResumeIn, call: Call = call_dep) -> dict[str, Any]:
        """How many leading tokens of a prompt have stored KV, on which tiers, along which version."""
        tenant = call.scope.reading(body.tenant_id)
        prompt = _tokens(call, body.tokens)
        start = time.perf_counter()
        result = call.store.resume(body.session_id, prompt, tenant_id=tenant, approximate=body.approximate)
        call.metrics.observe_resume(result, time.perf_counter() - start)
        return m.resume_out(result)

    @app.post("/v1/lookup", response_model=m.ResumeOut, tags=["resume"], **v1)
    def lookup(body: m.LookupIn, call: Call = call_dep) -> dict[str, Any]:
        """Resume for a request without a session: exact lookup in the namespace (user_id, layout)."""
        tenant = call.scope.reading(body.tenant_id)
        prompt = _tokens(call, body.tokens)
        start = time.perf_counter()
        result = call.store.lookup(
            prompt,
            layout=m.layout_of(body.layout),
            user_id=body.user_id,
            tenant_id=tenant,
            approximate=body.approximate,
        )
        call.metrics.observe_resume(result, time.perf_counter() - start)
        return m.resume_out(result)

    @app.post("/v1/nearest", response_model=m.NearestOut, tags=["resume"], **v1)
    def nearest(body: m.NearestIn, call: Call = call_dep) -> dict[str, Any]:
        """Stored versions nearest a prompt (MinHash-LSH candidates verified token by token), in one
        namespace and layout: the session's, or (user_id, layout) of the tenant."""
        tenant = call.scope.reading(body.tenant_id)
        found = call.store.nearest(
            _tokens(call, body.tokens),
            session_id=body.session_id,
            tenant_id=tenant,
            user_id=body.user_id,
            layout=m.layout_of(body.layout) if body.layout is not None else None,
            k=body.k,
        )
        return {"candidates": [c._asdict() for c in found]}

    @app.post("/v1/explain", response_model=m.ExplainOut, tags=["resume"], **v1)
    def explain(body: m.ExplainIn, call: Call = call_dep) -> dict[str, Any]:
        """Why exact reuse of a prompt stops where it does: the first divergence from its nearest
        stored version, the tokens around it, the reuse it costs, the tenant's recurring positions."""
        tenant = call.scope.reading(body.tenant_id)
        why = call.store.explain(
            body.session_id,
            _tokens(call, body.tokens),
            tenant_id=tenant,
            user_id=body.user_id,
            layout=m.layout_of(body.layout) if body.layout is not None else None,
            context=body.context,
        )
        return m.explain_out(why)

    @app.post("/v1/rollback", response_model=m.VersionOut, tags=["versions"], **v1)
    def rollback(body: m.RollbackIn, call: Call = call_dep) -> dict[str, Any]:
        """Move the session's head back to a version (copies and deletes nothing)."""
        tenant = call.scope.writing(body.tenant_id)
        return m.version_out(call.store.rollback(body.session_id, body.version_id, tenant_id=tenant))

    @app.post("/v1/branch", response_model=m.SessionOut, status_code=201, tags=["versions"], **v1)
    def branch(body: m.BranchIn, call: Call = call_dep) -> dict[str, Any]:
        """Start a new session at a version of this one, sharing its pages."""
        tenant = call.scope.writing(body.tenant_id)
        return m.session_out(
            call.store.branch(body.session_id, body.version_id, body.new_session_id, tenant_id=tenant, label=body.label)
        )

    @app.post("/v1/pin", response_model=m.VersionOut, tags=["versions"], **v1)
    def pin(body: m.PinIn, call: Call = call_dep) -> dict[str, Any]:
        """Pin (or unpin) a version: eviction never drops the pages of a pinned version."""
        tenant = call.scope.writing(body.tenant_id)
        return m.version_out(call.store.pin(body.session_id, body.version_id, pinned=body.pinned, tenant_id=tenant))

    @app.post("/v1/prefetch", response_model=m.PrefetchOut, status_code=202, tags=["pages"], **v1)
    def prefetch(body: m.PrefetchIn, call: Call = call_dep) -> dict[str, Any]:
        """Move the pages of the session's head up to host in the background (call it when the user starts
        typing); answers at once with how many pages will move (``wait``: once they moved)."""
        tenant = call.scope.reading(body.tenant_id)
        moving = call.store.prefetch(body.session_id, tenant_id=tenant, wait=body.wait)
        return {"session_id": body.session_id, "num_pages": moving}

    @app.post("/v1/prefetch_candidates", response_model=m.PageIdsOut, tags=["pages"], **v1)
    def prefetch_candidates(body: m.PrefetchCandidatesIn, call: Call = call_dep) -> dict[str, Any]:
        """Ids of the pages the nearest near-duplicate lets a prompt reuse, longest first; with ``promote``
        they are read now (disk pages come into the host tier). Scope as /v1/nearest."""
        tenant = call.scope.reading(body.tenant_id)
        ids = call.store.prefetch_candidates(
            _tokens(call, body.tokens),
            session_id=body.session_id,
            tenant_id=tenant,
            user_id=body.user_id,
            layout=m.layout_of(body.layout) if body.layout is not None else None,
            promote=body.promote,
        )
        return {"page_ids": [page_id.hex() for page_id in ids]}

    @app.get("/v1/residency", response_model=m.ResidencyOut, tags=["engines"], **v1)
    def residency(session_id: str, tenant_id: str | None = None, call: Call = call_dep) -> dict[str, Any]:
        """How many pages of the session's head each live engine holds in its own KV memory."""
        engines = call.store.residency(session_id, tenant_id=call.scope.reading(tenant_id))
        return {"session_id": session_id, "engines": engines}

    @app.post(
        "/v1/engines/resident",
        response_model=m.EngineOut,
        tags=["engines"],
        dependencies=[_admin("reporting an engine's pages")],
        **v1,
    )
    def mark_resident(body: m.EnginePagesIn, call: Call = call_dep) -> dict[str, Any]:
        """An engine instance holds these pages in its own KV memory (the device tier); renews its lease.
        Admin key: an engine serves every tenant."""
        ids = [bytes.fromhex(p) for p in body.page_ids]
        call.store.mark_resident(body.engine_id, ids)
        return {"engine_id": body.engine_id, "num_pages": len(ids)}

    @app.post(
        "/v1/engines/evicted",
        response_model=m.EngineOut,
        tags=["engines"],
        dependencies=[_admin("reporting an engine's pages")],
        **v1,
    )
    def evicted(body: m.EnginePagesIn, call: Call = call_dep) -> dict[str, Any]:
        """An engine instance no longer holds these pages (it reused their memory). Admin key."""
        ids = [bytes.fromhex(p) for p in body.page_ids]
        call.store.evicted(body.engine_id, ids)
        return {"engine_id": body.engine_id, "num_pages": len(ids)}

    @app.post(
        "/v1/engines/forget",
        response_model=m.EngineOut,
        tags=["engines"],
        dependencies=[_admin("forgetting an engine")],
        **v1,
    )
    def forget_engine(body: m.EngineIn, call: Call = call_dep) -> dict[str, Any]:
        """An engine instance went away: forget the pages it held (answers how many). Admin key."""
        return {"engine_id": body.engine_id, "num_pages": call.store.forget_engine(body.engine_id)}

    @app.post(
        "/v1/forget_user",
        response_model=Receipt | Plan,
        response_model_exclude_none=True,
        tags=["erasure"],
        dependencies=[_admin("forget_user")],
        responses={
            **_ERRORS,
            500: {
                "description": "The erasure could not finish now (it stays open and may be "
                "retried), or verification failed for good (ErasureIncomplete)",
                "content": _PROBLEM_CONTENT,
            },
        },
    )
    def forget_user(body: m.ForgetUserIn, call: Call = call_dep) -> Receipt | Plan:
        """Erase every session, version, token and page of one user of the tenant named in the body
        (GDPR Art. 17), keys first; returns the receipt (``status``: ``verified``, or ``no_such_user`` when the
        tenant has no such user). ``dry_run`` returns the plan and changes nothing. Admin key (also for a dry
        run); the tenant is the key's own (a dry run may name another, as reads may)."""
        tenant = call.scope.reading(body.tenant_id) if body.dry_run else call.scope.writing(body.tenant_id)
        if body.dry_run:
            return call.store.forget_user(body.user_id, tenant_id=tenant, dry_run=True)
        try:
            receipt = call.store.forget_user(body.user_id, tenant_id=tenant)
        except ErasureIncomplete:
            call.metrics.observe_erasure(done=False)
            raise
        call.metrics.observe_erasure(done=True)
        return receipt

    @app.get("/v1/audit", response_model=list[AuditEntry], response_model_exclude_none=True, tags=["erasure"], **v1)
    def audit(call: Call = call_dep, tenant_id: str | None = None, all_tenants: bool = False) -> list[AuditEntry]:
        """Receipts of the tenant's erasures, oldest first; ``all_tenants`` needs an admin key."""
        if all_tenants:
            call.scope.require_admin("reading every tenant's audit")
            return call.store.audit()
        return call.store.audit(tenant_id=call.scope.reading(tenant_id))

    def sql(body: m.SqlIn, call: Call = call_dep) -> dict[str, Any]:
        """Run one read-only SQL statement on the catalog (admin key)."""
        return m.sql_out(call.store.sql(body.query, body.params, max_rows=body.max_rows))

    app.router.add_api_route(
        "/v1/sql",
        sql,
        methods=["POST"],
        response_model=m.SqlOut,
        tags=["admin"],
        route_class_override=_admin_first("SQL"),
        **v1,
    )

    @app.get("/v1/check", response_model=m.CheckOut, tags=["admin"], dependencies=[_admin("check")], **v1)
    def check(call: Call = call_dep) -> dict[str, Any]:
        """Every broken invariant of the store (empty when sound; admin key)."""
        return {"problems": call.store.check()}

    @app.get(
        "/v1/stats", response_model=dict[str, dict[str, Any]], tags=["admin"], dependencies=[_admin("stats")], **v1
    )
    def stats(call: Call = call_dep) -> dict[str, Any]:
        """The tiers: sizes, watermarks, what the placement policy did, prefetch counts (admin key)."""
        return call.store.stats()

    @app.get(
        "/v1/sessions/count",
        response_model=m.CountOut,
        tags=["admin"],
        dependencies=[_admin("counting every tenant's sessions")],
        **v1,
    )
    def count_sessions(call: Call = call_dep) -> dict[str, Any]:
        """The number of sessions in the store, every tenant's (admin key)."""
        return {"num_sessions": call.store.count_sessions()}

    @app.post("/v1/compact", response_model=m.CompactionOut, tags=["admin"], dependencies=[_admin("compact")], **v1)
    def compact(body: m.CompactIn, call: Call = call_dep) -> dict[str, Any]:
        """Rewrite the disk tier's sparse page files so their dead bytes are freed; ``dry_run`` says what it
        would do and changes nothing (admin key)."""
        return m.compaction_out(call.store.compact(dry_run=body.dry_run))

    @app.post(
        "/v1/mover", response_model=dict[str, int], tags=["admin"], dependencies=[_admin("running the mover")], **v1
    )
    def run_mover(call: Call = call_dep) -> dict[str, int]:
        """One pass of the mover now: the pages demoted from host and evicted from disk (admin key)."""
        return call.store.run_mover()


def serve(store_config: StoreConfig, config: ServerConfig) -> None:
    """Open the store, serve it until SIGTERM/SIGINT, finish in-flight requests, close the store.

    Raises ``ConfigError`` for a malformed keys file before anything listens.
    """
    import uvicorn

    keys = KeyRing(config.keys_file)
    if not len(keys):
        log.warning(
            "no API keys in %s: every /v1 request will be refused (run `dss keys add TENANT`)", config.keys_file
        )
    store = Store(store_config)
    app = create_app(store, config, keys, close_store=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.access_log,
            timeout_graceful_shutdown=config.graceful_timeout_s,
            server_header=False,
            lifespan="on",
        )
    )
    log.info("dss %s serving %s on %s", VERSION, store_config.home, config.url)
    server.run()
