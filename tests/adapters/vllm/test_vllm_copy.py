"""Staged pages into KV blocks on the CPU: one copy per layer for all of a load's pages
(:meth:`BlockCopier.scatter_rows`), or batch by batch as they are reported read
(:meth:`BlockCopier.feed`), byte for byte, ``NO_BLOCK`` layers left alone; the row buffer a load
reads into is reused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dss_adapters.vllm.copy import BlockCopier, RowBuffer, copy_layer
from dss_adapters.vllm.meta import NO_BLOCK

NUM_BLOCKS, LAYER_BYTES = 8, 2 * 32 * 16 * 4


def caches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn((NUM_BLOCKS, 2, 32, 16), generator=generator) for _ in range(2)]


def block(tensor: torch.Tensor, index: int) -> bytes:
    return tensor[index].contiguous().view(torch.uint8).numpy().tobytes()


def test_staged_rows_go_in_one_layer_at_a_time() -> None:
    layers = caches()
    before = [t.clone() for t in layers]
    copier = BlockCopier(layers, [0, 1], NUM_BLOCKS, 2 * LAYER_BYTES)
    rows = np.random.default_rng(1).integers(0, 256, (3, 2 * LAYER_BYTES), dtype=np.uint8)
    transfer = copier.scatter_rows(rows, [[4, 6, 1], [NO_BLOCK, 2, 3]])
    assert transfer.is_done()
    assert [block(layers[0], b) for b in (4, 6, 1)] == [rows[k, :LAYER_BYTES].tobytes() for k in range(3)]
    assert [block(layers[1], b) for b in (2, 3)] == [rows[k, LAYER_BYTES:].tobytes() for k in (1, 2)]
    untouched = [(0, b) for b in (0, 2, 3, 5, 7)] + [(1, b) for b in (0, 1, 4, 5, 6, 7)]
    assert all(torch.equal(layers[i][b], before[i][b]) for i, b in untouched)


def test_a_feed_copies_the_rows_reported_and_no_others() -> None:
    layers = caches()
    before = [t.clone() for t in layers]
    copier = BlockCopier(layers, [0, 1], NUM_BLOCKS, 2 * LAYER_BYTES)
    rows = np.random.default_rng(1).integers(0, 256, (5, 2 * LAYER_BYTES), dtype=np.uint8)
    feed = copier.feed(rows, [[4, 6, 1, 0, 7], [NO_BLOCK, 2, 3, 5, 6]])
    assert feed is not None
    feed.ready([1, 2])  # a run: copied from a view of the rows
    feed.ready([4, 0])  # out of order: gathered first
    feed.finish()
    assert [block(layers[0], b) for b in (4, 6, 1, 7)] == [rows[k, :LAYER_BYTES].tobytes() for k in (0, 1, 2, 4)]
    assert [block(layers[1], b) for b in (2, 3, 6)] == [rows[k, LAYER_BYTES:].tobytes() for k in (1, 2, 4)]
    untouched = [(0, b) for b in (0, 2, 3, 5)] + [(1, b) for b in (0, 1, 4, 5, 7)]  # row 3 never reported
    assert all(torch.equal(layers[i][b], before[i][b]) for i, b in untouched)


def test_a_copy_that_fails_in_the_feeds_thread_is_raised_by_finish() -> None:
    copier = BlockCopier(caches(), [0, 1], NUM_BLOCKS, 2 * LAYER_BYTES)
    feed = copier.feed(np.zeros((2, 2 * LAYER_BYTES), dtype=np.uint8), [[0, NUM_BLOCKS + 3], [1, 2]])
    assert feed is not None
    feed.ready([0, 1])
    with pytest.raises(IndexError):
        feed.finish()


def test_copy_layer_is_one_indexed_copy() -> None:
    cache = np.zeros((4, 3), dtype=np.uint8)
    rows = np.arange(12, dtype=np.uint8).reshape(2, 6)
    copy_layer(cache, np.array([3, 0]), rows[:, 3:6])
    assert cache.tolist() == [[9, 10, 11], [0, 0, 0], [0, 0, 0], [3, 4, 5]]


def test_the_row_buffer_is_reused_and_grows() -> None:
    buffer = RowBuffer(16)
    first = buffer.rows(3)
    assert first.shape == (3, 16) and first.dtype == np.uint8
    assert np.shares_memory(buffer.rows(2), first)
    grown = buffer.rows(5)
    assert grown.shape == (5, 16) and not np.shares_memory(grown, first)


def one_buffer(num_layers: int) -> list[torch.Tensor]:
    """Layers as vLLM allocates a CPU cache: views of one flat buffer, one after another."""
    flat = torch.zeros(num_layers * NUM_BLOCKS * LAYER_BYTES, dtype=torch.uint8)
    return [
        flat[i * NUM_BLOCKS * LAYER_BYTES : (i + 1) * NUM_BLOCKS * LAYER_BYTES]
        .view(torch.float32)
        .view(NUM_BLOCKS, 2, 32, 16)
        for i in range(num_layers)
    ]


def test_pages_go_in_and_out_whole_when_the_layers_lie_at_even_steps() -> None:
    """Three layers one after another in one buffer: a page is one copy in and out
    (``stacked``), with the same bytes where the same copies into layers at uneven steps (one
    copy per layer) put them."""
    stacked, flat = one_buffer(3), one_buffer(4)
    apart = [flat[0], flat[1], flat[3]]
    copiers = [BlockCopier(layers, [0, 0, 0], NUM_BLOCKS, 3 * LAYER_BYTES) for layers in (stacked, apart)]
    assert copiers[0].stacked is not None and copiers[1].stacked is None
    pages = np.random.default_rng(2).integers(0, 256, (3, 3 * LAYER_BYTES), dtype=np.uint8)
    payloads = [pages[0].tobytes(), memoryview(pages[1].tobytes()), pages[2].tobytes()]
    for copier in copiers:
        copier.scatter(payloads, [[5, NO_BLOCK, 2]])
    for i in range(3):
        assert stacked[i].numpy().tobytes() == apart[i].numpy().tobytes()
        assert block(stacked[i], 5) == pages[0, i * LAYER_BYTES : (i + 1) * LAYER_BYTES].tobytes()
        assert block(stacked[i], 2) == pages[2, i * LAYER_BYTES : (i + 1) * LAYER_BYTES].tobytes()
    assert all(not stacked[i][b].any() for i in range(3) for b in (0, 1, 3, 4, 6, 7))
    for copier in copiers:
        assert copier.gather([[2, 5]]).tolist() == [pages[2].tolist(), pages[0].tolist()]


def test_a_split_scatter_puts_the_same_bytes_as_one_thread() -> None:
    """Nine pages (over SPLIT_PAGES), one of them NO_BLOCK: copied half in the copier's thread,
    they land where one thread's copies put them, and the NO_BLOCK page nowhere."""
    alone, shared = one_buffer(3), one_buffer(3)
    copiers = [BlockCopier(layers, [0, 0, 0], NUM_BLOCKS, 3 * LAYER_BYTES) for layers in (alone, shared)]
    pages = np.random.default_rng(3).integers(0, 256, (9, 3 * LAYER_BYTES), dtype=np.uint8)
    payloads = [page.tobytes() for page in pages]
    blocks = [[6, 2, 7, NO_BLOCK, 0, 5, 1, 4, 3]]
    copiers[0].start_scatter(payloads, blocks)
    assert copiers[1].scatter_split(payloads, blocks).is_done()
    assert [t.numpy().tobytes() for t in shared] == [t.numpy().tobytes() for t in alone]
    assert [block(shared[2], b) for b in (6, 3)] == [pages[k, 2 * LAYER_BYTES :].tobytes() for k in (0, 8)]
    assert not any(pages[3, :LAYER_BYTES].tobytes() == block(shared[0], b) for b in range(NUM_BLOCKS))
    with pytest.raises(IndexError):
        copiers[1].scatter_split(payloads, [[NUM_BLOCKS + k for k in range(9)]])


def test_layers_at_uneven_steps_or_in_two_groups_are_copied_a_layer_at_a_time() -> None:
    flat = one_buffer(4)
    uneven = [flat[0], flat[1], flat[3]]
    assert BlockCopier(uneven, [0, 0, 0], NUM_BLOCKS, 3 * LAYER_BYTES).stacked is None
    assert BlockCopier(flat[:2], [0, 1], NUM_BLOCKS, 2 * LAYER_BYTES).stacked is None
    assert BlockCopier(flat[:1], [0], NUM_BLOCKS, LAYER_BYTES).stacked is not None


@pytest.mark.parametrize("whole", [True, False])
def test_encoded_copies_of_cpu_pages_are_dequantized_into_their_blocks_exact_ones_copied(whole: bool) -> None:
    """Pages of vLLM's CPU format (each layer's block ``[kv_heads, 2 * block_size, head_size]``:
    keys then values per head) at ``int8`` and ``k8v4`` go into their blocks as dss's numpy
    decoder gives them, bit for bit; an exact page goes in as it is, whether a page goes in
    whole (one block table) or a layer at a time (two). Without the format in the layout the
    copier dequantizes nothing (``decodes`` is ``None``)."""
    from dss_adapters.vllm.formats import CPU_PAGE_FORMAT

    import dss
    from dss.core import packing

    layers = [torch.zeros((NUM_BLOCKS, 2, 32, 32), dtype=torch.bfloat16) for _ in range(2)]  # 2 heads, head 16
    groups = [0, 0] if whole else [0, 1]
    page_bytes = 2 * layers[0][0].numel() * 2
    fields = {"kv_dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 16}
    layout = dss.Layout("vllm", 32, page_bytes, format=CPU_PAGE_FORMAT, **fields)
    assert (
        BlockCopier(layers, [0, 0], NUM_BLOCKS, page_bytes, dss.Layout("vllm", 32, page_bytes, **fields)).decodes
        is None
    )
    copier = BlockCopier(layers, groups, NUM_BLOCKS, page_bytes, layout)
    assert copier.decodes == layout and (copier.stacked is not None) == whole
    shape = packing.shape_of(layout)
    assert shape == packing.PageShape("bfloat16", 8, 32, 16)
    generator = torch.Generator().manual_seed(4)
    exact = [
        torch.randn(page_bytes // 2, generator=generator).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        for _ in range(3)
    ]
    stored = [exact[0], packing.encode(exact[1], shape, "int8"), packing.encode(exact[2], shape, "k8v4")]
    assert [dss.page_encoding(p) for p in stored] == ["exact", "int8", "k8v4"]  # type: ignore[arg-type]
    copier.scatter(stored, [[5, 0, 3]] * (1 if whole else 2))  # type: ignore[arg-type]
    half = page_bytes // 2
    for k, b in enumerate((5, 0, 3)):
        want = bytes(dss.decode_page(stored[k], layout))  # type: ignore[arg-type]
        assert block(layers[0], b) + block(layers[1], b) == want
    assert block(layers[0], 5) + block(layers[1], 5) == exact[0]
    assert block(layers[0], 0)[:half] != exact[1][:half]  # int8: close, not equal
