"""The router's backends: its settings, where a session's pages are held (:class:`HoldingsSource`),
each backend's health and load, and the router's metrics (see :mod:`dss.service.router`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field, field_validator

from dss.core.config import parse_size
from dss.core.errors import ConfigError
from dss.service.routing import LOAD_FACTOR, POLICIES, Backend

log = logging.getLogger("dss.service.router")


SERVED_SESSIONS = 100_000
"""Sessions whose last node the router remembers (least recently routed forgotten first)."""


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
        from dss.catalog import segments
        from dss.catalog.database import catalog_errors
        from dss.core.errors import NotFound

        try:
            with self.store.guard.reading():  # the head's page ids, whether this node can read them or not
                state = self.store.mirror.state(session_id, tenant_id)
                ids = state.page_ids(state.head_id) if state.head_id is not None else []
        except NotFound:
            return {}
        with catalog_errors(), self.store.catalog.read() as conn:
            where = segments.disk_nodes(conn, ids)
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


def done(backend: BackendState, metrics: RouterMetrics) -> None:
    backend.load -= 1
    metrics.in_flight.labels(backend.node_id).dec()


def mark(backend: BackendState, is_healthy: bool, metrics: RouterMetrics) -> None:
    if backend.is_healthy != is_healthy:
        log.warning("backend %s is %s", backend.node_id, "back" if is_healthy else "down")
    backend.is_healthy = is_healthy
    metrics.healthy.labels(backend.node_id).set(1 if is_healthy else 0)
