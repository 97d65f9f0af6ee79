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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dss.core.config import StoreConfig
from dss.core.errors import DssError, InvalidInput, InvalidTokens, NotFound
from dss.core.version import VERSION
from dss.service import models as m
from dss.service.apikeys import KeyRing
from dss.service.config import ServerConfig
from dss.service.docs import add_docs
from dss.service.metrics import Metrics
from dss.service.middleware import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware, problem_response
from dss.service.problems import InternalError, MethodNotAllowed, error_class
from dss.service.routes import admin, engines, erasure, meta, pages, resume, sessions, versions
from dss.store import Store

log = logging.getLogger("dss.service.server")


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
    for tag in (meta, sessions, versions, pages, resume, engines, erasure, admin):
        app.include_router(tag.router)
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
