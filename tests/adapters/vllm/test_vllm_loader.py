"""The load path's guard: without a layout whose pages it dequantizes, the connector loads only
exact pages, so a page some tier keeps at a lower precision is a miss that vLLM recomputes,
never wrong KV; with one (vLLM's CPU format) such a page is loaded and counted as lossy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
from dss_adapters.vllm.loader import read_pages

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
