"""The connector's worker side on real KV tensors and a real store, without an engine.

The engine tests (``test_vllm_connector.py``) cover the CPU backend's layout end to end;
here both copy paths are checked byte for byte: numpy views for contiguous CPU caches
(``[blocks, kv_heads, block_size, 2 * head_size]``, vLLM's CPU layout) and torch ops for any
other layout (``[2, blocks, block_size, kv_heads, head_size]``, the FlashAttention layout).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dss_adapters.vllm_meta import DssConnectorMetadata, DssWorkerMetadata, LoadJob, SaveJob
from dss_adapters.vllm_settings import Scope, Settings
from dss_adapters.vllm_worker import WorkerSide
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

import dss

NUM_BLOCKS, HEADS, BLOCK, HEAD = 8, 2, 32, 32
LAYER_BYTES = HEADS * BLOCK * 2 * HEAD * 4
LAYOUT = dss.Layout("vllm", BLOCK, 2 * LAYER_BYTES, model="test")
NAMES = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn"]  # registered out of order
TOKENS = list(range(10, 10 + 3 * BLOCK))
SCOPE = Scope("t", "u", None)


def kv_caches(layout: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) if layout == "cpu" else (2, NUM_BLOCKS, BLOCK, HEADS, HEAD)
    return {name: torch.randn(shape, generator=generator) for name in NAMES}


def block_bytes(tensor: torch.Tensor, block: int) -> bytes:
    """The bytes of one block of one layer, the block dimension found as the worker finds it."""
    dim = list(tensor.shape).index(NUM_BLOCKS)
    return tensor.select(dim, block).contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[dss.Store]:
    handle = dss.open(tmp_path / "store")
    yield handle
    handle.close()


@pytest.fixture
def worker(store: dss.Store, tmp_path: Path) -> Iterator[WorkerSide]:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    side = WorkerSide(Settings.from_extra_config({"store": str(tmp_path / "store")}), LAYOUT, store, config)
    yield side
    side.close()


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_blocks_saved_as_pages_load_back_into_other_blocks(worker: WorkerSide, store: dss.Store, layout: str) -> None:
    caches = kv_caches(layout)
    worker.register(caches)
    assert (worker._host_views is not None) == (layout == "cpu")
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 0, [5, 2])]))
    worker.writer.flush()
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1}, {})
    found = store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t")
    assert found.matched_tokens == 64
    pages = store.read_pages(found.pages)
    layer0, layer1 = caches[NAMES[1]], caches[NAMES[0]]
    assert pages == [block_bytes(layer0, 5) + block_bytes(layer1, 5), block_bytes(layer0, 2) + block_bytes(layer1, 2)]

    before = {name: tensor.clone() for name, tensor in caches.items()}
    worker.load(DssConnectorMetadata(loads=[LoadJob("r2", [p.page_id for p in found.pages], [7, 3])]))
    for name, tensor in caches.items():
        assert block_bytes(tensor, 7) == block_bytes(before[name], 5)
        assert block_bytes(tensor, 3) == block_bytes(before[name], 2)
        untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 7)]
        assert all(block_bytes(tensor, b) == block_bytes(before[name], b) for b in untouched)
    assert worker.take_load_errors() == set()
    assert worker.num_pages_loaded == 2


def test_a_page_that_cannot_be_read_is_reported_and_the_steps_saves_are_dropped(worker: WorkerSide,
                                                                              store: dss.Store) -> None:
    worker.register(kv_caches("cpu"))
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:32], 0, [1])]))
    worker.writer.flush()
    stored = store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t").pages[0].page_id
    step = DssConnectorMetadata(loads=[LoadJob("r2", [stored, b"\x00" * 16], [4, 6])],
                                saves=[SaveJob("r2", SCOPE, 0, TOKENS, 2, [0])])
    worker.load(step)
    worker.save(step)
    assert worker.take_load_errors() == {6}
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1, "r2": 1}, {"r2": 2})
    worker.writer.flush()
    assert store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t").matched_tokens == 32


def test_save_jobs_must_continue_the_tokens_the_worker_holds(worker: WorkerSide) -> None:
    worker.register(kv_caches("cpu"))
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:32], 0, [1])]))
    with pytest.raises(AssertionError, match="request r1: worker holds 32 tokens, scheduler assumed 0"):
        worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 1, [2])]))
    worker.forget({"r1"})
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 1, [2])]))


def test_kv_caches_that_do_not_make_the_layouts_page_are_refused(worker: WorkerSide) -> None:
    with pytest.raises(dss.ConfigError, match="a KV block of all 2 layers has 16384 bytes; the layout says 32768"):
        worker.register({name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD) for name in NAMES})
    with pytest.raises(dss.ConfigError, match=r"vLLM registered no KV cache for layers \['model.layers.0"):
        worker.register({NAMES[0]: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)})
