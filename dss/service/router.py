"""``dss route``: an HTTP proxy in front of vLLM's OpenAI-compatible servers that sends each
session to the node holding its KV.

For every ``POST /v1/completions`` and ``POST /v1/chat/completions`` the proxy

1. reads the session from the ``X-Session-Id`` header (with ``X-Tenant-Id`` and ``X-User-Id``;
   the gateway in front sets them, clients cannot) or from the body's
   ``kv_transfer_params.dss`` (``session_id``, ``tenant_id``); a session given by header is
   written into the body's ``kv_transfer_params.dss`` when the body has none, so the engine's
   dss connector sees it;
2. asks :class:`~dss.service.backends.HoldingsSource` how many of the session's head pages each node holds, per tier;
3. picks a backend with :func:`dss.service.routing.route` (policy ``kv``, ``hash`` or
   ``round_robin``; requests without a session are keyed by their prompt's first characters, so
   a shared system prompt stays on one node);
4. forwards the request unchanged and streams the response back as it comes (server-sent
   events included), with ``X-Dss-Node`` and ``X-Dss-Route`` headers saying where it went.

A backend that refuses the connection or times out before answering is marked unhealthy and
the request goes to the next choice (failover); a background task checks every backend's
``/health`` every ``health_interval_s`` and brings it back when it answers. With no healthy
backend the proxy answers 503 ``NoBackend`` as problem details, like ``dss serve``.

Bodies: at most ``max_body_bytes`` (413 ``PayloadTooLarge`` as soon as a body passes it, by
its Content-Length or while it streams in; ``dss serve``'s own middleware), nesting at most
:data:`~dss.service.proxying.MAX_DEPTH` arrays and objects (400 ``InvalidInput``, the connection stays usable).

Failures once a response has begun cannot move to another node: the response is cut off (the
connection closes before the response's end, so the client sees an incomplete response, never
a clean end), the router logs one line naming the backend and the cause, and uvicorn's report
of the cut (a traceback) is filtered out. On SIGTERM the router stops accepting connections,
gives requests in flight ``graceful_timeout_s``, then cancels them: one still waiting for its
backend is answered 503 ``Unavailable`` with ``Connection: close``, one streaming is cut off;
one line each. The process then ends by the SIGTERM uvicorn deferred (status -15), as
``dss serve`` does. Metrics
(Prometheus, at ``/metrics``): ``dss_router_requests_total{node,reason,status}``,
``dss_router_request_seconds{node}``, ``dss_router_failovers_total{node}``,
``dss_router_backend_healthy{node}``, ``dss_router_in_flight{node}``,
``dss_router_holdings_errors_total``; no label carries a tenant, user or session id.

Holdings: the catalog says which pages of the head are stored and which node's disk holds
each (a backend's node id must be its store's ``node_id``); see :func:`~dss.service.backends.head_holdings`. The
node the router sent the session's last turn to counts them on its ``device`` tier too (the
engine computed or loaded them there, and keeps them while its own cache does). A failure to
ask the store is logged and counted, and the request is routed as if nothing were held.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dss.core.errors import DssError, NoBackend, Unavailable
from dss.service.backends import (
    BackendState,
    HoldingsSource,
    RouterConfig,
    RouterMetrics,
    RouterState,
    StoreHoldings,
    done,
    head_holdings,
    mark,
    parse_backends,
)
from dss.service.middleware import BodyLimitMiddleware, problem_response
from dss.service.proxying import HOP_HEADERS, MAX_DEPTH, PROXIED, parse_body, request_key, with_session
from dss.service.routing import Decision, Holdings, route

log = logging.getLogger("dss.service.router")


def create_router_app(config: RouterConfig, holdings: HoldingsSource | None = None) -> FastAPI:
    """The proxy's app; ``holdings`` answers where a session's pages are (``None``: nothing known)."""
    state = RouterState(config, holdings, {node: BackendState(node, url) for node, url in config.backends})
    metrics = RouterMetrics([node for node, _ in config.backends])
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000)) as client:
            app.state.client = client
            checker = asyncio.create_task(_health_loop(state, metrics, client))
            try:
                yield
            finally:
                checker.cancel()

    app = FastAPI(title="dss route", lifespan=lifespan)
    app.state.router = state

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {
            "status": "ok",
            "policy": config.policy,
            "backends": {b.node_id: {"healthy": b.is_healthy, "load": b.load} for b in state.backends.values()},
        }

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def proxy(request: Request) -> Response:
        return await _proxy(request, state, metrics)

    for path in PROXIED:
        app.add_api_route(path, proxy, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for backend in state.backends.values():
            if backend.is_healthy:
                got = await request.app.state.client.get(f"{backend.url}/v1/models")
                return Response(got.content, got.status_code, media_type=got.headers.get("content-type"))
        return problem_response(NoBackend("no backend is healthy"))

    async def dss_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, DssError)
        return problem_response(exc)

    app.add_exception_handler(DssError, dss_error)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    return app


async def _proxy(request: Request, state: RouterState, metrics: RouterMetrics) -> Response:
    raw = await request.body()  # at most max_body_bytes: BodyLimitMiddleware answered 413 past it
    body = parse_body(raw)
    headers = {k.lower(): v for k, v in request.headers.items()}
    session, tenant, prefix_key = request_key(body, headers)
    rewritten = with_session(body, headers)
    if rewritten is not None:
        raw = json.dumps(rewritten).encode()
    served_key = f"{tenant or ''}\0{session}" if session else None
    held = await _holdings(state, metrics, session, tenant, served_key)
    tried: set[str] = set()
    while True:
        state.counter += 1
        decision = route(
            state.view(tried),
            policy=state.config.policy,
            key=served_key or prefix_key,
            holdings=held,
            counter=state.counter,
            load_factor=state.config.load_factor,
        )
        backend = state.backends[decision.node_id]
        sent = await _send(request, raw, backend, decision, state, metrics)
        if sent is None:
            tried.add(backend.node_id)
            continue
        if served_key is not None and sent.status_code < 500:
            state.remember(served_key, backend.node_id)
        return sent


async def _send(
    request: Request, raw: bytes, backend: BackendState, decision: Decision, state: RouterState, metrics: RouterMetrics
) -> Response | None:
    """Forward the request to ``backend`` and stream its answer back; ``None`` when the backend
    failed before answering (marked down: the caller fails over), 503 when the router is
    shutting down."""
    backend.load += 1
    metrics.in_flight.labels(backend.node_id).inc()
    start = time.perf_counter()
    client: httpx.AsyncClient = request.app.state.client
    forward = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    try:
        upstream = await client.send(
            client.build_request("POST", backend.url + request.url.path, content=raw, headers=forward), stream=True
        )
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
        _failed(backend, metrics, exc)
        return None
    except asyncio.CancelledError:
        done(backend, metrics)
        if not state.is_stopping:
            raise
        metrics.requests.labels(backend.node_id, decision.reason, "cancelled").inc()
        log.warning("request to backend %s cancelled: the router is shutting down", backend.node_id)
        return problem_response(
            Unavailable("the router is shutting down (graceful_timeout_s passed)"), {"Connection": "close"}
        )
    passed = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
    return StreamingResponse(
        _relay(upstream, backend, decision, state, metrics, start),
        status_code=upstream.status_code,
        headers={**passed, "X-Dss-Node": backend.node_id, "X-Dss-Route": decision.reason},
    )


async def _holdings(
    state: RouterState, metrics: RouterMetrics, session: str | None, tenant: str | None, served_key: str | None
) -> Holdings:
    """Where the session's head pages are, per node and tier, when the policy routes by them
    (empty when it does not, or when the store cannot say: routed as if nothing were held)."""
    if state.config.policy != "kv" or not session or state.holdings is None:
        return {}
    served_by = state.served.get(served_key) if served_key else None
    try:
        return await anyio.to_thread.run_sync(state.holdings.of, session, tenant, served_by, list(state.backends))
    except DssError as exc:
        metrics.holdings_errors.inc()
        log.warning("could not ask the store where a session's pages are: %s", exc.kind)
        return {}


def _failed(backend: BackendState, metrics: RouterMetrics, exc: Exception) -> None:
    """A backend refused the connection or failed before answering: it is marked down and the
    request fails over to the next choice."""
    done(backend, metrics)
    mark(backend, False, metrics)
    metrics.failovers.labels(backend.node_id).inc()
    log.warning("backend %s failed (%s): failing over", backend.node_id, type(exc).__name__)


class ResponseCut(Exception):
    """Raised to cut a response off on purpose (ASGI's only way to end one without its end), its
    cause already logged; :class:`ReportedCuts` keeps uvicorn from logging it again."""


async def _relay(
    upstream: httpx.Response,
    backend: BackendState,
    decision: Decision,
    state: RouterState,
    metrics: RouterMetrics,
    start: float,
) -> AsyncIterator[bytes]:
    """The backend's response, chunk by chunk as it arrives; the backend's load drops when it ends.
    A backend failing mid-response, or shutdown's cancellation, cuts it off (see the module docstring)."""
    status = str(upstream.status_code)
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        status = "broken"
        log.warning(
            "backend %s failed mid-response (%s): the response was cut off", backend.node_id, type(exc).__name__
        )
        raise ResponseCut(backend.node_id) from None
    except asyncio.CancelledError:
        if state.is_stopping:
            status = "cancelled"
            log.warning("response of backend %s cut off: the router is shutting down", backend.node_id)
        raise
    finally:
        await upstream.aclose()
        done(backend, metrics)
        metrics.requests.labels(backend.node_id, decision.reason, status).inc()
        metrics.seconds.labels(backend.node_id).observe(time.perf_counter() - start)


async def _health_loop(state: RouterState, metrics: RouterMetrics, client: httpx.AsyncClient) -> None:
    """Check every backend's ``/health`` every ``health_interval_s``, for as long as the app runs."""
    while True:
        await asyncio.gather(*(_check(b, metrics, client, state.config) for b in state.backends.values()))
        await asyncio.sleep(state.config.health_interval_s)


async def _check(
    backend: BackendState, metrics: RouterMetrics, client: httpx.AsyncClient, config: RouterConfig
) -> None:
    try:
        answer = await client.get(f"{backend.url}/health", timeout=config.connect_timeout_s)
        mark(backend, answer.status_code == 200, metrics)
    except httpx.HTTPError:
        mark(backend, False, metrics)


class ReportedCuts(logging.Filter):
    """Drops uvicorn's report (a traceback) of an app that raised :class:`ResponseCut`, or was
    cancelled once the router is stopping: the router logged those in one line already."""

    def __init__(self, state: RouterState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or not self._is_reported(exc)

    def _is_reported(self, exc: BaseException) -> bool:
        if isinstance(exc, BaseExceptionGroup):
            return all(self._is_reported(inner) for inner in exc.exceptions)
        return isinstance(exc, ResponseCut) or self.state.is_stopping and isinstance(exc, asyncio.CancelledError)


class RouterServer(uvicorn.Server):
    """uvicorn's server, telling the router's state when a signal begins the shutdown."""

    def __init__(self, config: uvicorn.Config, state: RouterState) -> None:
        super().__init__(config)
        self.router_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.router_state.is_stopping = True
        super().handle_exit(sig, frame)


def serve_router(config: RouterConfig, holdings: HoldingsSource | None, *, log_level: str = "info") -> None:
    """Run the proxy until SIGTERM/SIGINT: in-flight requests get ``graceful_timeout_s`` to finish,
    then are cancelled (see the module docstring); uvicorn then re-raises the signal."""
    app = create_router_app(config, holdings)
    state: RouterState = app.state.router
    server = RouterServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=False,
            server_header=False,
            lifespan="on",
            timeout_graceful_shutdown=config.graceful_timeout_s,  # type: ignore[arg-type]  # a float works
        ),
        state,
    )
    uvicorn_log = logging.getLogger("uvicorn.error")
    cuts = ReportedCuts(state)
    uvicorn_log.addFilter(cuts)  # after uvicorn.Config, which configures its logging
    log.info(
        "dss route (%s) on http://%s:%d in front of %s",
        config.policy,
        config.host,
        config.port,
        ", ".join(f"{n}={u}" for n, u in config.backends),
    )
    try:
        server.run()
    finally:
        uvicorn_log.removeFilter(cuts)


__all__ = [
    "MAX_DEPTH",
    "HoldingsSource",
    "RouterConfig",
    "StoreHoldings",
    "create_router_app",
    "head_holdings",
    "parse_backends",
    "parse_body",
    "request_key",
    "serve_router",
    "with_session",
]
