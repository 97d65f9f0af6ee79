"""dss pages for Hugging Face transformers: save a ``past_key_values`` cache, build one back.

For Llama-style decoder models (every layer full attention, one key and one value tensor
of ``[batch=1, kv_heads, tokens, head_dim]`` per layer, as in transformers 5's
``DynamicCache``). A page holds ``page_tokens`` tokens of every layer, laid out as
``[layers][k, v] × [kv_heads, page_tokens, head_dim]`` in the cache's dtype, C order::

    import dss
    from dss_adapters.transformers.cache import layout_for, save_cache, load_cache

    layout = layout_for(model, page_tokens=32)
    store.create_session("chat-1", user_id="u", tenant_id="t", layout=layout)
    out = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    tokens = out.sequences[0].tolist()
    save_cache(store, out.past_key_values, tokens, layout, session_id="chat-1", tenant_id="t")
    store.commit("chat-1", tokens, tenant_id="t")

    # later, maybe in another process: the next turn reuses the stored prefix
    r = store.resume("chat-1", next_tokens, tenant_id="t")
    cache, num_cached = load_cache(store, r, layout, limit=len(next_tokens) - 1)
    model.generate(torch.tensor([next_tokens]), past_key_values=cache, max_new_tokens=64)

The layout names the model (``config._name_or_path``), its revision (``revision=`` or the
hub commit transformers recorded), a digest of its config, the dtype and the shapes, so a
cache of another model, precision or configuration is a miss, never wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from dss_adapters.staging import Staged, StagingPool

import dss
from dss import InvalidInput

LAYOUT_NAME = "transformers"
PAGE_FORMAT = "[layers][k,v]x[kv_heads,page_tokens,head_dim]"


def layout_for(
    model: Any, *, page_tokens: int = 32, revision: str | None = None, dtype: torch.dtype | None = None
) -> dss.Layout:
    """The page layout of ``model``'s cache (``dtype`` defaults to the model's)."""
    config = model.config.get_text_config(decoder=True)
    num_layers = config.num_hidden_layers
    num_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if any(t not in (None, "full_attention") for t in getattr(config, "layer_types", None) or ()):
        raise InvalidInput("transformers_cache supports models whose layers are all full attention")
    dtype = dtype or model.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    settings = json.dumps(
        {k: v for k, v in config.to_dict().items() if not k.startswith("_")}, sort_keys=True, default=str
    )
    return dss.Layout(
        LAYOUT_NAME,
        page_tokens,
        num_layers * 2 * num_heads * page_tokens * head_dim * itemsize,
        model=str(getattr(config, "_name_or_path", "") or type(model).__name__),
        revision=revision or getattr(config, "_commit_hash", None) or "unpinned",
        config=hashlib.blake2b(settings.encode(), digest_size=12).hexdigest(),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=num_layers,
        num_kv_heads=num_heads,
        head_dim=head_dim,
        format=PAGE_FORMAT,
    )


def cache_pages(cache: Any, layout: dss.Layout, *, num_tokens: int | None = None) -> dict[int, bytes]:
    """Every full page of the first ``num_tokens`` tokens (default: all) the cache holds, by page index.

    Raises ``InvalidInput`` if the cache does not match the layout (layers, heads, head size,
    dtype) or holds more than one sequence. Does not change the cache.
    """
    keys, values = _tensors(cache, layout)
    held = keys[0].shape[2]
    count = min(held, held if num_tokens is None else num_tokens) // layout.page_tokens
    if count == 0:
        return {}
    span = count * layout.page_tokens
    # [layers, 2, heads, tokens, dim] -> [pages, layers, 2, heads, page_tokens, dim]
    stacked = torch.stack([torch.stack([k[0, :, :span], v[0, :, :span]]) for k, v in zip(keys, values)])
    shape = stacked.shape
    paged = stacked.reshape(*shape[:3], count, layout.page_tokens, shape[-1]).permute(3, 0, 1, 2, 4, 5)
    data = _as_bytes(paged.contiguous().cpu()).reshape(count, layout.page_bytes)
    return {i: data[i].tobytes() for i in range(count)}


def cache_from_pages(
    payloads: Sequence[bytes],
    layout: dss.Layout,
    *,
    device: str | torch.device = "cpu",
    staging: StagingPool | None = None,
) -> Any:
    """A ``DynamicCache`` holding the tokens of ``payloads`` (pages 0, 1, ... in order), on ``device``.

    The pages pass through ``staging`` (made for the call if not given; pass one to reuse its
    buffers across calls — its device is then the cache's): on CUDA a pinned host buffer,
    copied to the GPU asynchronously on the pool's stream, one copy per layer's keys or
    values; elsewhere plain memory. Returns once the copies are complete.
    """
    from transformers import DynamicCache

    pool = staging if staging is not None else StagingPool(device)
    count = len(payloads)
    dtype = getattr(torch, layout.dtype)
    heads, dim, pt = layout.num_kv_heads, layout.head_dim, layout.page_tokens
    exact = _exact_pages(payloads, layout)
    part = layout.page_bytes // (2 * layout.num_layers)
    staged = pool.stage(exact, [(j * part, part) for j in range(2 * layout.num_layers)])
    moved: list[torch.Tensor] = []

    def copy(staged: Staged) -> None:  # [pages, heads, page_tokens, dim] -> [1, heads, tokens, dim]
        for host in staged.parts:
            tensor = host.to(pool.device, non_blocking=True, copy=True).view(dtype).view(count, heads, pt, dim)
            moved.append(tensor.permute(1, 0, 2, 3).reshape(1, heads, count * pt, dim).contiguous())

    pool.copy(staged, copy).wait()
    if pool.is_cuda:  # made on the pool's stream, used on the caller's
        for tensor in moved:
            tensor.record_stream(torch.cuda.current_stream(pool.device))
    return DynamicCache([(moved[2 * layer], moved[2 * layer + 1]) for layer in range(layout.num_layers)])


def save_cache(
    store: dss.Store,
    cache: Any,
    tokens: Sequence[int],
    layout: dss.Layout,
    *,
    session_id: str | None = None,
    tenant_id: str = "default",
    user_id: str = "anonymous",
) -> int:
    """Save the cache's full pages of ``tokens`` to the session (or, without one, to the namespace).

    The session must exist with ``layout``. Returns how many pages were new to the store.
    """
    pages = cache_pages(cache, layout, num_tokens=len(tokens))
    if session_id is None:
        return store.save_pages(None, tokens, pages, tenant_id=tenant_id, user_id=user_id, layout=layout).num_new
    return store.save_pages(session_id, tokens, pages, tenant_id=tenant_id).num_new


def load_cache(
    store: dss.Store,
    result: dss.ResumeResult,
    layout: dss.Layout,
    *,
    limit: int | None = None,
    device: str | torch.device = "cpu",
    staging: StagingPool | None = None,
) -> tuple[Any, int]:
    """The cache of the leading pages of a ``resume``/``lookup`` result, and how many tokens it holds.

    Reads at most ``limit`` tokens' pages (pass ``len(tokens) - 1`` so the model still has
    a token to compute); stops at the first page the store cannot return. Returns
    ``(None, 0)`` when nothing could be loaded. ``device``, ``staging``: see :func:`cache_from_pages`.
    Pages a tier keeps at a lower precision are dequantized into the layout's dtype (the
    result's ``encodings`` says how many tokens are approximate).
    """
    if result.page_bytes != layout.page_bytes or result.page_tokens != layout.page_tokens:
        raise InvalidInput("the resume result has another page size than the layout")
    count = result.matched_tokens // layout.page_tokens
    if limit is not None:
        count = min(count, max(limit, 0) // layout.page_tokens)
    payloads = store.read_pages(result.pages[:count]) if count else []
    good: list[bytes] = []
    for payload in payloads:
        if payload is None:
            break
        good.append(payload)
    if not good:
        return None, 0
    return cache_from_pages(good, layout, device=device, staging=staging), len(good) * layout.page_tokens


def _exact_pages(payloads: Sequence[bytes], layout: dss.Layout) -> list[bytes | np.ndarray]:
    """Each payload as the layout's own bytes: exact ones as they are, lower-precision copies
    (a tier's precision setting) dequantized with torch into the layout's dtype on their way
    to staging."""
    out: list[bytes | np.ndarray] = []
    dtype = getattr(torch, layout.dtype)
    for i, payload in enumerate(payloads):
        try:
            parts = dss.page_views(payload, layout)
        except dss.InvalidPage:
            raise InvalidInput(
                f"page {i} has {len(payload)} bytes; the layout's pages have {layout.page_bytes}"
            ) from None
        out.append(payload if parts is None else dequantize(parts, dtype).view(torch.uint8).reshape(-1).numpy())
    return out


def dequantize(parts: dss.Encoded, dtype: torch.dtype) -> torch.Tensor:
    """An encoded page (:func:`dss.page_views`) as a ``[parts, rows, head_dim]`` tensor of ``dtype``."""
    shape = parts.shape
    out = torch.empty(shape.num_parts, shape.rows, shape.head_dim, dtype=dtype)
    q = _tensor(parts.q)
    q = _E4M3[q.long()] if parts.encoding == "fp8" else q.view(torch.int8)
    scales = _tensor(parts.scales).float()
    if parts.values is None or parts.value_scales is None:
        torch.mul(q, scales, out=out)
        return out
    out[0::2] = q * scales
    packed = _tensor(parts.values)
    low, high = (packed & 0x0F).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    value_scales = _tensor(parts.value_scales).float()
    ints = torch.stack((low, high), dim=-1).reshape(*value_scales.shape[:3], -1)
    out[1::2] = (ints * value_scales).reshape(out[1::2].shape)
    return out


_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
"""Every e4m3 byte's value: a table look-up is twice as fast as torch's e4m3 cast on a CPU."""


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only numpy view of a payload (only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _tensors(cache: Any, layout: dss.Layout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise InvalidInput(f"expected a transformers Cache with .layers, not {type(cache).__name__}")
    if len(layers) != layout.num_layers:
        raise InvalidInput(f"the cache has {len(layers)} layers; the layout {layout.num_layers}")
    keys = [layer.keys for layer in layers]
    values = [layer.values for layer in layers]
    want = (1, layout.num_kv_heads, layout.head_dim)
    for tensor in keys + values:
        if tensor is None or tensor.dim() != 4 or (tensor.shape[0], tensor.shape[1], tensor.shape[3]) != want:
            raise InvalidInput(f"cache tensors must be [1, {layout.num_kv_heads}, tokens, {layout.head_dim}]")
        if str(tensor.dtype).removeprefix("torch.") != layout.dtype:
            raise InvalidInput(f"cache dtype {tensor.dtype} is not the layout's {layout.dtype}")
    return keys, values


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a uint8 numpy array (any dtype, bf16 included)."""
    return tensor.view(-1).view(torch.uint8).numpy()
