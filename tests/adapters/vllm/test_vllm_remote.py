"""The dss connector on the remote tier: three nodes (three store folders, one PostgreSQL
catalog, one Redis), each a real vLLM CPU engine in turn.

``resume`` counts a page as matched on the remote tier when the catalog says another node
stored it, without asking Redis; its bytes are fetched and verified when the worker loads
it. A page Redis no longer holds (evicted, or a value that fails verification) is a late
miss: the worker reports its block, vLLM recomputes it, and the output is exactly that of
vLLM without dss.

q = 70 prompt tokens + 8 generated: node A computes it and saves pages 0-1 (64 tokens),
written through to Redis; node B loads both from Redis; then one key is deleted and the
other corrupted, and node C recomputes both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dss_adapters.vllm.metrics import read_metrics

import dss
from dss.tiers.remote import page_id_of
from tests import servers
from tests.engines import engine, generate, make_tiny_llama, prompt, run, tokens_out

Q = prompt(4, 70)
SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own (its keys are deleted afterwards)."""
    value = f"t{uuid.uuid4().hex[:10]}:"
    yield value
    servers.delete_prefix(redis_url, value)


def test_remote_pages_redis_no_longer_holds_are_late_misses_that_vllm_recomputes(
    model: Path, tmp_path: Path, pg_url: str, redis_url: str, prefix: str
) -> None:
    def node(name: str) -> dict[str, Any]:
        return {
            "store": tmp_path / name,
            "store_options": {
                "catalog_url": pg_url,
                "remote_url": redis_url,
                "remote_prefix": prefix,
                "node_id": f"node-{name}",
            },
        }

    with engine(model, prefix_caching=False) as llm:
        (plain,) = generate(llm, [Q])
    with engine(model, **node("a")) as llm:
        first = run(llm, Q, SESSION)
    client = servers.redis_client(redis_url)
    try:
        keys = sorted(client.scan_iter(match=f"{prefix}*"))
        assert len(keys) == 2  # written through when node A's store closed

        with engine(model, log_stats=True, **node("b")) as llm:
            from_remote = run(llm, Q, {**SESSION, "commit": False})
            on_b = read_metrics(llm)
        assert from_remote.kv_transfer_params["dss"] == {
            "session_id": "chat-1",
            "version_id": None,
            "loaded_tokens": 64,
            "engine_cached_tokens": 0,
            "result": "hit",
        }
        assert (on_b["loaded_tokens_remote"], on_b["late_miss_pages_remote"], on_b["failed_pages"]) == (64, 0, 0)

        with dss.open(
            tmp_path / "c", catalog_url=pg_url, remote_url=redis_url, remote_prefix=prefix, node_id="node-c"
        ) as store:  # node C, before its engine starts: both pages on the remote tier
            result = store.resume("chat-1", Q, tenant_id="t")
            assert (result.matched_tokens, result.tiers) == (64, {"remote": 64})
            page_ids = [bytes(ref.page_id) for ref in result.pages]
        by_page = {page_id_of(key): key for key in keys}
        client.delete(by_page[page_ids[0]])  # as if Redis had evicted it
        value = bytearray(client.get(by_page[page_ids[1]]))
        value[-1] ^= 0xFF  # a value that fails its checksum
        client.set(by_page[page_ids[1]], bytes(value))

        with engine(model, log_stats=True, **node("c")) as llm:
            late = run(llm, Q, {**SESSION, "commit": False})
            on_c = read_metrics(llm)
    finally:
        client.close()
    assert tokens_out(first) == tokens_out(from_remote) == tokens_out(late) == tokens_out(plain)
    assert late.kv_transfer_params["dss"] == {
        "session_id": "chat-1",
        "version_id": None,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    assert (on_c["late_miss_pages_remote"], on_c["failed_pages"], on_c["loaded_tokens_remote"]) == (2, 2, 0)
    assert (on_c["requests_miss"], on_c["requests_hit"]) == (1, 0)
    with dss.open(tmp_path / "c", catalog_url=pg_url, node_id="node-c") as store:
        assert store.check() == []
