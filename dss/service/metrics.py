"""Prometheus metrics of the service, in a registry of its own.

Counters and histograms (updated as requests run):

* ``dss_http_requests_total{method,route,status}``, ``dss_http_request_seconds{method,route}``,
  ``dss_http_requests_in_flight`` — every request; ``route`` is the endpoint's path, or
  ``unmatched`` for a path the API does not have (so labels stay bounded).
* ``dss_resume_seconds`` — time the store took to answer a resume or lookup.
* ``dss_resume_total{result="hit"|"miss"}`` — resumes that matched at least one page, or none.
* ``dss_resume_prompt_tokens_total``, ``dss_resume_matched_tokens_total`` — their ratio is the
  token hit rate.
* ``dss_resume_lossy_tokens_total{encoding}`` — of the matched tokens, those a load would serve
  from a copy kept at a lower precision (``int8``, ``fp8``, ``k8v4``; see ``host_precision``,
  ``disk_precision``): approximate KV, announced.
* ``dss_page_hits_total{tier}``, ``dss_page_misses_total{tier}`` — per full page of a resumed
  prompt, looking tiers up fastest first: a hit on the fastest tier holding the page, a miss
  on every faster tier; a page no tier holds is a miss on every tier.
* ``dss_commits_total``, ``dss_committed_tokens_total`` — commits acknowledged.
* ``dss_erasures_total{result="done"|"failed"}`` — ``forget_user`` calls through this service
  (dry runs not counted).

Gauges read from the store when scraped: ``dss_sessions``, ``dss_tier_pages{tier}``,
``dss_tier_bytes{tier}``, ``dss_tier_capacity_bytes{tier}``, ``dss_tier_inactive_bytes{tier}``
(of those bytes, the pages the mover demoted, still readable: the watermarks measure the rest),
``dss_tier_high_watermark_bytes{tier}``, ``dss_tier_low_watermark_bytes{tier}``,
``dss_erasures_open`` (erasure jobs not finished, every process of the catalog),
``dss_erasure_oldest_open_seconds`` (age of the oldest of them; 0 when none — an alert fires
when it keeps growing); with a remote tier also
``dss_remote_up`` (1 while Redis answers, 0 once a call failed, until one succeeds),
``dss_remote_errors_total{op}`` (failed ``get``, ``put``, ``delete``, ``scan`` calls, and
values that failed ``verify``) and ``dss_remote_pending_bytes`` (page bytes waiting to be
written through).

Counters of the placement policy read from the store when scraped (:meth:`dss.Store.stats`):
``dss_tier_promotions_total{tier}`` (pages moved up into the tier),
``dss_tier_demotions_total{tier}`` (moved down out of it, a copy stays below),
``dss_tier_evictions_total{tier}`` (dropped with no copy below), ``dss_tier_moved_bytes_total{tier}``,
``dss_prefetch_hits_total`` (prefetched pages then read from host), ``dss_prefetch_wasted_total``
(prefetched pages that left host unread).

No label ever carries a tenant, user or session id (erasure must leave none behind).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dss.core.errors import DssError
from dss.core.precision import ENCODINGS
from dss.sessions.resume import ResumeResult
from dss.store import Store
from dss.tiers.remote import RemoteTier

log = logging.getLogger("dss.service.server")

HTTP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RESUME_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 1.0)
UNMATCHED = "unmatched"


class Metrics:
    """The service's metrics; one instance per app, with its own registry."""

    def __init__(self, store: Store) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tiers = tuple(t for t in ("device", "host", "disk", "remote") if t in store.rates.tier_bytes_per_s)
        r = self.registry
        self.requests = Counter(
            "dss_http_requests", "HTTP requests answered.", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "dss_http_request_seconds",
            "Time to answer an HTTP request.",
            ["method", "route"],
            buckets=HTTP_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("dss_http_requests_in_flight", "HTTP requests being answered.", registry=r)
        self.resume_seconds = Histogram(
            "dss_resume_seconds",
            "Time the store took to answer a resume or lookup.",
            buckets=RESUME_BUCKETS,
            registry=r,
        )
        self.resumes = Counter(
            "dss_resume", "Resumes and lookups, by whether any page matched.", ["result"], registry=r
        )
        self.prompt_tokens = Counter("dss_resume_prompt_tokens", "Prompt tokens resumes were asked about.", registry=r)
        self.matched_tokens = Counter(
            "dss_resume_matched_tokens", "Prompt tokens resumes found stored KV for.", registry=r
        )
        self.lossy_tokens = Counter(
            "dss_resume_lossy_tokens",
            "Matched tokens a load would serve from a lower-precision copy, by encoding.",
            ["encoding"],
            registry=r,
        )
        for encoding in ENCODINGS[1:]:
            self.lossy_tokens.labels(encoding)
        self.page_hits = Counter(
            "dss_page_hits", "Resumed pages found on a tier (the fastest holding them).", ["tier"], registry=r
        )
        self.page_misses = Counter(
            "dss_page_misses", "Resumed pages a tier did not hold (and no faster tier).", ["tier"], registry=r
        )
        self.commits = Counter("dss_commits", "Commits acknowledged.", registry=r)
        self.committed_tokens = Counter("dss_committed_tokens", "Tokens of acknowledged commits.", registry=r)
        self.erasures = Counter(
            "dss_erasures", "Erasures (forget_user) run through this service, by result.", ["result"], registry=r
        )
        for result in ("done", "failed"):
            self.erasures.labels(result)
        for result in ("hit", "miss"):
            self.resumes.labels(result)
        for tier in self.tiers:
            self.page_hits.labels(tier)
            self.page_misses.labels(tier)
        r.register(StoreCollector(store, self.tiers))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def observe_resume(self, result: ResumeResult, seconds: float) -> None:
        """Count one resume (or lookup) answer; see the module docstring for the page counts."""
        self.resume_seconds.observe(seconds)
        self.resumes.labels("hit" if result.matched_tokens else "miss").inc()
        self.prompt_tokens.inc(result.num_prompt_tokens)
        self.matched_tokens.inc(result.matched_tokens)
        for encoding, tokens in result.encodings.items():
            self.lossy_tokens.labels(encoding).inc(tokens)
        page_tokens = result.page_tokens
        remaining = result.num_prompt_tokens // page_tokens
        found = result.tiers
        for tier in self.tiers:
            hits = found.get(tier, 0) // page_tokens
            remaining -= hits
            if hits:
                self.page_hits.labels(tier).inc(hits)
            if remaining:
                self.page_misses.labels(tier).inc(remaining)

    def observe_commit(self, num_tokens: int) -> None:
        self.commits.inc()
        self.committed_tokens.inc(num_tokens)

    def observe_erasure(self, done: bool) -> None:
        self.erasures.labels("done" if done else "failed").inc()


class StoreCollector(Collector):
    """Gauges read from the store at scrape time: sessions, and pages and bytes per tier."""

    def __init__(self, store: Store, tiers: tuple[str, ...]) -> None:
        self.store = store
        self.tiers = tiers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.store.stats()
            num_sessions = self.store.count_sessions()
        except DssError as exc:  # a scrape must not fail because the store is closing
            log.warning("metrics: cannot read the store: %s", exc)
            return
        sessions = GaugeMetricFamily("dss_sessions", "Sessions in the store (every tenant).")
        sessions.add_metric([], num_sessions)
        yield sessions
        yield from _tier_families(stats, self.tiers)
        yield from _other_families(stats)
        if self.store.remote is not None:
            yield from _remote_families(self.store.remote)


def _tier_families(stats: dict[str, Any], tiers: Sequence[str]) -> Iterator[Metric]:
    """Each tier's pages, bytes, capacity, watermarks and moves, as the store's stats say."""
    pages = GaugeMetricFamily("dss_tier_pages", "Pages held on a tier.", labels=["tier"])
    size = GaugeMetricFamily("dss_tier_bytes", "Bytes held on a tier.", labels=["tier"])
    capacity = GaugeMetricFamily("dss_tier_capacity_bytes", "Capacity of a tier.", labels=["tier"])
    inactive = GaugeMetricFamily(
        "dss_tier_inactive_bytes",
        "Bytes of pages the mover demoted that a tier still holds, readable until their room is needed (host).",
        labels=["tier"],
    )
    high = GaugeMetricFamily(
        "dss_tier_high_watermark_bytes", "Fill of a tier at which the mover starts.", labels=["tier"]
    )
    low = GaugeMetricFamily(
        "dss_tier_low_watermark_bytes", "Fill of a tier the mover moves pages down to.", labels=["tier"]
    )
    moves = {name: CounterMetricFamily(f"dss_tier_{name}", text, labels=["tier"]) for name, text in MOVES}
    for tier in tiers:
        if tier not in stats:
            continue
        held = stats[tier]
        pages.add_metric([tier], held["pages"])
        size.add_metric([tier], held["bytes"])
        capacity.add_metric([tier], held["capacity"])
        inactive.add_metric([tier], held.get("inactive_bytes", 0))
        if "high_watermark" in held:
            high.add_metric([tier], held["high_watermark"])
            low.add_metric([tier], held["low_watermark"])
            for name, family in moves.items():
                family.add_metric([tier], held[name])
    yield from (pages, size, capacity, inactive, high, low, *moves.values())


def _other_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """Prefetch's hits and waste, and the erasures not finished."""
    prefetch = stats.get("prefetch", {})
    prefetch_hits = CounterMetricFamily("dss_prefetch_hits", "Prefetched pages then read from host.")
    prefetch_hits.add_metric([], prefetch.get("hits", 0))
    prefetch_wasted = CounterMetricFamily("dss_prefetch_wasted", "Prefetched pages that left host unread.")
    prefetch_wasted.add_metric([], prefetch.get("wasted", 0))
    open_erasures = GaugeMetricFamily("dss_erasures_open", "Erasure jobs not finished (every process).")
    open_erasures.add_metric([], stats["erasures"]["open"])
    oldest = GaugeMetricFamily(
        "dss_erasure_oldest_open_seconds", "Seconds since the oldest unfinished erasure job started (0 when none)."
    )
    oldest.add_metric([], stats["erasures"]["oldest_open_s"])
    yield from (prefetch_hits, prefetch_wasted, open_erasures, oldest)


MOVES = (
    ("promotions", "Pages moved up into a tier."),
    ("demotions", "Pages moved down out of a tier (a lower tier keeps a copy)."),
    ("evictions", "Pages dropped from a tier with no copy on a lower tier."),
    ("moved_bytes", "Bytes of pages promoted into or demoted out of a tier."),
)
"""The per-tier counters of the policy's moves, with their help text."""


def _remote_families(remote: RemoteTier) -> Iterator[Metric]:
    """Whether the remote tier answers, its failed calls, and the bytes waiting for it."""
    up = GaugeMetricFamily("dss_remote_up", "Whether the remote tier (Redis) answers: 1, or 0 since a call failed.")
    up.add_metric([], 1.0 if remote.is_up else 0.0)
    errors = CounterMetricFamily(
        "dss_remote_errors",
        "Remote-tier calls that failed, and values that failed verification.",
        labels=["op"],
    )
    for op, count in remote.errors.items():
        errors.add_metric([op], count)
    pending = GaugeMetricFamily("dss_remote_pending_bytes", "Page bytes waiting to be written to the remote tier.")
    pending.add_metric([], remote.pending_bytes)
    yield from (up, errors, pending)
