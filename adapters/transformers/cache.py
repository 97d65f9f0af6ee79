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
from dss_adapters.dequantize import dequantize_into
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

    Every layer's keys and values are views of one ``[2 * layers, kv_heads, tokens,
    head_dim]`` tensor that the pages are written into once (:func:`pages_into`): on the CPU
    that tensor is the cache; elsewhere it is a buffer of ``staging`` (made for the call if
    not given; pass one to reuse its buffers across calls — its device is then the cache's),
    pinned on CUDA and copied to the device in one asynchronous copy on the pool's stream.
    Returns once the copies are complete. ``InvalidInput`` when a payload is neither an exact
    page of the layout nor an encoded copy of one.
    """
    from transformers import DynamicCache

    target = staging.device if staging is not None else torch.device(device)
    dtype = getattr(torch, layout.dtype)
    shape = (2 * layout.num_layers, layout.num_kv_heads, len(payloads), layout.page_tokens, layout.head_dim)
    if target.type == "cpu":
        kv = torch.empty(shape, dtype=dtype)
        pages_into(payloads, layout, kv)
    else:
        kv = _staged_to(staging if staging is not None else StagingPool(target), payloads, layout, shape)
    tokens = (1, layout.num_kv_heads, len(payloads) * layout.page_tokens, layout.head_dim)
    return DynamicCache(
        [(kv[2 * layer].view(tokens), kv[2 * layer + 1].view(tokens)) for layer in range(layout.num_layers)]
    )


def _staged_to(
    pool: StagingPool, payloads: Sequence[bytes], layout: dss.Layout, shape: tuple[int, ...]
) -> torch.Tensor:
    """The pages written into a buffer of ``pool`` (:func:`pages_into`), then copied to its
    device in one copy; returns once it is complete."""
    dtype = getattr(torch, layout.dtype)
    staged = pool.reserve(len(payloads), [layout.page_bytes])
    moved: list[torch.Tensor] = []

    def copy(staged: Staged) -> None:
        pages_into(payloads, layout, staged.parts[0].view(-1).view(dtype).view(shape))
        moved.append(staged.parts[0].to(pool.device, non_blocking=True, copy=True))

    pool.copy(staged, copy).wait()  # the buffer goes back to the pool, also when the pages are refused
    kv = moved[0].view(-1).view(dtype).view(shape)
    if pool.is_cuda:  # made on the pool's stream, used on the caller's
        kv.record_stream(torch.cuda.current_stream(pool.device))
    return kv


def pages_into(payloads: Sequence[bytes | memoryview], layout: dss.Layout, kv: torch.Tensor) -> None:
    """Write the pages into ``kv`` (``[2 * layers, kv_heads, pages, page_tokens, head_dim]`` of
    the layout's dtype; ``kv[2 * l]`` layer ``l``'s keys, ``kv[2 * l + 1]`` its values): an
    exact page's bytes copied as they are, an encoded copy (a tier's precision setting)
    dequantized straight into place (:func:`~dss_adapters.dequantize.dequantize_into`). ``InvalidInput`` when a payload is
    neither an exact page of the layout nor an encoded copy of one."""
    dtype = getattr(torch, layout.dtype)
    page = (2 * layout.num_layers, layout.num_kv_heads, layout.page_tokens, layout.head_dim)
    wide = None
    for k, parts in enumerate(_page_views(payloads, layout)):
        if parts is None:
            kv[:, :, k] = _tensor(np.frombuffer(payloads[k], dtype=np.uint8)).view(dtype).view(page)
            continue
        if wide is None:
            wide = torch.empty(layout.page_bytes // kv.element_size())  # float32, reused page after page
        dequantize_into(parts, kv[:, :, k], wide)


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


def _page_views(payloads: Sequence[bytes | memoryview], layout: dss.Layout) -> list[dss.Encoded | None]:
    """Each payload's encoded parts (:func:`dss.page_views`), ``None`` for an exact page;
    ``InvalidInput`` for a payload that is neither."""
    out: list[dss.Encoded | None] = []
    for i, payload in enumerate(payloads):
        try:
            out.append(dss.page_views(payload, layout))
        except dss.InvalidPage:
            raise InvalidInput(
                f"page {i} has {len(payload)} bytes; the layout's pages have {layout.page_bytes}"
            ) from None
    return out


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
