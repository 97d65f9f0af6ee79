"""Torch kernels that dequantize pages a tier keeps at a lower precision, straight into place.

A tier set to ``int8``, ``fp8`` or ``k8v4`` (``host_precision``, ``disk_precision``) keeps
encoded copies (:mod:`dss.core.packing`); an engine adapter gets their parts as views of
the payload (:func:`dss.page_views`) and turns them back into its KV dtype here, on the way
into the tensors its cache is made of — no intermediate page in the engine's dtype:

* :func:`dequantize_into` writes one page straight into a caller's tensor of any strides
  (the transformers adapter: its place in the cache's own tensor; the vLLM connector: a
  page-sized buffer whose layers are copied into their blocks as an exact page's are),
  through a float32 buffer of one page that stays in the CPU's cache and is reused page
  after page: widen, scale, narrow into place, three vectorised passes over all the
  page's layers;
* :func:`dequantize` is one page as a ``[parts, rows, head_dim]`` tensor (the reference the
  tests hold against dss's numpy decoder, bit for bit).

The arithmetic is the reference's: quantized value and scale widened to float32, multiplied
(exactly: at most 18 significant bits), rounded once into the engine's dtype. Measured on
one core for 127 pages of SmolLM2 (360K elements each), CPU time: 18 ms page by page
this way; 26 ms stacking all the pages' parts first (one more copy, and a fresh buffer of
the encoded size); about 10x slower with torch's one mixed-dtype multiply into a bfloat16
output, whose casts are not vectorised. Exact pages never come here: their bytes are copied
as they are. Shared by :mod:`dss_adapters.transformers.cache` and :mod:`dss_adapters.vllm.copy`.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

import dss

_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
"""Every e4m3 byte's value: a table look-up is twice as fast as torch's e4m3 cast on a CPU."""


def dequantize_into(parts: dss.Encoded, out: torch.Tensor, wide: torch.Tensor | None = None) -> None:
    """Write the encoded page ``parts`` (:func:`dss.page_views`) into ``out``: a tensor of
    ``[num_parts, *rows, head_dim]`` elements of the engine's dtype, any strides, its middle
    dimensions holding a part's ``rows`` rows (``[kv_heads, page_tokens]``, say). ``wide``:
    a float32 scratch tensor of at least a page's elements, reused across calls (made when
    not given). Reads the payload only; changes nothing but ``out`` and ``wide``."""
    shape = parts.shape
    n, rows, d = shape.num_parts, shape.rows, shape.head_dim
    if wide is None:
        wide = torch.empty(n * rows * d)
    page = wide[: n * rows * d].view(n, rows, d)
    q = _tensor(parts.q)
    if parts.values is None:  # int8, fp8: every part alike
        if parts.encoding == "int8":
            page.copy_(q.view(torch.int8))
        else:
            torch.index_select(_E4M3, 0, q.reshape(-1).long(), out=page.view(-1))
        page.mul_(_tensor(parts.scales).float())
    else:  # k8v4: int8 keys, int4 values in groups
        assert parts.value_scales is not None
        keys, values = page[0::2], page[1::2]
        keys.copy_(q.view(torch.int8))
        keys.mul_(_tensor(parts.scales).float())
        packed = _tensor(parts.values)  # [layers, rows, d/2], two int4 a byte, low nibble first, stored plus 8
        low, high = (packed & 0x0F).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
        scales = _tensor(parts.value_scales).float()  # [layers, rows, groups, 1]
        ints = torch.stack((low, high), dim=-1).reshape(*scales.shape[:3], -1)
        grouped = values.view(ints.shape)
        grouped.copy_(ints)
        grouped.mul_(scales)
    out.copy_(page.view(out.shape))


def dequantize(parts: dss.Encoded, dtype: torch.dtype) -> torch.Tensor:
    """An encoded page (:func:`dss.page_views`) as a ``[parts, rows, head_dim]`` tensor of ``dtype``."""
    shape = parts.shape
    out = torch.empty(shape.num_parts, shape.rows, shape.head_dim, dtype=dtype)
    dequantize_into(parts, out)
    return out


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only numpy view of a payload (only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
