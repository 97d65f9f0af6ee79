"""The connector's worker side on real KV tensors and a real store, without an engine.

The engine tests (``test_vllm_connector.py`` and the others) cover the CPU backend's
layout end to end; here the copy paths are checked byte for byte: numpy views for
contiguous CPU caches (``[blocks, kv_heads, block_size, 2 * head_size]``, vLLM's CPU
layout), torch ops for any other layout (``[2, blocks, block_size, kv_heads, head_size]``,
the FlashAttention layout), the layer-by-layer path (run here on CPU tensors; on CUDA by
``tests/adapters/vllm/test_vllm_gpu.py``), asynchronous loads, several KV cache groups and shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dss_adapters.vllm.copy import BlockCopier
from dss_adapters.vllm.cuda import LayerwiseCopier
from dss_adapters.vllm.jobs import JobThread
from dss_adapters.vllm.layout import PageLayer
from dss_adapters.vllm.meta import NO_BLOCK, DssConnectorMetadata, DssWorkerMetadata, LoadJob, SaveJob
from dss_adapters.vllm.settings import Scope, Settings
from dss_adapters.vllm.worker import WorkerSide

import dss

NUM_BLOCKS, HEADS, BLOCK, HEAD = 8, 2, 32, 32
LAYER_BYTES = HEADS * BLOCK * 2 * HEAD * 4
LAYOUT = dss.Layout("vllm", BLOCK, 2 * LAYER_BYTES, model="test")
NAMES = ["model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn"]  # registered out of order
LAYERS = [PageLayer(NAMES[1], 0), PageLayer(NAMES[0], 0)]
TOKENS = list(range(10, 10 + 3 * BLOCK))
SCOPE = Scope("t", "u", None)
CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


def kv_caches(layout: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) if layout == "cpu" else (2, NUM_BLOCKS, BLOCK, HEADS, HEAD)
    return {name: torch.randn(shape, generator=generator).to(device) for name in NAMES}


def block_bytes(tensor: torch.Tensor, block: int) -> bytes:
    """The bytes of one block of one layer, the block dimension found as the worker finds it."""
    dim = list(tensor.shape).index(NUM_BLOCKS)
    return tensor.select(dim, block).contiguous().cpu().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[dss.Store]:
    handle = dss.open(tmp_path / "store")
    yield handle
    handle.close()


def make_worker(store: dss.Store, tmp_path: Path, layers: list[PageLayer] = LAYERS, **options: object) -> WorkerSide:
    return WorkerSide(
        Settings.from_extra_config({"store": str(tmp_path / "store")}), LAYOUT, store, layers, NUM_BLOCKS, **options
    )  # type: ignore[arg-type]


@pytest.fixture
def worker(store: dss.Store, tmp_path: Path) -> Iterator[WorkerSide]:
    side = make_worker(store, tmp_path)
    yield side
    side.close()


def stored_ids(store: dss.Store, count: int) -> list[bytes]:
    found = store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t")
    assert found.matched_tokens == count * BLOCK
    return [bytes(p.page_id) for p in found.pages]


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_blocks_saved_as_pages_load_back_into_other_blocks(
    worker: WorkerSide, store: dss.Store, layout: str, device: str
) -> None:
    """Whole-page copies on the CPU (numpy views or torch); on CUDA, the worker takes the
    layer-by-layer path for synchronous loads and saves (this test calls no per-layer hook,
    so every copy happens in ``start_load`` and ``save``)."""
    caches = kv_caches(layout, device)
    worker.register(caches)
    assert worker.copier is not None and (worker.copier.host_views is not None) == (layout == device == "cpu")
    assert (worker.layerwise is not None) == (device == "cuda")
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 0, [[5, 2]])]))
    worker.writer.flush()
    ids = stored_ids(store, 2)
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1}, {}, {0: ids})
    layer0, layer1 = caches[NAMES[1]], caches[NAMES[0]]
    assert store.read_pages(ids) == [
        block_bytes(layer0, 5) + block_bytes(layer1, 5),
        block_bytes(layer0, 2) + block_bytes(layer1, 2),
    ]

    before = {name: tensor.clone() for name, tensor in caches.items()}
    worker.start_load(DssConnectorMetadata(loads=[LoadJob("r2", [ids], [[7, 3]])]))
    for name in NAMES:
        worker.wait_for_layer(name)
    if device == "cuda":
        torch.cuda.current_stream().synchronize()
    for name, tensor in caches.items():
        assert block_bytes(tensor, 7) == block_bytes(before[name], 5)
        assert block_bytes(tensor, 3) == block_bytes(before[name], 2)
        untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 7)]
        assert all(block_bytes(tensor, b) == block_bytes(before[name], b) for b in untouched)
    assert worker.take_load_errors() == set()
    assert worker.num_pages_loaded == 2
    assert worker.take_worker_meta() == DssWorkerMetadata({}, {}, {0: ids})  # read pages are in its host tier


@pytest.mark.parametrize(
    ("layout", "device"), [("cpu", "cpu"), ("flash", "cpu"), pytest.param("flash", "cuda", marks=CUDA.marks)]
)
def test_an_asynchronous_load_is_done_in_the_background_and_reported_once(
    worker: WorkerSide, store: dss.Store, layout: str, device: str
) -> None:
    """Numpy views, or (``flash``) the staged torch path: plain memory on the CPU; on CUDA
    pinned buffers and asynchronous copies, a load reported done once its event completed."""
    caches = kv_caches(layout, device)
    worker.register(caches)
    assert worker.copier is not None and (worker.copier.staging is None) == (layout == "cpu")
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 0, [[5, 2]])]))
    worker.writer.flush()
    ids = stored_ids(store, 2)
    before = {name: tensor.clone() for name, tensor in caches.items()}
    worker.start_load(
        DssConnectorMetadata(
            loads=[
                LoadJob("r2", [ids], [[7, 3]], is_async=True),
                LoadJob("r3", [[ids[0], b"\x00" * 16]], [[4, 6]], is_async=True),
            ]
        )
    )
    assert worker.loader is not None
    worker.loader.wait_idle()
    assert worker.transfer_results(set()) == ({"r2", "r3"}, set())
    assert worker.transfer_results(set()) == (set(), set())
    assert worker.take_load_errors() == {6}  # r3's second page is in no tier: vLLM recomputes from block 6
    for name, tensor in caches.items():
        assert [block_bytes(tensor, b) for b in (7, 3, 4)] == [block_bytes(before[name], b) for b in (5, 2, 5)]
        assert block_bytes(tensor, 6) == block_bytes(before[name], 6)


@pytest.mark.parametrize("device", [CUDA])
def test_on_cuda_an_asynchronous_load_is_done_when_its_copies_are(
    worker: WorkerSide, store: dss.Store, device: str
) -> None:
    """The staging pool's stream is kept busy (``torch.cuda._sleep``, seconds of GPU time)
    before the load: the loader thread reads the pages and queues their copies behind it,
    and the load is not reported until the copies' event completed."""
    caches = kv_caches("flash", device)
    worker.register(caches)
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 0, [[5, 2]])]))
    worker.writer.flush()
    ids = stored_ids(store, 2)
    before = {name: tensor.clone() for name, tensor in caches.items()}
    assert worker.copier is not None and worker.copier.staging is not None and worker.loader is not None
    with torch.cuda.stream(worker.copier.staging.stream):
        torch.cuda._sleep(5_000_000_000)
    worker.start_load(DssConnectorMetadata(loads=[LoadJob("r2", [ids], [[7, 3]], is_async=True)]))
    JobThread.wait_idle(worker.loader)  # the job left the queue: its copies are queued
    assert worker.transfer_results(set()) == (set(), set())
    worker.loader.wait_idle()  # and done
    assert worker.transfer_results(set()) == ({"r2"}, set())
    for name, tensor in caches.items():
        assert [block_bytes(tensor, b) for b in (7, 3)] == [block_bytes(before[name], b) for b in (5, 2)]


def test_groups_use_their_own_blocks_and_skip_those_outside_the_window(store: dss.Store, tmp_path: Path) -> None:
    """Layer 0 is in group 0 (full attention), layer 1 in group 1 (sliding window): page k of a
    save is layer 0's block ``full[k]`` then layer 1's block ``window[k]``; a load skips layer
    1 where its block is ``NO_BLOCK``, and fails a page of a two-group model as a whole load."""
    worker = make_worker(store, tmp_path, [PageLayer(NAMES[1], 0), PageLayer(NAMES[0], 1)])
    caches = kv_caches("cpu")
    worker.register(caches)
    layer0, layer1 = caches[NAMES[1]], caches[NAMES[0]]
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 0, [[5, 2], [1, 4]])]))
    worker.writer.flush()
    ids = stored_ids(store, 2)
    assert store.read_pages(ids) == [
        block_bytes(layer0, 5) + block_bytes(layer1, 1),
        block_bytes(layer0, 2) + block_bytes(layer1, 4),
    ]
    before = {name: tensor.clone() for name, tensor in caches.items()}
    worker.start_load(
        DssConnectorMetadata(
            loads=[
                LoadJob("r2", [ids], [[7, 3], [NO_BLOCK, 6]], is_async=True),
                LoadJob("r3", [[b"\x00" * 16]], [[0], [0]], is_async=True),
            ]
        )
    )
    assert worker.loader is not None
    worker.loader.wait_idle()
    assert worker.transfer_results(set()) == ({"r2", "r3"}, {"r3"})
    assert worker.take_load_errors() == set()
    assert [block_bytes(layer0, b) for b in (7, 3)] == [block_bytes(before[NAMES[1]], b) for b in (5, 2)]
    assert block_bytes(layer1, 6) == block_bytes(before[NAMES[0]], 4)
    assert all(block_bytes(layer1, b) == block_bytes(before[NAMES[0]], b) for b in range(NUM_BLOCKS) if b != 6)
    worker.close()


def test_a_page_that_cannot_be_read_is_reported_and_the_steps_saves_are_dropped(
    worker: WorkerSide, store: dss.Store
) -> None:
    worker.register(kv_caches("cpu"))
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:32], 0, [[1]])]))
    worker.writer.flush()
    (stored,) = stored_ids(store, 1)
    missing = b"\x00" * 16  # a page the store does not hold, planned from the remote tier: a late miss there
    step = DssConnectorMetadata(
        loads=[LoadJob("r2", [[stored, missing]], [[4, 6]], tiers=["disk", "remote"])],
        saves=[SaveJob("r2", SCOPE, 0, TOKENS, 2, [[0]])],
    )
    worker.start_load(step)
    worker.save(step)
    assert worker.take_load_errors() == {6}
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1, "r2": 1}, {"r2": 2}, {0: [stored, stored]})
    stats = worker.take_stats()
    assert stats is not None and stats.data["counters"] == {
        "failed_pages": 1,
        "late_miss_pages_remote": 1,
        "saved_pages": 1,
    }
    worker.writer.flush()
    assert store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t").matched_tokens == 32


def test_saves_of_a_step_with_synchronous_loads_are_held_until_settled(store: dss.Store, tmp_path: Path) -> None:
    """With several workers, step 5's copies wait for the scheduler's word: written when it
    settles step 5 as sound, dropped (and reported) when it settles step 6 as failed."""
    worker = make_worker(store, tmp_path)
    worker.register(kv_caches("cpu"))
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:32], 0, [[1]])], step=5, hold_saves=True))
    assert worker.take_worker_meta() == DssWorkerMetadata({}, {}, {}, [5])
    worker.save(
        DssConnectorMetadata(
            saves=[SaveJob("r1", SCOPE, 32, TOKENS[32:64], 1, [[2]])], step=6, hold_saves=True, settled={5: False}
        )
    )
    worker.writer.flush()
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1}, {}, {0: stored_ids(store, 1)}, [6])
    worker.save(DssConnectorMetadata(step=7, settled={6: True}))
    assert worker.take_worker_meta() == DssWorkerMetadata({"r1": 1}, {"r1": 1}, {}, [])
    worker.close()
    assert store.lookup(TOKENS, layout=LAYOUT, user_id="u", tenant_id="t").matched_tokens == 32


def test_shards_past_the_first_save_outside_the_session_and_replicas_save_nothing(
    store: dss.Store, tmp_path: Path
) -> None:
    session = Scope("t", "u", "chat-1")
    other = make_worker(store, tmp_path, shard=1)
    replica = make_worker(store, tmp_path, shard=0, is_saver=False)
    for side in (other, replica):
        side.register(kv_caches("cpu"))
        side.save(DssConnectorMetadata(saves=[SaveJob("r1", session, 0, TOKENS[:32], 0, [[1]])]))
        side.close()
    assert other.take_worker_meta() == DssWorkerMetadata({"r1": 1}, {}, {1: stored_ids(store, 1)})
    assert replica.take_worker_meta() is None
    with pytest.raises(dss.UnknownSession):  # shard 1 never makes (or writes into) the session
        store.session("chat-1", tenant_id="t")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_layer_by_layer_copies_match_whole_page_copies(store: dss.Store, layout: str, device: str) -> None:
    """The layer-wise path gives the bytes of the whole-page path: on CUDA through pinned host
    buffers and copies on the load and save streams, each layer's load fenced by its event."""
    caches = kv_caches(layout, device)
    tensors = [caches[NAMES[1]], caches[NAMES[0]]]
    dim = list(tensors[0].shape).index(NUM_BLOCKS)
    tensors = [t.movedim(dim, 0) for t in tensors]
    copier = BlockCopier(tensors, [0, 1], NUM_BLOCKS, LAYOUT.page_bytes)
    layerwise = LayerwiseCopier(copier, [NAMES[1], NAMES[0]])
    assert (layerwise.load_stream is not None) == (device == "cuda")
    jobs = [[[5, 2], [1, 4]], [[6], [0]]]
    for name in (NAMES[1], "not.a.page.layer"):  # layer 1 is never reported: finish_saves copies it
        layerwise.save_layer(name, jobs)
    rows = layerwise.finish_saves(jobs)
    assert layerwise._buffers["save"].is_pinned() == (device == "cuda")
    assert rows.tobytes() == copier.gather([[5, 2, 6], [1, 4, 0]]).tobytes()
    store.save_pages(None, TOKENS, {i: rows[i].tobytes() for i in range(3)}, tenant_id="t", user_id="u", layout=LAYOUT)
    ids = stored_ids(store, 3)
    before = [t.clone() for t in tensors]
    outcome = layerwise.load(store, ids, [[7, 3, 4], [NO_BLOCK, 6, 2]])
    for name in (NAMES[1], NAMES[0]):
        layerwise.wait_layer(name)
    if device == "cuda":
        assert layerwise._load_events == {}  # every layer's event was waited for
        torch.cuda.current_stream().synchronize()
    assert (outcome.failed_pages, outcome.loaded_page_ids) == ([], ids)
    assert all(torch.equal(tensors[0][b], before[0][s]) for b, s in zip((7, 3, 4), (5, 2, 6)))
    assert all(torch.equal(tensors[1][b], before[1][s]) for b, s in zip((6, 2), (4, 0)))
    assert torch.equal(tensors[1][7], before[1][7])


def test_save_jobs_must_continue_the_tokens_the_worker_holds(worker: WorkerSide) -> None:
    worker.register(kv_caches("cpu"))
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:32], 0, [[1]])]))
    with pytest.raises(AssertionError, match="request r1: worker holds 32 tokens, scheduler assumed 0"):
        worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 1, [[2]])]))
    worker.transfer_results({"r1"})
    worker.save(DssConnectorMetadata(saves=[SaveJob("r1", SCOPE, 0, TOKENS[:64], 1, [[2]])]))


def test_kv_caches_that_do_not_make_the_layouts_page_are_refused(worker: WorkerSide) -> None:
    with pytest.raises(dss.ConfigError, match="a KV block of all 2 layers has 16384 bytes; the layout says 32768"):
        worker.register({name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD) for name in NAMES})
    with pytest.raises(dss.ConfigError, match=r"vLLM registered no KV cache for layers \['model.layers.0"):
        worker.register({NAMES[0]: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)})


@pytest.mark.parametrize("device", ["cpu", "strided", CUDA])
def test_a_state_space_layer_s_part_of_a_page_is_its_state_without_vllm_s_padding(device: str) -> None:
    """A Mamba layer's KV cache as vLLM views it: ``[blocks, 1, 1, state bytes]`` int8 over
    blocks padded to an attention block (stride ``LAYER_BYTES``). A page holds the attention
    block and the state's 40 bytes; a ``NO_BLOCK`` state (a page the request does not go on
    from) is not written. ``strided``: a CPU cache the numpy views cannot take (the torch path)."""
    generator = torch.Generator().manual_seed(1)
    on = "cuda" if device == "cuda" else "cpu"
    attention = torch.randn((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD), generator=generator).to(on)
    padded = torch.randint(-128, 128, (NUM_BLOCKS, LAYER_BYTES), dtype=torch.int8, generator=generator).to(on)
    state = padded[:, :40].view(NUM_BLOCKS, 1, 1, 40)
    if device == "strided":
        attention = attention.permute(0, 2, 1, 3)  # blocks not contiguous in memory: torch ops copy them
    copier = BlockCopier([attention, state], [0, 1], NUM_BLOCKS, LAYER_BYTES + 40)
    assert (copier.layer_sizes, copier.uniform) == ([LAYER_BYTES, 40], False)
    assert (copier.host_views is not None) == (device == "cpu")
    pages = copier.gather([[5, 2], [1, 4]])
    assert pages.shape == (2, LAYER_BYTES + 40)
    assert pages[0, LAYER_BYTES:].tobytes() == state[1].cpu().numpy().tobytes()
    assert pages[1, :LAYER_BYTES].tobytes() == attention[2].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    before, padding = [attention.clone(), state.clone()], padded[:, 40:].clone()
    copier.scatter([pages[0].tobytes(), pages[1].tobytes()], [[6, 7], [NO_BLOCK, 3]])
    assert torch.equal(attention[6], before[0][5]) and torch.equal(attention[7], before[0][2])
    assert torch.equal(state[3], before[1][4]) and torch.equal(state[6], before[1][6])
    assert torch.equal(padded[:, 40:], padding)  # vLLM's padding is never written
