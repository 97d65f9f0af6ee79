"""``dss route``: an HTTP proxy in front of vLLM's OpenAI-compatible servers that sends each
session to the node holding its KV.

For every ``POST /v1/completions`` and ``POST /v1/chat/completions`` the proxy

1. reads the session from the ``X-Session-Id`` header (with ``X-Tenant-Id`` and ``X-User-Id``;
   the gateway in front sets them, clients cannot) or from the body's
   ``kv_transfer_params.dss`` (``session_id``, ``tenant_id``); a session given by header is
   written into the body's ``kv_transfer_params.dss`` when the body has none, so the engine's
   dss connector sees it;
2. asks :class:`HoldingsSource` how many of the session's head pages each node holds, per tier;
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
:data:`MAX_DEPTH` arrays and objects (400 ``InvalidInput``, the connection stays usable).

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
each (a backend's node id must be its store's ``node_id``); see :func:`head_holdings`. The
node the router sent the session's last turn to counts them on its ``device`` tier too (the
engine computed or loaded them there, and keeps them while its own cache does). A failure to
ask the store is logged and counted, and the request is routed as if nothing were held.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio.to_thread
import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dss.core.config import parse_size
from dss.core.errors import ConfigError, DssError, InvalidInput, NoBackend, Unavailable
from dss.service.middleware import BodyLimitMiddleware, problem_response
from dss.service.routing import LOAD_FACTOR, POLICIES, Backend, Decision, Holdings, route

log = logging.getLogger("dss.service.router")

PROXIED = ("/v1/completions", "/v1/chat/completions")
PREFIX_CHARS = 256
"""Characters of a prompt that key a request without a session."""
SERVED_SESSIONS = 100_000
"""Sessions whose last node the router remembers (least recently routed forgotten first)."""
MAX_DEPTH = 128
"""Deepest nesting of arrays and objects in a request body, the top-level object counting as one
(OpenAI requests nest a handful deep; tool schemas a few dozen)."""
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
    }
)


class RouterConfig(BaseModel):
    """Everything ``dss route`` needs. Immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backends: tuple[tuple[str, str], ...] = Field(min_length=1, description="(node id, base URL) of each backend.")
    policy: str = Field("kv", description="kv, hash or round_robin.")
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8078, ge=1, le=65535)
    load_factor: float = Field(LOAD_FACTOR, ge=1.0, allow_inf_nan=False)
    health_interval_s: float = Field(1.0, gt=0, allow_inf_nan=False)
    connect_timeout_s: float = Field(2.0, gt=0, allow_inf_nan=False)
    timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False, description="Longest a backend may take to answer.")
    max_body_bytes: int = Field(32 << 20, ge=1024, description="Largest request body, as dss serve's.")
    graceful_timeout_s: float = Field(
        5.0, ge=0, allow_inf_nan=False, description="On SIGTERM, seconds in-flight requests may take to finish."
    )

    @field_validator("max_body_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}")
        return value

    @field_validator("backends")
    @classmethod
    def _backends(cls, value: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        ids = [node for node, _ in value]
        if len(set(ids)) != len(ids):
            raise ValueError("node ids must differ")
        for node, url in value:
            if not node or not url.startswith(("http://", "https://")):
                raise ValueError(f"backend {node}={url} is not NODE=http(s)://host:port")
        return value


def parse_backends(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``NODE=URL`` (or a bare URL, named ``node-<i>``) for each ``--backend``; ``ConfigError`` if malformed."""
    out = []
    for i, value in enumerate(values):
        node, sep, url = value.partition("=")
        if not sep:
            node, url = f"node-{i}", value
        if not node or not url.startswith(("http://", "https://")):
            raise ConfigError(f"--backend {value!r} is not NODE=http://host:port")
        out.append((node, url.rstrip("/")))
    return tuple(out)


class HoldingsSource(Protocol):
    """Where a session's head pages are (see the module docstring)."""

    def of(
        self, session_id: str, tenant_id: str | None, served_by: str | None, node_ids: Sequence[str]
    ) -> dict[str, dict[str, int]]:
        """Pages of the session's head held per node and tier; empty for an unknown session."""
        ...


class StoreHoldings:
    """:class:`HoldingsSource` from a store's catalog (opened beside ``dss serve``, same config)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def of(
        self, session_id: str, tenant_id: str | None, served_by: str | None, node_ids: Sequence[str]
    ) -> dict[str, dict[str, int]]:
        from dss.catalog import pages
        from dss.catalog.database import catalog_errors
        from dss.core.errors import NotFound

        try:
            with self.store.guard.reading():  # the head's page ids, whether this node can read them or not
                state = self.store.mirror.state(session_id, tenant_id)
                ids = state.page_ids(state.head_id) if state.head_id is not None else []
        except NotFound:
            return {}
        with catalog_errors(), self.store.catalog.read() as conn:
            where = pages.disk_nodes(conn, ids)
        return head_holdings([where.get(page_id) for page_id in ids], served_by, node_ids)


def head_holdings(
    disk_nodes: Sequence[str | None], served_by: str | None, node_ids: Sequence[str]
) -> dict[str, dict[str, int]]:
    """Holdings of a head whose stored pages lie on ``disk_nodes`` (one entry per page: the node
    whose disk holds it, ``None`` for the remote tier only). A page on a router node's disk
    counts there; one on the disk of a node the router does not front (a store folder the
    backends share, or another node: every backend reads it alike, from the folder or the
    remote tier) counts for every node; the node that served the session last holds every
    page on its ``device`` tier too."""
    out: dict[str, dict[str, int]] = {}
    fronted = set(node_ids)
    for node in disk_nodes:
        for holder in (node,) if node in fronted else node_ids if node is not None else ():
            held = out.setdefault(holder, {})
            held["disk"] = held.get("disk", 0) + 1
    if served_by in fronted and disk_nodes:
        out.setdefault(served_by, {})["device"] = len(disk_nodes)
    return out


@dataclass
class BackendState:
    node_id: str
    url: str
    is_healthy: bool = True
    load: int = 0


@dataclass
class RouterState:
    config: RouterConfig
    holdings: HoldingsSource | None
    backends: dict[str, BackendState] = field(default_factory=dict)
    served: OrderedDict[str, str] = field(default_factory=OrderedDict)
    counter: int = 0
    is_stopping: bool = False
    """Set once shutdown begins: a cancellation from then on is the graceful timeout's."""

    def view(self, exclude: set[str]) -> list[Backend]:
        return [Backend(b.node_id, b.is_healthy and b.node_id not in exclude, b.load) for b in self.backends.values()]

    def remember(self, key: str, node_id: str) -> None:
        self.served[key] = node_id
        self.served.move_to_end(key)
        while len(self.served) > SERVED_SESSIONS:
            self.served.popitem(last=False)


class RouterMetrics:
    def __init__(self, node_ids: Sequence[str]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dss_router_requests", "Requests proxied.", ["node", "reason", "status"], registry=r)
        self.seconds = Histogram(
            "dss_router_request_seconds", "Time until a backend's response ended.", ["node"], registry=r
        )
        self.failovers = Counter(
            "dss_router_failovers", "Requests moved off a backend that failed.", ["node"], registry=r
        )
        self.healthy = Gauge(
            "dss_router_backend_healthy", "1 when the backend answers its health check.", ["node"], registry=r
        )
        self.in_flight = Gauge("dss_router_in_flight", "Requests in flight per backend.", ["node"], registry=r)
        self.holdings_errors = Counter(
            "dss_router_holdings_errors", "Failures asking the store where pages are.", registry=r
        )
        for node in node_ids:
            self.healthy.labels(node).set(1)
            self.in_flight.labels(node).set(0)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ``InvalidInput`` when it is not JSON, not an object, has
    a number too long to read, or nests deeper than :data:`MAX_DEPTH` (however deep: a parse
    that runs out of stack is caught). Nothing it returns nests deeper, so re-encoding it is safe."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidInput(f"the request body nests deeper than {MAX_DEPTH} levels of arrays and objects") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidInput("the request body is not JSON") from None
    except ValueError:  # an integer past Python's digit limit
        raise InvalidInput("the request body has a number with too many digits") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    if _nests_deeper(body, MAX_DEPTH):
        raise InvalidInput(f"the request body nests deeper than {MAX_DEPTH} levels of arrays and objects")
    return body


def _nests_deeper(value: object, depth: int) -> bool:
    """Whether ``value`` nests more than ``depth`` arrays and objects (level by level, no recursion)."""
    level: list[Any] = [value]
    for _ in range(depth):
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def request_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    """``(session_id, tenant_id, prefix_key)`` of a request (see the module docstring)."""
    params = body.get("kv_transfer_params")
    own = params.get("dss") if isinstance(params, dict) else None
    own = own if isinstance(own, dict) else {}
    session = headers.get("x-session-id") or own.get("session_id")
    tenant = headers.get("x-tenant-id") or own.get("tenant_id")
    if session is not None and not isinstance(session, str) or tenant is not None and not isinstance(tenant, str):
        raise InvalidInput("kv_transfer_params.dss.session_id and tenant_id must be strings")
    prompt = body.get("messages", body.get("prompt"))
    prefix = json.dumps(prompt, sort_keys=True)[:PREFIX_CHARS] if prompt is not None else None
    prefix_key = "p:" + hashlib.blake2b(prefix.encode(), digest_size=8).hexdigest() if prefix else None
    return session or None, tenant or None, prefix_key


def with_session(body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any] | None:
    """The body with the header's session written into ``kv_transfer_params.dss`` (``None``: unchanged)."""
    session = headers.get("x-session-id")
    params = body.get("kv_transfer_params")
    if session is None or isinstance(params, dict) and isinstance(params.get("dss"), dict):
        return None
    fields = {"session_id": session}
    for name in ("tenant_id", "user_id"):
        if headers.get(f"x-{name.replace('_', '-')}"):
            fields[name] = headers[f"x-{name.replace('_', '-')}"]
    return {**body, "kv_transfer_params": {**(params if isinstance(params, dict) else {}), "dss": fields}}


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
    held: Holdings = {}
    if state.config.policy == "kv" and session and state.holdings is not None:
        served_by = state.served.get(served_key) if served_key else None
        try:
            held = await anyio.to_thread.run_sync(state.holdings.of, session, tenant, served_by, list(state.backends))
        except DssError as exc:  # the store cannot say: route as if nothing were held
            metrics.holdings_errors.inc()
            log.warning("could not ask the store where a session's pages are: %s", exc.kind)
    forward = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    tried: set[str] = set()
    client: httpx.AsyncClient = request.app.state.client
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
        backend.load += 1
        metrics.in_flight.labels(backend.node_id).inc()
        start = time.perf_counter()
        try:
            upstream = await client.send(
                client.build_request("POST", backend.url + request.url.path, content=raw, headers=forward), stream=True
            )
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            _done(backend, metrics)
            _mark(backend, False, metrics)
            metrics.failovers.labels(backend.node_id).inc()
            log.warning("backend %s failed (%s): failing over", backend.node_id, type(exc).__name__)
            tried.add(backend.node_id)
            continue
        except asyncio.CancelledError:
            _done(backend, metrics)
            if not state.is_stopping:
                raise
            metrics.requests.labels(backend.node_id, decision.reason, "cancelled").inc()
            log.warning("request to backend %s cancelled: the router is shutting down", backend.node_id)
            return problem_response(
                Unavailable("the router is shutting down (graceful_timeout_s passed)"), {"Connection": "close"}
            )
        if served_key is not None and upstream.status_code < 500:
            state.remember(served_key, backend.node_id)
        passed = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(
            _relay(upstream, backend, decision, state, metrics, start),
            status_code=upstream.status_code,
            headers={**passed, "X-Dss-Node": backend.node_id, "X-Dss-Route": decision.reason},
        )


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
        _done(backend, metrics)
        metrics.requests.labels(backend.node_id, decision.reason, status).inc()
        metrics.seconds.labels(backend.node_id).observe(time.perf_counter() - start)


def _done(backend: BackendState, metrics: RouterMetrics) -> None:
    backend.load -= 1
    metrics.in_flight.labels(backend.node_id).dec()


def _mark(backend: BackendState, is_healthy: bool, metrics: RouterMetrics) -> None:
    if backend.is_healthy != is_healthy:
        log.warning("backend %s is %s", backend.node_id, "back" if is_healthy else "down")
    backend.is_healthy = is_healthy
    metrics.healthy.labels(backend.node_id).set(1 if is_healthy else 0)


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
        _mark(backend, answer.status_code == 200, metrics)
    except httpx.HTTPError:
        _mark(backend, False, metrics)


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
