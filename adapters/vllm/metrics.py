"""The connector's metrics, through vLLM's KV connector stats.

Both connector sides count into a :class:`DssConnectorStats`; vLLM collects the workers'
(summed over ranks) and the scheduler's each step and hands them to its stat loggers, so
they appear in ``vllm serve``'s ``/metrics`` and in ``LLM.get_metrics()`` (an ``LLM`` made
with ``disable_log_stats=False``; :func:`read_metrics` picks them out):

==========================================  =========  =========================================
metric                                      type       meaning
==========================================  =========  =========================================
``vllm:dss_requests_total{result}``         counter    finished requests dss was asked about:
                                                       ``hit`` (dss loaded KV), ``engine``
                                                       (vLLM's own prefix cache held at least as
                                                       much as dss could load: nothing to add),
                                                       ``recompute`` (dss held more, but
                                                       recomputing it was estimated faster at
                                                       the engine's prefill speed) or ``miss``
                                                       (neither had it)
``vllm:dss_loaded_tokens_total{tier}``      counter    prompt tokens loaded into finished
                                                       requests, net of pages that failed, by
                                                       the tier planned (``host``: the worker's
                                                       RAM, ``disk``, ``remote``)
``vllm:dss_late_miss_pages_total{tier}``    counter    pages ``resume`` counted as matched whose
                                                       bytes the store no longer had when the
                                                       worker read them (evicted, corrupt, the
                                                       remote tier down); vLLM recomputed them.
                                                       One per worker shard
``vllm:dss_lossy_tokens_total{encoding}``   counter    of those, the tokens loaded from copies a
                                                       tier keeps at a lower precision
                                                       (``int8``, ``fp8``, ``k8v4``; see
                                                       ``disk_precision``): approximate KV,
                                                       announced
``vllm:dss_failed_pages_total``             counter    pages that could not be loaded (vLLM
                                                       recomputed them): late misses, and pages
                                                       the scheduler found unloadable; one per
                                                       worker shard
``vllm:dss_saved_pages_total``              counter    pages written (every shard's)
``vllm:dss_failed_saves_total``             counter    save jobs the store refused
``vllm:dss_load_seconds``                   histogram  one load job, read and copy, per worker
``vllm:dss_save_seconds``                   histogram  one save job, copy out to written, per worker
``vllm:dss_pending_write_bytes``            gauge      copied pages not yet written, all workers
==========================================  =========  =========================================

A request counts once, when it finishes; its output ``kv_transfer_params`` carries the same
``result`` (see :func:`dss_adapters.vllm.requests.request_result`). :data:`METRICS` lists
every metric name (the Grafana dashboard ``deploy/grafana/dss.json`` shows each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

RESULTS = ("hit", "engine", "recompute", "miss")
"""A finished request's ``result`` (see the module docstring)."""
TIERS = ("host", "disk", "remote")
"""Where a page was planned to load from: the worker's host tier (RAM), its disk, the remote tier."""
ENCODINGS = ("int8", "fp8", "k8v4")
"""The lossy encodings a tier may keep pages in (``disk_precision``, ...)."""
COUNTERS = (
    *(f"requests_{r}" for r in RESULTS),
    *(f"loaded_tokens_{t}" for t in TIERS),
    *(f"late_miss_pages_{t}" for t in TIERS),
    *(f"lossy_tokens_{e}" for e in ENCODINGS),
    "failed_pages",
    "saved_pages",
    "failed_saves",
)
LATENCIES = ("load", "save")
METRICS = (
    "vllm:dss_requests_total",
    "vllm:dss_loaded_tokens_total",
    "vllm:dss_late_miss_pages_total",
    "vllm:dss_lossy_tokens_total",
    "vllm:dss_failed_pages_total",
    "vllm:dss_saved_pages_total",
    "vllm:dss_failed_saves_total",
    "vllm:dss_load_seconds",
    "vllm:dss_save_seconds",
    "vllm:dss_pending_write_bytes",
)
"""Every metric :class:`DssPromMetrics` exports."""
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class DssConnectorStats(KVConnectorStats):
    """Counts since the last collection: ``data`` holds ``counters`` (name → number),
    ``latency`` (``load``/``save`` → seconds observed) and ``pending`` (worker → bytes
    waiting to be written, its latest value). Plain values only: it crosses processes."""

    def __post_init__(self) -> None:
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "latency": {}, "pending": {}}

    def count(self, name: str, value: int = 1) -> None:
        """Add ``value`` to counter ``name`` (one of :data:`COUNTERS`)."""
        assert name in COUNTERS, name
        if value:
            counters = self.data["counters"]
            counters[name] = counters.get(name, 0) + value

    def count_request(self, result: str, loaded_by_tier: dict[str, int], encodings: dict[str, int]) -> None:
        """A finished request: its ``result`` (:data:`RESULTS`), the tokens it loaded by tier, and
        of those the tokens served from lower-precision copies, by encoding."""
        self.count(f"requests_{result}")
        for tier, tokens in loaded_by_tier.items():
            self.count(f"loaded_tokens_{tier}", tokens)
        for encoding, tokens in encodings.items():
            self.count(f"lossy_tokens_{encoding}", tokens)

    def observe(self, name: str, seconds: float) -> None:
        """Record one latency (``load`` or ``save``)."""
        assert name in LATENCIES, name
        self.data["latency"].setdefault(name, []).append(seconds)

    def set_pending(self, worker: str, num_bytes: int) -> None:
        self.data["pending"][worker] = num_bytes

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counts and observations to these (pending bytes: latest per worker)."""
        if other.is_empty():
            return self
        for name, value in other.data["counters"].items():
            self.count(name, value)
        for name, values in other.data["latency"].items():
            self.data["latency"].setdefault(name, []).extend(values)
        self.data["pending"].update(other.data["pending"])
        return self

    def reduce(self) -> dict[str, int | float]:
        """A summary for vLLM's periodic log line."""
        out: dict[str, int | float] = dict(self.data["counters"])
        for name, values in self.data["latency"].items():
            out[f"{name}_jobs"] = len(values)
            out[f"{name}_avg_ms"] = round(sum(values) / len(values) * 1e3, 3)
        if self.data["pending"]:
            out["pending_write_bytes"] = sum(self.data["pending"].values())
        return out

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["latency"] or self.data["pending"])

    def take(self) -> DssConnectorStats | None:
        """A copy of the counts so far (``None`` if there are none); these start again from zero."""
        if self.is_empty():
            return None
        taken = DssConnectorStats(self.data)
        self.reset()
        return taken


class DssPromMetrics(KVConnectorPromMetrics):
    """The Prometheus side: one metric family per name in the module docstring."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's (or its multiprocess-aware) prometheus classes
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        requests = counter(
            name="vllm:dss_requests_total",
            documentation="Requests dss was asked about, by result.",
            labelnames=[*labelnames, "result"],
        )
        tokens = counter(
            name="vllm:dss_loaded_tokens_total",
            documentation="Prompt tokens loaded from dss, by tier.",
            labelnames=[*labelnames, "tier"],
        )
        late = counter(
            name="vllm:dss_late_miss_pages_total",
            documentation="dss pages matched but gone when loaded (recomputed), by tier.",
            labelnames=[*labelnames, "tier"],
        )
        lossy = counter(
            name="vllm:dss_lossy_tokens_total",
            documentation="Prompt tokens loaded from dss copies kept at a lower precision, by encoding.",
            labelnames=[*labelnames, "encoding"],
        )
        plain = {
            "failed_pages": counter(
                name="vllm:dss_failed_pages_total",
                documentation="dss pages that could not be loaded (recomputed).",
                labelnames=labelnames,
            ),
            "saved_pages": counter(
                name="vllm:dss_saved_pages_total", documentation="dss pages written.", labelnames=labelnames
            ),
            "failed_saves": counter(
                name="vllm:dss_failed_saves_total",
                documentation="dss save jobs the store refused.",
                labelnames=labelnames,
            ),
        }
        latency = {
            name: histogram(
                name=f"vllm:dss_{name}_seconds",
                buckets=_BUCKETS,
                labelnames=labelnames,
                documentation=f"Seconds per dss {name} job, per worker.",
            )
            for name in LATENCIES
        }
        pending = gauge(
            name="vllm:dss_pending_write_bytes",
            documentation="Copied pages not yet written, bytes.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._counters: dict[int, dict[str, Any]] = {}
        self._latency: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, Any] = {}
        for engine, values in per_engine_labelvalues.items():
            bound = {name: metric.labels(*values) for name, metric in plain.items()}
            for result in RESULTS:
                bound[f"requests_{result}"] = requests.labels(*values, result)
            for tier in TIERS:
                bound[f"loaded_tokens_{tier}"] = tokens.labels(*values, tier)
                bound[f"late_miss_pages_{tier}"] = late.labels(*values, tier)
            for encoding in ENCODINGS:
                bound[f"lossy_tokens_{encoding}"] = lossy.labels(*values, encoding)
            self._counters[engine] = bound
            self._latency[engine] = {name: metric.labels(*values) for name, metric in latency.items()}
            self._pending[engine] = pending.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counters", {}).items():
            self._counters[engine_idx][name].inc(value)
        for name, values in transfer_stats_data.get("latency", {}).items():
            for seconds in values:
                self._latency[engine_idx][name].observe(seconds)
        pending = transfer_stats_data.get("pending", {})
        if pending:
            self._pending[engine_idx].set(sum(pending.values()))


def read_metrics(llm: Any) -> dict[str, float]:
    """The connector's metrics from an ``LLM`` (made with ``disable_log_stats=False``), summed
    over engines: ``requests_<result>`` (:data:`RESULTS`), ``loaded_tokens_<tier>`` and
    ``late_miss_pages_<tier>`` (:data:`TIERS`), ``lossy_tokens_<encoding>`` (:data:`ENCODINGS`), ``failed_pages``, ``saved_pages``, ``failed_saves``,
    ``load_jobs``, ``load_seconds``, ``save_jobs``, ``save_seconds`` (sums) and
    ``pending_write_bytes``. Names never reported are absent."""
    names = {
        "vllm:dss_failed_pages": "failed_pages",
        "vllm:dss_saved_pages": "saved_pages",
        "vllm:dss_failed_saves": "failed_saves",
        "vllm:dss_pending_write_bytes": "pending_write_bytes",
    }
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name, labels = metric.name.removesuffix("_total"), metric.labels
        if name == "vllm:dss_requests":
            key = f"requests_{labels['result']}"
        elif name in ("vllm:dss_loaded_tokens", "vllm:dss_late_miss_pages"):
            key = f"{name.removeprefix('vllm:dss_')}_{labels['tier']}"
        elif name == "vllm:dss_lossy_tokens":
            key = f"lossy_tokens_{labels['encoding']}"
        elif name in ("vllm:dss_load_seconds", "vllm:dss_save_seconds"):
            kind = name.split("_")[1]
            out[f"{kind}_jobs"] = out.get(f"{kind}_jobs", 0) + metric.count
            out[f"{kind}_seconds"] = out.get(f"{kind}_seconds", 0.0) + metric.sum
            continue
        elif name in names:
            key = names[name]
        else:
            continue
        out[key] = out.get(key, 0) + metric.value
    return out
