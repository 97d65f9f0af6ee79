"""The connector's metrics: counted by both connector sides, carried by vLLM's KV connector
stats, exposed by vLLM's Prometheus logger (what ``vllm serve`` serves at ``/metrics``) and
read from Python with :func:`dss_adapters.vllm.metrics.read_metrics`.

q = 70 prompt tokens + 8 generated: the KV of 77 tokens fills pages 0-1 (64 tokens), which a
second request of q loads (at most (70 - 1) // 32 = 2 pages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dss_adapters.vllm.metrics import METRICS, RESULTS, TIERS, DssConnectorStats, DssPromMetrics, read_metrics
from dss_adapters.vllm.requests import decision_out, request_result

import dss
from tests.engines import corrupt_page, engine, generate, make_tiny_llama, prompt, tokens_out

Q = prompt(4, 70)
SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def test_metrics_follow_misses_hits_saves_and_failed_loads(model: Path, store_path: Path) -> None:
    from prometheus_client import REGISTRY, generate_latest

    with engine(model, store=store_path, log_stats=True) as llm:
        (first,) = generate(llm, [Q], params=[{"dss": SESSION}])
        after_miss = read_metrics(llm)
        llm.reset_prefix_cache()
        (second,) = generate(llm, [Q], params=[{"dss": SESSION}])  # waits for the first's pages
        after_hit = read_metrics(llm)
        exposition = generate_latest(REGISTRY).decode()
    assert tokens_out(first) == tokens_out(second)
    assert (after_miss["requests_miss"], after_miss["requests_hit"], after_miss["loaded_tokens_host"]) == (1, 0, 0)
    assert after_miss["load_jobs"] == 0
    # the first request's pages were written (one job of 2 pages) before the second was admitted
    assert (after_hit["saved_pages"], after_hit["save_jobs"], after_hit["failed_saves"]) == (2, 1, 0)
    assert after_hit["save_seconds"] > 0 and after_hit["pending_write_bytes"] == 0
    # ... by this worker: they are in its RAM, a synchronous host load
    assert (after_hit["requests_hit"], after_hit["loaded_tokens_host"], after_hit["loaded_tokens_disk"]) == (1, 64, 0)
    assert after_hit["load_jobs"] == 1 and after_hit["load_seconds"] > 0 and after_hit["failed_pages"] == 0
    assert 'vllm:dss_loaded_tokens_total{engine="0",model_name="' in exposition
    assert 'tier="host"} 64.0' in exposition and 'result="hit"} 1.0' in exposition

    with dss.open(store_path) as store:
        corrupt_page(store_path, store.resume("chat-1", Q, tenant_id="t").pages[1].page_id)
    with engine(model, store=store_path, log_stats=True) as llm:  # a fresh worker: pages on disk
        (third,) = generate(llm, [Q], params=[{"dss": SESSION}])
        after_failure = read_metrics(llm)
    assert tokens_out(third) == tokens_out(first)
    assert third.kv_transfer_params["dss"]["loaded_tokens"] == 32
    # 64 tokens planned from disk; page 1 failed its checksum: a late miss, recomputed by vLLM
    assert (after_failure["loaded_tokens_disk"], after_failure["late_miss_pages_disk"]) == (32, 1)
    assert (after_failure["failed_pages"], after_failure["requests_hit"]) == (1, 1)
    with dss.open(store_path) as store:  # page 1 was recomputed and saved again
        assert store.resume("chat-1", Q, tenant_id="t").matched_tokens == 64
        assert store.check() == []


def test_stats_of_several_workers_add_up_and_pending_bytes_are_per_worker() -> None:
    """Two workers' stats of one step, then the next step's: counters and latencies add up,
    the pending-bytes gauge keeps each worker's latest value and reports their sum."""
    rank0, rank1, later = DssConnectorStats(), DssConnectorStats(), DssConnectorStats()
    rank0.count("failed_pages", 1)
    rank0.observe("load", 0.25)
    rank0.set_pending("shard0", 100)
    rank1.count("failed_pages", 2)
    rank1.observe("load", 0.75)
    rank1.set_pending("shard1", 50)
    later.set_pending("shard0", 0)
    later.count("saved_pages", 3)
    total = rank0.aggregate(rank1).aggregate(later)
    assert total.data == {
        "counters": {"failed_pages": 3, "saved_pages": 3},
        "latency": {"load": [0.25, 0.75]},
        "pending": {"shard0": 0, "shard1": 50},
    }
    assert total.reduce() == {
        "failed_pages": 3,
        "saved_pages": 3,
        "load_jobs": 2,
        "load_avg_ms": 500.0,
        "pending_write_bytes": 50,
    }
    taken = total.take()
    assert taken is not None and taken.data["counters"] == {"failed_pages": 3, "saved_pages": 3}
    assert total.is_empty() and total.take() is None


def test_a_prompt_the_engines_own_cache_holds_counts_as_engine_reuse(model: Path, store_path: Path) -> None:
    """Two identical prompts in one warm engine: the second's 64 leading tokens are in vLLM's
    own prefix cache, and dss holds no more (the first request saved those same 2 pages), so
    dss has nothing to add: ``engine``, not ``miss``."""
    with engine(model, store=store_path, log_stats=True) as llm:
        (first,) = generate(llm, [Q], params=[{"dss": SESSION}])
        (second,) = generate(llm, [Q], params=[{"dss": {**SESSION, "commit": False}}])
        metrics = read_metrics(llm)
    assert tokens_out(first) == tokens_out(second)
    assert second.num_cached_tokens == 64
    assert first.kv_transfer_params["dss"] == {
        "session_id": "chat-1",
        "version_id": 1,
        "num_tokens": 78,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    assert second.kv_transfer_params["dss"] == {
        "session_id": "chat-1",
        "version_id": None,
        "loaded_tokens": 0,
        "engine_cached_tokens": 64,
        "result": "engine",
    }
    assert (metrics["requests_miss"], metrics["requests_engine"]) == (1, 1)
    assert (metrics["requests_hit"], metrics["load_jobs"]) == (0, 0)


@pytest.mark.parametrize(
    ("loaded", "engine_cached", "stored", "expected"),
    [
        (0, 0, 0, "miss"),  # neither had it
        (0, 0, 64, "miss"),  # dss had pages but loaded none (they failed to load, or recompute was cheaper)
        (64, 0, 64, "hit"),  # dss loaded them
        (32, 32, 64, "hit"),  # the engine held the first page, dss loaded the second
        (0, 64, 64, "engine"),  # the engine held all dss had
        (0, 64, 0, "engine"),  # the engine held tokens dss never stored
        (0, 32, 64, "miss"),  # dss held more than the engine but loaded none
    ],
)
def test_a_request_result_says_who_supplied_the_prompts_kv(
    loaded: int, engine_cached: int, stored: int, expected: str
) -> None:
    assert request_result(loaded, engine_cached, stored) == expected


def test_a_request_whose_pages_were_cheaper_to_recompute_counts_as_recompute() -> None:
    slower = dss.LoadDecision(False, 0.094, 0.010, 400_000.0)
    faster = dss.LoadDecision(True, 0.094, 1.0, 4000.0)
    assert request_result(0, 0, 4096, slower) == "recompute"
    assert request_result(0, 0, 4096, faster) == "miss"  # it was to load, and the load failed
    assert request_result(0, 4096, 4096, slower) == "engine"
    assert decision_out(slower) == {
        "load": False,
        "load_ms": 94.0,
        "recompute_ms": 10.0,
        "recompute_tokens_per_s": 400_000.0,
    }


def test_metrics_names_every_family_the_prometheus_side_registers() -> None:
    """``METRICS`` (what the Grafana dashboard must show, tests/test_deploy.py) is exactly the
    families :class:`DssPromMetrics` makes, and each result and tier has its labelled series."""
    from types import SimpleNamespace

    from prometheus_client import Counter, Gauge, Histogram

    made: dict[str, list[str]] = {}
    series: set[tuple[str, tuple[object, ...]]] = set()

    class Family:
        def __init__(self, name: str, labelnames: list[str], **_: object) -> None:
            self.name = name
            made[name] = labelnames

        def labels(self, *values: object) -> Family:
            series.add((self.name, values))
            return self

    DssPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        {Counter: Family, Gauge: Family, Histogram: Family},
        ["engine"],
        {0: ["0"]},
    )
    assert sorted(made) == sorted(METRICS)
    assert made["vllm:dss_requests_total"] == ["engine", "result"]
    assert made["vllm:dss_late_miss_pages_total"] == made["vllm:dss_loaded_tokens_total"] == ["engine", "tier"]
    assert {v for n, v in series if n == "vllm:dss_requests_total"} == {("0", r) for r in RESULTS}
    assert {v for n, v in series if n == "vllm:dss_late_miss_pages_total"} == {("0", t) for t in TIERS}


def test_a_prefill_faster_than_the_load_recomputes_and_says_so(model: Path, store_path: Path) -> None:
    """With a prefill speed set far above what any tier reads at, the second request's stored
    pages are recomputed, not loaded: its result is ``recompute``, its output carries the
    decision, the metrics count it."""
    with engine(model, store=store_path, log_stats=True, recompute_tokens_per_s=1e12) as llm:
        (first,) = generate(llm, [Q], params=[{"dss": SESSION}])
        llm.reset_prefix_cache()
        (second,) = generate(llm, [Q], params=[{"dss": {**SESSION, "commit": False}}])
        metrics = read_metrics(llm)
    assert tokens_out(first) == tokens_out(second)
    assert second.num_cached_tokens == 0
    params = second.kv_transfer_params["dss"]
    assert (params["loaded_tokens"], params["result"]) == (0, "recompute")
    assert params["decision"]["load"] is False and params["decision"]["recompute_tokens_per_s"] == 1e12
    assert params["decision"]["load_ms"] > params["decision"]["recompute_ms"]
    assert (metrics["requests_miss"], metrics["requests_recompute"], metrics.get("load_jobs", 0)) == (1, 1, 0)
