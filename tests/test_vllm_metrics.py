"""The connector's metrics: counted by both connector sides, carried by vLLM's KV connector
stats, exposed by vLLM's Prometheus logger (what ``vllm serve`` serves at ``/metrics``) and
read from Python with :func:`dss_adapters.vllm_metrics.read_metrics`.

q = 70 prompt tokens + 8 generated: the KV of 77 tokens fills pages 0-1 (64 tokens), which a
second request of q loads (at most (70 - 1) // 32 = 2 pages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dss_adapters.vllm_metrics import DssConnectorStats, read_metrics

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
    assert (after_failure["loaded_tokens_disk"], after_failure["failed_pages"]) == (64, 1)
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
    assert total.data == {"counters": {"failed_pages": 3, "saved_pages": 3}, "latency": {"load": [0.25, 0.75]},
                          "pending": {"shard0": 0, "shard1": 50}}
    assert total.reduce() == {"failed_pages": 3, "saved_pages": 3, "load_jobs": 2, "load_avg_ms": 500.0,
                              "pending_write_bytes": 50}
    taken = total.take()
    assert taken is not None and taken.data["counters"] == {"failed_pages": 3, "saved_pages": 3}
    assert total.is_empty() and total.take() is None
