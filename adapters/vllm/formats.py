"""What the bytes of a vLLM page mean, where dss can tell: the format a layout records so
that a tier kept at a lower precision (``disk_precision``, ...) may encode its pages.

Only vLLM's CPU backend is described (the one this repository runs); the GPU backends'
packings stay opaque, their pages exact whatever the tiers' precision.
"""

from __future__ import annotations

from typing import Any

CPU_PAGE_FORMAT = "[layers][kv_heads][k,v]x[page_tokens*head_size]"
"""What a page's bytes are on vLLM's CPU backend (:data:`dss.core.packing.HEAD_FORMATS`):
each layer's block is ``[kv_heads, 2 * block_size, head_size]`` of the KV dtype, the first
``block_size * head_size`` elements of each head its keys, the rest its values (the backend
splits them so, ``cpu_attn.py``, whatever its ISA; within each, the ISA's own order). The
layout says so, so that a tier set to a lower precision can encode such pages."""


def is_cpu_kv(spec: Any, backend: str, cache_dtype: str, layer_kinds: list[str], state: str | None) -> bool:
    """Whether a shard's pages are :data:`CPU_PAGE_FORMAT`: the CPU backend's full-attention
    blocks of KV in the model's float dtype (not an fp8 cache), keys and values of one size."""
    return (
        spec is not None
        and backend.startswith("cpu:")
        and cache_dtype == "auto"
        and set(layer_kinds) == {"full"}
        and state is None
        and str(spec.dtype).removeprefix("torch.") in ("bfloat16", "float16", "float32")
        and getattr(spec, "head_size_v", spec.head_size) == spec.head_size
        and "MLA" not in type(spec).__name__
    )
