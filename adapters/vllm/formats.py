"""What the bytes of a vLLM page mean, where dss can tell: the format a layout records so
that a tier kept at a lower precision (``disk_precision``, ...) may encode its pages.

Only vLLM's CPU backend is described (the one this repository runs); the GPU backends'
packings stay opaque, their pages exact whatever the tiers' precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

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


def state_field(kv_cache_config: KVCacheConfig) -> str | None:
    """What a state-space group's block holds (shapes and dtypes of its state tensors), for the layout."""
    from vllm.v1.kv_cache_interface import MambaSpec

    parts = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            tensors = "+".join(
                f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}" for shape, dtype in zip(spec.shapes, spec.dtypes)
            )
            parts.append(f"{getattr(spec.mamba_type, 'name', spec.mamba_type)}[{tensors}]".lower())
    return ";".join(parts) or None


def page_fields(
    kv_cache_config: KVCacheConfig, spec: Any, backend: str, cache_dtype: str, layer_kinds: list[str]
) -> dict[str, Any]:
    """The layout's fields that say what a page's bytes are, where dss can tell: ``state``
    (:func:`state_field`) and ``format`` (:data:`CPU_PAGE_FORMAT`)."""
    state = state_field(kv_cache_config)
    fields: dict[str, Any] = {"state": state} if state is not None else {}
    if is_cpu_kv(spec, backend, cache_dtype, layer_kinds, state):
        fields["format"] = CPU_PAGE_FORMAT
    return fields
