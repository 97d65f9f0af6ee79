"""The load path's guard: without a layout whose pages it dequantizes, the connector loads only
exact pages, so a page some tier keeps at a lower precision is a miss that vLLM recomputes,
never wrong KV; with one (vLLM's CPU format) such a page is loaded and counted as lossy. A
staged load from a real store puts every page read in its blocks, batch by batch, and leaves
the blocks of a page that fails verification alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from dss_adapters.vllm.copy import BlockCopier, RowBuffer
from dss_adapters.vllm.loader import load_pages, read_pages

import dss
from dss.core import packing

SHAPE = packing.PageShape("bfloat16", 4, 16, 32)


class Source:
    """A page source returning fixed payloads by page id."""

    def __init__(self, payloads: dict[bytes, bytes]) -> None:
        self.payloads = payloads

    def read_pages(self, pages: Sequence[bytes], *, into: Sequence[memoryview] | None = None) -> Sequence[Any]:
        return [self.payloads.get(p) for p in pages]


def test_a_page_kept_at_lower_precision_is_a_miss() -> None:
    exact = np.random.default_rng(0).standard_normal(4 * 16 * 32).astype(ml_dtypes.bfloat16).tobytes()
    lossy = packing.encode(exact, SHAPE, "int8")
    assert lossy is not None
    source = Source({b"a" * 16: exact, b"b" * 16: lossy, b"c" * 16: exact})
    rows, payloads, outcome = read_pages(source, [b"a" * 16, b"b" * 16, b"c" * 16], [[5, 6, 7]], "req-1")
    assert rows == [0, 2] and outcome.failed_pages == [1]
    assert [bytes(p) for p in payloads] == [exact, exact]
    assert outcome.loaded_page_ids == [b"a" * 16, b"c" * 16]


def test_with_an_encodable_layout_a_lower_precision_page_is_loaded_and_counted() -> None:
    """The copier dequantizes pages of an encodable layout: an encoded copy of one of its pages
    is kept (and listed in ``lossy_pages``); one of another shape is still a miss."""
    from dss_adapters.vllm.formats import CPU_PAGE_FORMAT

    import dss

    layout = dss.Layout(
        "vllm",
        16,
        4 * 16 * 32 * 2,
        format=CPU_PAGE_FORMAT,
        kv_dtype="bfloat16",
        num_layers=1,
        num_kv_heads=2,
        head_size=32,
    )
    assert packing.shape_of(layout) == SHAPE
    exact = np.random.default_rng(0).standard_normal(4 * 16 * 32).astype(ml_dtypes.bfloat16).tobytes()
    lossy = packing.encode(exact, SHAPE, "int8")
    other = packing.encode(exact, packing.PageShape("bfloat16", 2, 32, 32), "int8")
    assert lossy is not None and other is not None
    source = Source({b"a" * 16: exact, b"b" * 16: lossy, b"c" * 16: other})
    rows, payloads, outcome = read_pages(source, [b"a" * 16, b"b" * 16, b"c" * 16], [[5, 6, 7]], "req-1", layout)
    assert rows == [0, 1] and outcome.failed_pages == [2]
    assert [bytes(p) for p in payloads] == [exact, lossy]
    assert outcome.lossy_pages == {1: "int8"}


@pytest.mark.parametrize("even", [True, False])
def test_a_staged_load_puts_each_verified_page_in_its_blocks(tmp_path: Path, even: bool) -> None:
    """40 pages of 480 KiB (several disk reads), the last one's tag damaged on disk: the other 39
    land in their blocks of all three layers, whether the layers lie at even steps or not; the
    damaged page is a failed page whose blocks keep what they held."""
    num_blocks, shape = 48, (2, 32, 640)  # a layer's block: 160 KiB
    flat = torch.zeros(4 * num_blocks * int(np.prod(shape)))
    part = num_blocks * int(np.prod(shape))
    layers = [flat[i * part : (i + 1) * part].view(num_blocks, *shape) for i in (0, 1, 2 if even else 3)]
    copier = BlockCopier(layers, [0, 0, 0], num_blocks, 3 * 4 * int(np.prod(shape)))
    assert (copier.stacked is not None) == even
    layout = dss.Layout(name="staged", page_tokens=4, page_bytes=copier.page_bytes)
    pages = [np.random.default_rng(i).integers(0, 256, layout.page_bytes, dtype=np.uint8).tobytes() for i in range(40)]
    tokens = list(range(1, 161))
    with dss.open(tmp_path, master_key_file=tmp_path.parent / "key") as store:
        store.create_session("s", layout=layout)
        store.commit("s", tokens, dict(enumerate(pages)))
        ids = [bytes(ref.page_id) for ref in store.resume("s", tokens).pages]
    (segment,) = (tmp_path / "segments").iterdir()
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0x40  # the last page's tag
    segment.write_bytes(bytes(data))
    blocks = [[(7 + 11 * k) % num_blocks for k in range(40)]]
    with dss.open(tmp_path, master_key_file=tmp_path.parent / "key", host_bytes=0) as store:
        outcome = load_pages(store, copier, ids, blocks, "req-1", RowBuffer(layout.page_bytes))
    assert outcome.failed_pages == [39] and outcome.loaded_page_ids == ids[:39]
    got = [b"".join(layer[blocks[0][k]].numpy().tobytes() for layer in layers) for k in range(40)]
    assert got[:39] == pages[:39]
    assert got[39] == bytes(layout.page_bytes)  # zeros, as before the load
