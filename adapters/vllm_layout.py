"""The dss page layout of a vLLM engine: what the bytes of one page (one KV block) mean.

A page is one vLLM KV-cache block for every attention layer, in layer order, each layer's
block copied as opaque bytes exactly as the attention backend packed it. On the CPU
backend the packing depends on the attention ISA (``vec``, ``amx``, ...), so the layout
records it, together with the model, its revision, dtypes, block size, layer and head
shapes and the vLLM version: any change of them gives another layout, and pages of
another layout never match (a miss, never wrong KV).

The scheduler and the worker build the layout independently, in different processes, from
the same configuration; :func:`engine_layout` is deterministic for that reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dss_adapters.vllm_settings import Settings

import dss
from dss import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

LAYOUT_NAME = "vllm"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def attention_spec(kv_cache_config: KVCacheConfig) -> AttentionSpec:
    """The model's one KV spec, full attention (MLA included); ``ConfigError`` for anything else.

    Sliding-window, chunked-local and hybrid (Mamba) caches free or reuse blocks of old
    tokens, so a block table would not hold every page of a prompt.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ConfigError("the dss connector supports models whose KV cache is one group of full attention "
                          f"layers; this model has {len(groups)} group(s) of {', '.join(kinds)}")
    return spec  # type: ignore[return-value]


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """Attention layer names in model order (by layer index, then name): the order of a page's parts."""
    names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    return sorted(names, key=_natural_key)


def engine_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: Settings) -> dss.Layout:
    """The layout of this engine's pages (see the module docstring).

    Raises ``ConfigError`` for configurations the connector cannot serve (tensor or pipeline
    parallelism, hybrid KV caches) and when ``settings.page_bytes`` is set and differs.
    """
    import vllm
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConfigError("the dss connector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only")
    spec = attention_spec(kv_cache_config)
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    names = layer_names(kv_cache_config)
    page_bytes = spec.page_size_bytes * len(names)
    if settings.page_bytes is not None and settings.page_bytes != page_bytes:
        raise ConfigError(f"pages of this model have {page_bytes} bytes, but the dss connector is configured "
                          f"with page_bytes={settings.page_bytes}")
    dtype = str(spec.dtype).removeprefix("torch.")
    return dss.Layout(
        LAYOUT_NAME, spec.block_size, page_bytes,
        model=str(model.model),
        revision=settings.model_revision or model.revision or model_fingerprint(str(model.model)),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_dtype=dtype,
        kv_cache_dtype=str(cache.cache_dtype),
        num_layers=len(names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        head_size_v=getattr(spec, "head_size_v", spec.head_size),
        backend=attention_backend(vllm_config, spec),
        platform=str(current_platform.device_name),
        vllm=str(vllm.__version__),
    )


def attention_backend(vllm_config: VllmConfig, spec: AttentionSpec) -> str:
    """The backend that packs KV blocks: ``cpu:<isa>`` on CPU, else the configured backend
    (``auto`` when vLLM chooses; deterministic for one vLLM version, device and model)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype)
        return f"cpu:{isa}"
    backend = getattr(vllm_config.attention_config, "backend", None)
    name = getattr(backend, "name", backend) or "auto"
    capability = current_platform.get_device_capability()
    return f"{current_platform.device_type}:{name}:{capability.major}.{capability.minor}" if capability else \
        f"{current_platform.device_type}:{name}"


def model_fingerprint(model: str) -> str:
    """A digest of a local model folder's config and weight files (name, size, mtime).

    A hub id that is not a local folder gives ``"unpinned"``: set ``model_revision`` (or
    vLLM's ``revision``) when serving from a hub cache.
    """
    folder = Path(model)
    if not folder.is_dir():
        return "unpinned"
    digest = hashlib.blake2b(digest_size=12)
    for path in sorted(folder.iterdir()):
        if path.name == "config.json":
            digest.update(json.dumps(json.loads(path.read_text()), sort_keys=True).encode())
        elif path.suffix in _WEIGHT_SUFFIXES or path.name.endswith(".index.json"):
            stat = path.stat()
            digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return "local-" + digest.hexdigest()


def _natural_key(name: str) -> tuple[Any, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))
