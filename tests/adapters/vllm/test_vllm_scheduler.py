"""Parts of the connector's scheduler side that need no engine: shard layouts learned at start,
the workers' host tiers it predicts, and configurations refused at start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dss_adapters.vllm.hosts import PAGE_OVERHEAD, WorkerHosts
from dss_adapters.vllm.layout import Shards, engine_shards
from dss_adapters.vllm.meta import ShardHandshake
from dss_adapters.vllm.scheduler import SchedulerSide
from dss_adapters.vllm.settings import Settings
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import dss

STAGE0 = dss.Layout("vllm", 32, 1024, model="m", pp_size=2, pp_rank=0)
STAGE1 = dss.Layout("vllm", 32, 1024, model="m", pp_size=2, pp_rank=1)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[dss.Store]:
    with dss.open(tmp_path / "store", host_bytes=10 * (1024 + PAGE_OVERHEAD)) as handle:
        yield handle


def scheduler(store: dss.Store, shards: Shards, layouts: list[dss.Layout], **options: object) -> SchedulerSide:
    return SchedulerSide(Settings.from_extra_config({"store": "unused", **options}), layouts, shards, 1, store)


def test_later_stages_layouts_come_from_their_workers_and_must_agree(store: dss.Store) -> None:
    side = scheduler(store, Shards(1, 1, 2), [STAGE0])
    assert side.layouts == [STAGE0]  # nothing is offered before the workers reported
    with pytest.raises(dss.ConfigError, match=r"no worker reported the page layout of dss shard\(s\) \[1\]"):
        side.take_handshakes([ShardHandshake(0, STAGE0.to_dict())])
    with pytest.raises(dss.ConfigError, match="the workers of dss shard 1 disagree on its page layout"):
        side.take_handshakes(
            [
                ShardHandshake(0, STAGE0.to_dict()),
                ShardHandshake(1, STAGE1.to_dict()),
                ShardHandshake(1, STAGE0.to_dict()),
            ]
        )
    with pytest.raises(dss.ConfigError, match="the worker of dss shard 0 has page layout"):
        side.take_handshakes([ShardHandshake(0, STAGE1.to_dict()), ShardHandshake(1, STAGE1.to_dict())])
    assert side.layouts == [STAGE0]
    side.take_handshakes([ShardHandshake(1, STAGE1.to_dict()), ShardHandshake(0, STAGE0.to_dict())])
    assert side.layouts == [STAGE0, STAGE1]


def test_synchronous_loads_are_refused_with_several_kv_cache_groups(store: dss.Store) -> None:
    with pytest.raises(dss.ConfigError, match="load_mode='sync' needs one KV cache group"):
        SchedulerSide(
            Settings.from_extra_config({"store": "unused", "load_mode": "sync"}), [STAGE0], Shards(1, 1, 1), 2, store
        )
    assert scheduler(store, Shards(2, 2, 1), [STAGE0, STAGE0], load_mode="sync").can_load_sync


def test_the_host_picture_is_a_bounded_lru_per_shard() -> None:
    """Capacity 3 pages per shard: page a is pushed out of shard 0 by b, c, d; a page counts as
    held only when every shard holds it."""
    hosts = WorkerHosts(2, 3 * (1024 + PAGE_OVERHEAD), 1024)
    hosts.note({0: [b"a", b"b", b"c"], 1: [b"A", b"B"]})
    assert hosts.num_held([[b"a", b"b"], [b"A", b"B"]]) == 2
    hosts.note({0: [b"a", b"d"]})  # a is used again, so b is the oldest and goes
    assert hosts.num_held([[b"a", b"b", b"d"], [b"A", b"B", b"A"]]) == 2
    assert hosts.num_held([[b"c"], [b"C"]]) == 0  # shard 1 does not hold C
    assert WorkerHosts(1, 0, 1024).num_held([[b"a"]]) == 0


def test_context_parallelism_is_refused_at_start() -> None:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], spec)])
    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=2,
        prefill_context_parallel_size=1,
    )
    with pytest.raises(
        dss.ConfigError,
        match=r"does not support context parallelism \(decode_context_parallel_size"
        r"=2\); it serves tensor and pipeline parallelism",
    ):
        engine_shards(SimpleNamespace(parallel_config=parallel), config)  # type: ignore[arg-type]
    parallel.decode_context_parallel_size = 1
    parallel.tensor_parallel_size = 4
    assert engine_shards(SimpleNamespace(parallel_config=parallel), config) == Shards(4, 4, 1)  # type: ignore[arg-type]


def test_a_request_that_finished_in_the_last_step_no_longer_counts_as_running(store: dss.Store) -> None:
    """A load admitted after the only running request finished stalls nobody (so ``auto`` may load
    synchronously); one admitted beside a request still running would stall it."""
    side = scheduler(store, Shards(1, 1, 1), [dss.Layout("vllm", 32, 1024, model="m")])
    step = SimpleNamespace(
        num_scheduled_tokens={"a": 1, "b": 1},
        total_num_scheduled_tokens=2,
        kv_connector_block_state=None,
        scheduled_spec_decode_tokens={},
    )
    side.build_meta(step)  # type: ignore[arg-type]
    assert side._running == {"a", "b"}
    assert side.finished(SimpleNamespace(request_id="a")) is None  # type: ignore[arg-type]
    assert side._running == {"b"}
    side.finished(SimpleNamespace(request_id="b"))  # type: ignore[arg-type]
    assert side._running == set()
