"""``dss route``: an HTTP proxy in front of vLLM's OpenAI-compatible servers that sends each
session to the node holding its KV.

For every ``POST /v1/completions`` and ``POST /v1/chat/completions`` the proxy

1. reads the session from the ``X-Session-Id`` header (with ``X-Tenant-Id`` and ``X-User-Id``;
   the gateway in front sets them, clients cannot) or from the body's
   ``kv_transfer_params.dss`` (``session_id``, ``tenant_id``); a session given by header is
   written into the body's ``kv_transfer_params.dss`` when the body has none, so the engine's
   dss connector sees it;
2. asks :class:`HoldingsSource` how many of the session's head pages each node holds, per tier;
3. picks a backend with :func:`dss.routing.route` (policy ``kv``, ``hash`` or
   ``round_robin``; requests without a session are keyed by their prompt's first characters, so
   a shared system prompt stays on one node);
4. forwards the request unchanged and streams the response back as it comes (server-sent
   events included), with ``X-Dss-Node`` and ``X-Dss-Route`` headers saying where it went.

A backend that refuses the connection or times out before answering is marked unhealthy and
the request goes to the next choice (failover); a background task checks every backend's
``/health`` every ``health_interval_s`` and brings it back when it answers. With no healthy
backend the proxy answers 503 ``NoBackend`` as problem details, like ``dss serve``. Metrics
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
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dss.core.errors import BackendFailed, ConfigError, DssError, InvalidInput, NoBackend
from dss.routing import LOAD_FACTOR, POLICIES, Backend, Decision, Holdings, route
from dss.service.middleware import problem_response

log = logging.getLogger("dss.service.router")

PROXIED = ("/v1/completions", "/v1/chat/completions")
PREFIX_CHARS = 256
"""Characters of a prompt that key a request without a session."""
SERVED_SESSIONS = 100_000
"""Sessions whose last node the router remembers (least recently routed forgotten first)."""
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authorization", "proxy-authenticate", "host", "content-length"})


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

    def of(self, session_id: str, tenant_id: str | None, served_by: str | None,
           node_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """Pages of the session's head held per node and tier; empty for an unknown session."""
        ...


class StoreHoldings:
    """:class:`HoldingsSource` from a store's catalog (opened beside ``dss serve``, same config)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def of(self, session_id: str, tenant_id: str | None, served_by: str | None,
           node_ids: Sequence[str]) -> dict[str, dict[str, int]]:
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


def head_holdings(disk_nodes: Sequence[str | None], served_by: str | None,
                  node_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Holdings of a head whose stored pages lie on ``disk_nodes`` (one entry per page: the node
    whose disk holds it, ``None`` for the remote tier only). A page on a router node's disk
    counts there; one on the disk of a node the router does not front (a store folder the
    backends share, or another node: every backend reads it alike, from the folder or the
    remote tier) counts for every node; the node that served the session last holds every
    page on its ``device`` tier too."""
    out: dict[str, dict[str, int]] = {}
    fronted = set(node_ids)
    for node in disk_nodes:
        for holder in ((node,) if node in fronted else node_ids if node is not None else ()):
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
        self.seconds = Histogram("dss_router_request_seconds", "Time until a backend's response ended.", ["node"],
                                 registry=r)
        self.failovers = Counter("dss_router_failovers", "Requests moved off a backend that failed.", ["node"],
                                 registry=r)
        self.healthy = Gauge("dss_router_backend_healthy", "1 when the backend answers its health check.", ["node"],
                             registry=r)
        self.in_flight = Gauge("dss_router_in_flight", "Requests in flight per backend.", ["node"], registry=r)
        self.holdings_errors = Counter("dss_router_holdings_errors", "Failures asking the store where pages are.",
                                       registry=r)
        for node in node_ids:
            self.healthy.labels(node).set(1)
            self.in_flight.labels(node).set(0)


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
        return {"status": "ok", "policy": config.policy,
                "backends": {b.node_id: {"healthy": b.is_healthy, "load": b.load} for b in state.backends.values()}}

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
    return app


async def _proxy(request: Request, state: RouterState, metrics: RouterMetrics) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidInput("the request body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
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
        decision = route(state.view(tried), policy=state.config.policy, key=served_key or prefix_key,
                         holdings=held, counter=state.counter, load_factor=state.config.load_factor)
        backend = state.backends[decision.node_id]
        backend.load += 1
        metrics.in_flight.labels(backend.node_id).inc()
        start = time.perf_counter()
        try:
            upstream = await client.send(client.build_request("POST", backend.url + request.url.path, content=raw,
                                                              headers=forward), stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            _done(backend, metrics)
            _mark(backend, False, metrics)
            metrics.failovers.labels(backend.node_id).inc()
            log.warning("backend %s failed (%s): failing over", backend.node_id, type(exc).__name__)
            tried.add(backend.node_id)
            continue
        if served_key is not None and upstream.status_code < 500:
            state.remember(served_key, backend.node_id)
        return StreamingResponse(_relay(upstream, backend, decision, metrics, start), status_code=upstream.status_code,
                                 headers={**{k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS},
                                          "X-Dss-Node": backend.node_id, "X-Dss-Route": decision.reason})


async def _relay(upstream: httpx.Response, backend: BackendState, decision: Decision, metrics: RouterMetrics,
                 start: float) -> AsyncIterator[bytes]:
    """The backend's response, chunk by chunk as it arrives; the backend's load drops when it ends."""
    status = str(upstream.status_code)
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        status = "broken"
        raise BackendFailed(f"backend {backend.node_id} failed mid-response ({type(exc).__name__})") from exc
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


async def _check(backend: BackendState, metrics: RouterMetrics, client: httpx.AsyncClient,
                 config: RouterConfig) -> None:
    try:
        answer = await client.get(f"{backend.url}/health", timeout=config.connect_timeout_s)
        _mark(backend, answer.status_code == 200, metrics)
    except httpx.HTTPError:
        _mark(backend, False, metrics)


def serve_router(config: RouterConfig, holdings: HoldingsSource | None, *, log_level: str = "info") -> None:
    """Run the proxy until SIGTERM/SIGINT (in-flight requests finish first)."""
    import uvicorn

    app = create_router_app(config, holdings)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                          access_log=False, server_header=False, lifespan="on"))
    log.info("dss route (%s) on http://%s:%d in front of %s", config.policy, config.host, config.port,
             ", ".join(f"{n}={u}" for n, u in config.backends))
    server.run()


__all__ = ["HoldingsSource", "RouterConfig", "StoreHoldings", "create_router_app", "head_holdings", "parse_backends",
           "request_key", "serve_router", "with_session"]
