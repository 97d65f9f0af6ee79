"""The dss page layouts of a vLLM engine: what the bytes of one page (one KV block) mean.

A page is one vLLM KV-cache block of every layer with a KV cache a worker holds, in layer
order, each layer's block copied as opaque bytes exactly as the backend packed it. With
the hybrid KV cache manager a model's layers fall into several KV cache groups (full
attention, sliding window, state space), each with its own block table; a page still holds
every layer, each from its own group's block of the page's tokens. For a state-space
(Mamba) layer that block is the layer's state after the page's last token: the state vLLM
keeps at that block boundary (``mamba_cache_mode="align"``), padded by vLLM to the size of
an attention block. A page is thus everything a request needs to go on from its end, and
since a page is named by its tokens (chain hash), each version of a session — a rollback,
a branch — resumes from the state of exactly its own tokens.

Parallel workers hold different bytes of the same tokens, so each gets a layout of its own,
a **shard**: tensor-parallel ranks hold their KV heads (``tp_shard`` of ``tp_shards``; ranks
that hold identical KV, such as MLA or more ranks than KV heads, share one shard), and
pipeline stages hold their layers (``pp_rank`` of ``pp_size``). Shard ``pp_rank *
tp_shards + tp_shard`` is the index used everywhere in the connector; shard 0's layout is
the one sessions are created with.

On the CPU backend the packing depends on the attention ISA (``vec``, ``amx``, ...), so the
layout records it (and, for float KV of full-attention layers, the :data:`~dss_adapters.vllm.formats.CPU_PAGE_FORMAT`
that lets a lower-precision tier encode the pages), together with the model, its revision, dtypes, block size, layer kinds
and head shapes, the parallel configuration and the vLLM version: any change of them gives
another layout, and pages of another layout never match (a miss, never wrong KV).

The scheduler and the workers build the layouts independently, in different processes,
from the same configuration; everything here is deterministic for that reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dss_adapters.vllm.formats import page_fields
from dss_adapters.vllm.settings import Settings

import dss
from dss import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

LAYOUT_NAME = "vllm"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True, slots=True)
class PageLayer:
    """One layer of a page (attention or state space): its name and the KV cache group whose
    block table it uses."""

    name: str
    group: int


@dataclass(frozen=True, slots=True)
class Shards:
    """How the engine's KV is split over workers (see the module docstring)."""

    tp_size: int
    tp_shards: int
    pp_size: int

    @property
    def count(self) -> int:
        return self.tp_shards * self.pp_size

    def index(self, tp_rank: int, pp_rank: int) -> int:
        """The shard of a worker (``tp_rank`` in its stage, ``pp_rank``)."""
        return pp_rank * self.tp_shards + tp_rank // (self.tp_size // self.tp_shards)

    def is_saver(self, tp_rank: int) -> bool:
        """Whether this worker writes its shard (the first of the ranks that hold it)."""
        return tp_rank % (self.tp_size // self.tp_shards) == 0


def group_kinds(kv_cache_config: KVCacheConfig) -> list[str]:
    """Each KV cache group's kind: ``"full"``, ``"sliding:<window>"`` or ``"state:<type>"``
    (``ConfigError`` for others).

    Full attention (MLA included, and sliding-window layers that vLLM keeps whole when the
    hybrid manager is off), sliding-window and state-space groups are served. A state-space
    group (Mamba, linear attention: :class:`MambaSpec`) is served only in vLLM's
    ``mamba_cache_mode="align"`` (its prefix caching for such layers, on by default with
    ``enable_prefix_caching``), where vLLM keeps the state at block boundaries and hands
    them to connectors; its page part is the state after the page's last token.
    Speculative decoding with state-space layers, chunked local, cross and encoder-only
    attention are refused: their blocks do not hold a prompt's KV page by page.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kinds = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            kinds.append(f"sliding:{spec.sliding_window}")  # type: ignore[attr-defined]  # the type is checked
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec) and spec.attention_chunk_size is None:  # type: ignore[attr-defined]
            kinds.append("full")
        elif type(spec) is MambaSpec:
            _check_state_spec(spec)
            kinds.append(f"state:{getattr(spec.mamba_type, 'name', spec.mamba_type)}".lower())
        else:
            raise ConfigError(
                f"the dss connector does not support {_feature(spec)} (KV cache spec "
                f"{type(spec).__name__}); it serves full-attention, sliding-window and "
                "state-space (Mamba) layers"
            )
        if not group.enable_kv_transfer:
            raise ConfigError(
                f"the dss connector does not support KV cache groups that vLLM keeps out of KV "
                f"transfer ({type(spec).__name__})"
            )
    return kinds


def _check_state_spec(spec: Any) -> None:
    """``ConfigError`` unless vLLM keeps this state-space group's state at every block boundary."""
    if spec.mamba_cache_mode != "align":
        raise ConfigError(
            "the dss connector serves hybrid models with state-space (Mamba / linear-attention) layers only with "
            "vLLM's prefix caching for them (enable_prefix_caching=True, mamba_cache_mode='align': vLLM then keeps "
            f"the state at each block boundary); this engine runs mamba_cache_mode={spec.mamba_cache_mode!r}"
        )
    if spec.num_speculative_blocks:
        raise ConfigError("the dss connector does not support speculative decoding with state-space (Mamba) layers")
    if getattr(spec, "tokens_per_state", -1) not in (-1, spec.block_size):
        raise ConfigError(
            "the dss connector does not support state-space layers that keep a state every "
            f"{spec.tokens_per_state} tokens (it keeps one per block of {spec.block_size})"
        )


def _feature(spec: Any) -> str:
    """The model feature a KV cache spec stands for, in words."""
    name = type(spec).__name__
    if "Mamba" in name:
        return "hybrid models with state-space (Mamba / linear-attention) layers of this kind"
    if "ChunkedLocal" in name or getattr(spec, "attention_chunk_size", None):
        return "chunked local attention"
    if "Cross" in name or "Encoder" in name:
        return "encoder-decoder models (cross or encoder-only attention)"
    return f"{name} KV caches"


def attention_spec(kv_cache_config: KVCacheConfig) -> AttentionSpec | None:
    """The attention spec of the first attention group (the head shapes a layout records;
    ``None`` for a model of state-space layers only); ``ConfigError`` when the model is not
    served (see :func:`group_kinds`) or groups differ in block size or bytes per block
    (vLLM pads a state-space group's blocks to the attention block's bytes)."""
    kinds = group_kinds(kv_cache_config)
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    first = specs[0]
    for spec in specs[1:]:
        if (spec.block_size, spec.page_size_bytes) != (first.block_size, first.page_size_bytes):
            raise ConfigError("the dss connector needs KV blocks of one size and token count in every KV cache group")
    attention = [spec for spec, kind in zip(specs, kinds) if not kind.startswith("state:")]
    return attention[0] if attention else None  # type: ignore[return-value]


def layer_bytes(spec: Any) -> int:
    """The bytes of one block of one layer in a page: an attention block, or a state-space
    layer's state without the padding vLLM adds to its blocks."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return spec.state_content_size_bytes if isinstance(spec, MambaSpec) else spec.page_size_bytes


def state_groups(kv_cache_config: KVCacheConfig) -> list[int]:
    """The indexes of the state-space (Mamba) KV cache groups."""
    return [g for g, kind in enumerate(group_kinds(kv_cache_config)) if kind.startswith("state:")]


def page_layers(kv_cache_config: KVCacheConfig, names: set[str] | None = None) -> list[PageLayer]:
    """Layers with a KV cache in model order (by layer index, then name), each with its group:
    the order of a page's parts. ``names`` keeps only those layers (a pipeline stage's)."""
    layers = [
        PageLayer(name, g)
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
        if names is None or name in names
    ]
    return sorted(layers, key=lambda layer: _natural_key(layer.name))


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """Names of the layers with a KV cache, in model order."""
    return [layer.name for layer in page_layers(kv_cache_config)]


def engine_shards(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Shards:
    """The engine's shards; ``ConfigError`` for parallel layouts the connector does not serve."""
    parallel = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) not in (1, None):
            raise ConfigError(
                f"the dss connector does not support context parallelism ({name}="
                f"{getattr(parallel, name)}); it serves tensor and pipeline parallelism"
            )
    replicas = max(1, int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1))
    tp = parallel.tensor_parallel_size
    if replicas > 1 and any(
        not getattr(kv_cache_config.kv_cache_groups[g].kv_cache_spec, "tp_replicated", False)
        for g in state_groups(kv_cache_config)
    ):
        raise ConfigError(
            f"the dss connector does not support state-space layers sharded over {tp} tensor-parallel "
            f"ranks whose attention KV is replicated {replicas}x (ranks of one KV shard would hold "
            "different states)"
        )
    if tp % replicas:
        raise ConfigError(f"tensor_parallel_size={tp} is not a multiple of the KV replicas per shard ({replicas})")
    return Shards(tp, tp // replicas, parallel.pipeline_parallel_size)


def stage_layers(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, pp_rank: int) -> list[PageLayer]:
    """The attention layers pipeline stage ``pp_rank`` holds (every layer without pipeline parallelism)."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size == 1:
        return page_layers(kv_cache_config)
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.utils import extract_layer_index

    total = vllm_config.model_config.get_total_num_hidden_layers()
    start, end = get_pp_indices(total, pp_rank, pp_size)
    names = set()
    for layer in page_layers(kv_cache_config):
        try:
            index = extract_layer_index(layer.name)
        except (AssertionError, ValueError):
            raise ConfigError(
                f"cannot tell the pipeline stage of layer {layer.name!r}; the dss connector "
                "serves this model without pipeline parallelism only"
            ) from None
        if start <= index < end:
            names.add(layer.name)
    return page_layers(kv_cache_config, names)


def shard_layout(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    settings: Settings,
    shards: Shards,
    shard: int,
    layers: list[PageLayer],
) -> dss.Layout:
    """The layout of one shard's pages (see the module docstring).

    Raises ``ConfigError`` for models the connector cannot serve, and when
    ``settings.page_bytes`` is set and differs from this shard's page size.
    """
    import vllm
    from vllm.platforms import current_platform

    spec = attention_spec(kv_cache_config)
    kinds = group_kinds(kv_cache_config)
    block = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    page_bytes = _page_bytes(kv_cache_config, settings, layers)
    layer_kinds = [kinds[layer.group] for layer in layers]
    backend = attention_backend(vllm_config, spec) if spec is not None else "none"
    extra = page_fields(kv_cache_config, spec, backend, str(cache.cache_dtype), layer_kinds)
    return dss.Layout(
        LAYOUT_NAME,
        block.block_size,
        page_bytes,
        model=str(model.model),
        revision=settings.model_revision or model.revision or model_fingerprint(str(model.model)),
        dtype=str(model.dtype).removeprefix("torch."),
        kv_dtype=str(spec.dtype if spec is not None else block.dtypes[0]).removeprefix("torch."),  # type: ignore[attr-defined]
        kv_cache_dtype=str(cache.cache_dtype),
        num_layers=len(layers),
        attention="full" if set(layer_kinds) == {"full"} else ",".join(layer_kinds),
        num_kv_heads=spec.num_kv_heads if spec is not None else 0,
        head_size=spec.head_size if spec is not None else 0,
        head_size_v=getattr(spec, "head_size_v", spec.head_size) if spec is not None else 0,
        tp_size=shards.tp_size,
        tp_shard=shard % shards.tp_shards,
        pp_size=shards.pp_size,
        pp_rank=shard // shards.tp_shards,
        backend=backend,
        platform=str(current_platform.device_name),
        vllm=str(vllm.__version__),
        **extra,
    )


def engine_layouts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: Settings) -> list[dss.Layout]:
    """The layouts of pipeline stage 0's shards, by shard index: what the scheduler can tell from
    its own KV cache config (vLLM hands it stage 0's). Later stages' layouts come from their
    workers at start (:class:`ShardHandshake`)."""
    shards = engine_shards(vllm_config, kv_cache_config)
    layers = stage_layers(vllm_config, kv_cache_config, 0)
    return [
        shard_layout(vllm_config, kv_cache_config, settings, shards, tp_shard, layers)
        for tp_shard in range(shards.tp_shards)
    ]


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
    return (
        f"{current_platform.device_type}:{name}:{capability.major}.{capability.minor}"
        if capability
        else f"{current_platform.device_type}:{name}"
    )


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


def _page_bytes(kv_cache_config: KVCacheConfig, settings: Settings, layers: list[PageLayer]) -> int:
    """Bytes of a page of these layers; ``ConfigError`` when ``settings.page_bytes`` says otherwise."""
    groups = kv_cache_config.kv_cache_groups
    page_bytes = sum(layer_bytes(groups[layer.group].kv_cache_spec) for layer in layers)
    if settings.page_bytes is not None and settings.page_bytes != page_bytes:
        raise ConfigError(
            f"pages of this model have {page_bytes} bytes, but the dss connector is configured "
            f"with page_bytes={settings.page_bytes}"
        )
    return page_bytes


def shard_layouts(handshakes: Iterable[Any], expected: list[dss.Layout], num_shards: int) -> list[dss.Layout]:
    """Every shard's layout as its workers reported it (``handshakes``: each a ``shard`` and a
    ``layout`` dict); ``ConfigError`` when a shard is missing, its workers disagree, or one
    differs from the layout the scheduler computed (``expected``: the first shards')."""
    layouts: dict[int, dss.Layout] = {}
    for handshake in handshakes:
        layout = dss.Layout.from_dict(handshake.layout)
        if layouts.setdefault(handshake.shard, layout) != layout:
            raise ConfigError(f"the workers of dss shard {handshake.shard} disagree on its page layout")
    missing = sorted(set(range(num_shards)) - set(layouts))
    if missing:
        raise ConfigError(f"no worker reported the page layout of dss shard(s) {missing}")
    for shard, layout in enumerate(expected):
        if layouts[shard] != layout:
            raise ConfigError(
                f"the worker of dss shard {shard} has page layout {layouts[shard]}, the scheduler expects {layout}"
            )
    return [layouts[shard] for shard in range(num_shards)]
