"""Encode a page's K and V bytes at a lower precision, and decode them back; vectorised numpy.

Only pages whose layout says what their bytes mean can be encoded: a layout with fields
``dtype`` (``bfloat16``, ``float16`` or ``float32``), ``num_layers``, ``num_kv_heads``,
``head_dim`` and a ``format`` of :data:`KV_FORMATS` — every layer's keys then values, each a
block of rows of ``head_dim`` contiguous elements, one row per (token, KV head) — or one of
:data:`HEAD_FORMATS` (vLLM's CPU backend: keys then values of each KV head of each layer,
rows of ``head_size`` contiguous elements in the backend's order). Any other page (opaque
engine packing, an fp8 engine cache) is stored as it is: :func:`shape_of` is ``None`` for
it. The scales are per row: for the first formats one per token and KV head.

An encoded copy is self-describing: a 20-byte header (format name ``dssq``, version, encoding
code, source dtype, parts, rows per part, head size) followed by the quantized elements, then
the scales (float16)::

    int8, fp8   [parts, rows, head_dim] int8 / e4m3   [parts, rows] scales
    k8v4        [layers, rows, head_dim] int8 keys    [layers, rows] key scales
                [layers, rows, head_dim / 2] int4 values, two per byte (low nibble first)
                [layers, rows, head_dim / group] value scales

An exact copy is the engine's bytes, unchanged (no header). Encoding refuses (``None``) a
page holding non-finite values or values beyond what a float16 scale can reach: it stays exact.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, cast

import ml_dtypes
import numpy as np

from dss.core.errors import InvalidPage
from dss.core.precision import CODE, ENCODINGS, EXACT, V_GROUP

KV_FORMATS = frozenset({"[layers][k,v]x[kv_heads,page_tokens,head_dim]"})
"""Page formats whose rows of ``head_dim`` elements alternate keys, values by layer."""
HEAD_FORMATS = frozenset({"[layers][kv_heads][k,v]x[page_tokens*head_size]"})
"""Page formats whose parts alternate keys, values by layer and KV head: each part
``page_tokens * head_size`` elements in an engine's own order within the part (vLLM's CPU
backend: keys column-major, values row-major), taken as ``page_tokens`` rows of ``head_size``
contiguous elements. A per-row absmax scale is valid whatever elements a row holds; only the
split into keys and values matters (``k8v4``)."""

MAGIC = b"dssq"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIII")
DTYPES: dict[str, Any] = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}
_DTYPE_NAME = {code: name for name, code in _DTYPE_CODE.items()}
_SCALE_MAX = 65504.0  # float16's largest
_F8 = ml_dtypes.float8_e4m3fn
_LIMIT = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
_REACH = {"int8": 127.0 * _SCALE_MAX, "fp8": 448.0 * _SCALE_MAX, "k8v4": 7.0 * _SCALE_MAX}
"""The largest magnitude each encoding reaches with a float16 scale (k8v4: its int4 values')."""


class PageShape(NamedTuple):
    """What an encodable page holds: ``num_parts`` blocks (keys, values of each layer) of
    ``rows`` rows of ``head_dim`` elements of ``dtype``."""

    dtype: str
    num_parts: int
    rows: int
    head_dim: int

    @property
    def exact_bytes(self) -> int:
        return self.num_parts * self.rows * self.head_dim * np.dtype(DTYPES[self.dtype]).itemsize


def shape_of(layout: Any) -> PageShape | None:
    """The shape of a layout's pages, or ``None`` when they cannot be encoded (see the module
    docstring): a layout of :data:`KV_FORMATS` (fields ``dtype``, ``num_layers``,
    ``num_kv_heads``, ``head_dim``) or of :data:`HEAD_FORMATS` (fields ``kv_dtype``,
    ``num_layers``, ``num_kv_heads``, ``head_size``), whose pages have exactly that many bytes."""
    fields = dict(layout.fields)
    fmt = fields.get("format")
    if fmt in KV_FORMATS:
        dtype, dim = fields.get("dtype"), fields.get("head_dim")
    elif fmt in HEAD_FORMATS:
        dtype, dim = fields.get("kv_dtype"), fields.get("head_size")
    else:
        return None
    sizes = (fields.get("num_layers"), fields.get("num_kv_heads"), dim)
    if dtype not in DTYPES or not all(type(n) is int and n > 0 for n in sizes):
        return None
    layers, heads, dim = cast("tuple[int, int, int]", sizes)
    if fmt in KV_FORMATS:
        shape = PageShape(dtype, 2 * layers, heads * layout.page_tokens, dim)
    else:
        shape = PageShape(dtype, 2 * layers * heads, layout.page_tokens, dim)
    return shape if shape.exact_bytes == layout.page_bytes else None


def group_of(head_dim: int) -> int | None:
    """Values per int4 scale group for this head size (``None``: ``k8v4`` cannot encode it)."""
    group = min(V_GROUP, head_dim)
    return group if head_dim % group == 0 and group % 2 == 0 else None


def encoded_size(shape: PageShape, encoding: str) -> int:
    """Bytes of a page of ``shape`` in ``encoding``."""
    n, rows, d = shape.num_parts, shape.rows, shape.head_dim
    if encoding == EXACT:
        return shape.exact_bytes
    if encoding in ("int8", "fp8"):
        return HEADER.size + n * rows * (d + 2)
    group = group_of(d) or d
    layers = n // 2
    return HEADER.size + layers * rows * (d + 2) + layers * rows * (d // 2 + 2 * (d // group))


def encode(payload: bytes | memoryview, shape: PageShape, encoding: str) -> bytes | None:
    """``payload`` (an exact page of ``shape``) in ``encoding``; the payload itself for ``exact``;
    ``None`` when this page cannot be encoded so (it then stays exact). Raises ``InvalidPage``
    when the payload is not a page of ``shape``."""
    if encoding == EXACT:
        return bytes(payload)
    if len(payload) != shape.exact_bytes:
        raise InvalidPage(f"a page of this layout has {shape.exact_bytes} bytes, not {len(payload)}")
    x = np.frombuffer(payload, dtype=DTYPES[shape.dtype]).reshape(shape.num_parts, shape.rows, shape.head_dim)
    x = x.astype(np.float32)
    if not np.isfinite(x).all() or np.abs(x).max(initial=0.0) > _REACH[encoding]:
        return None
    if encoding == "k8v4" and group_of(shape.head_dim) is None or encoded_size(shape, encoding) >= len(payload):
        return None  # k8v4 needs a groupable head; an encoding that saves nothing is not worth its loss
    head = HEADER.pack(MAGIC, VERSION, CODE[encoding], _DTYPE_CODE[shape.dtype], 0, *shape[1:])
    if encoding == "k8v4":
        keys, k_scales = _rows(x[0::2], "int8")
        values, v_scales = _int4(x[1::2], group_of(shape.head_dim) or shape.head_dim)
        return b"".join((head, keys.tobytes(), k_scales.tobytes(), values.tobytes(), v_scales.tobytes()))
    q, scales = _rows(x, encoding)
    return b"".join((head, q.tobytes(), scales.tobytes()))


def _scales(x: np.ndarray, limit: float) -> tuple[np.ndarray, np.ndarray]:
    """Float16 scales of ``x``'s last axis (absmax / ``limit``) and their safe float32 divisors."""
    scales = np.minimum(np.abs(x).max(axis=-1) / limit, _SCALE_MAX).astype(np.float16)
    wide = scales.astype(np.float32)
    return scales, np.where(wide > 0, wide, 1.0)[..., None]


def _rows(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``x`` quantized per row (int8 or e4m3) and its float16 scales."""
    limit = _LIMIT[kind]
    scales, divisor = _scales(x, limit)
    y = np.clip(x / divisor, -limit, limit)
    q = np.rint(y).astype(np.int8) if kind == "int8" else y.astype(_F8)
    return q, scales


def _int4(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as int4 in groups of ``group`` along its last axis, two per byte, and the scales."""
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scales, divisor = _scales(grouped, _LIMIT["int4"])
    q = (np.clip(np.rint(grouped / divisor), -7, 7).astype(np.int8) + 8).astype(np.uint8).reshape(x.shape)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scales


def header_of(payload: bytes | memoryview) -> tuple[str, PageShape] | None:
    """The encoding and shape of an encoded copy, or ``None`` for an exact one (any bytes that
    are not a well-formed encoded copy, whose length matches its header, are exact). Without
    the layout this is a sniff; :func:`decode`, given the page's shape, takes a payload of the
    exact size as exact whatever it begins with (no encoding ever has that size)."""
    if len(payload) < HEADER.size or bytes(payload[:4]) != MAGIC:
        return None
    _magic, version, code, dtype, _, parts, rows, dim = HEADER.unpack_from(payload)
    if version != VERSION or not 0 < code < len(ENCODINGS) or dtype not in _DTYPE_NAME or parts % 2:
        return None
    shape = PageShape(_DTYPE_NAME[dtype], parts, rows, dim)
    encoding = ENCODINGS[code]
    if len(payload) != encoded_size(shape, encoding):
        return None
    return encoding, shape


def encoding_of(payload: bytes | memoryview) -> str:
    """The encoding of a stored copy (``exact`` for the engine's own bytes)."""
    found = header_of(payload)
    return EXACT if found is None else found[0]


class Encoded(NamedTuple):
    """The parts of an encoded copy, as views of its bytes (nothing computed): ``q`` the
    quantized keys and values (``[parts, rows, head_dim]`` int8 or e4m3 bytes; for ``k8v4``
    the keys only, ``[layers, rows, head_dim]`` int8), ``scales`` their float16 scales
    (``[..., rows, 1]``); for ``k8v4`` also ``values`` (``[layers, rows, head_dim / 2]``, two
    int4 a byte, low nibble first, stored plus 8) and ``value_scales`` (``[layers, rows,
    head_dim / group, 1]``). An engine adapter dequantizes these with its own kernels."""

    encoding: str
    shape: PageShape
    q: np.ndarray
    scales: np.ndarray
    values: np.ndarray | None = None
    value_scales: np.ndarray | None = None


def views(payload: bytes | memoryview, shape: PageShape) -> Encoded | None:
    """The parts of ``payload`` when it is an encoded copy of a page of ``shape``; ``None``
    when it is exact (its size is the exact size). Raises ``InvalidPage`` otherwise."""
    if len(payload) == shape.exact_bytes:
        return None
    found = header_of(payload)
    if found is None:
        raise InvalidPage(f"a page of this layout has {shape.exact_bytes} bytes, not {len(payload)}")
    encoding, held = found
    if held != shape:
        raise InvalidPage(f"an encoded page of shape {tuple(held)} is not one of {tuple(shape)}")
    body = np.frombuffer(payload, dtype=np.uint8, offset=HEADER.size)
    n, rows, d = shape.num_parts // 2 if encoding == "k8v4" else shape.num_parts, shape.rows, shape.head_dim
    q = body[: n * rows * d].reshape(n, rows, d)
    at = n * rows * d + 2 * n * rows
    scales = body[n * rows * d : at].view(np.float16).reshape(n, rows, 1)
    if encoding != "k8v4":
        return Encoded(encoding, shape, q, scales)
    group = group_of(d) or d
    values = body[at : at + n * rows * d // 2].reshape(n, rows, d // 2)
    value_scales = body[at + n * rows * d // 2 :].view(np.float16).reshape(n, rows, d // group, 1)
    return Encoded(encoding, shape, q, scales, values, value_scales)


def decode(payload: bytes | memoryview, shape: PageShape) -> np.ndarray:
    """The page of ``shape`` a copy holds, as a ``[parts, rows, head_dim]`` array of the
    page's dtype: the payload itself (a view) when exact, dequantized otherwise (numpy, the
    reference; adapters may dequantize :func:`views` with their engine's kernels instead).
    Raises ``InvalidPage`` when the copy is not a page of ``shape``."""
    dtype = DTYPES[shape.dtype]
    parts = views(payload, shape)
    if parts is None:
        return np.frombuffer(payload, dtype=dtype).reshape(shape.num_parts, shape.rows, shape.head_dim)
    out = np.empty((shape.num_parts, shape.rows, shape.head_dim), dtype=dtype)
    kind = _F8 if parts.encoding == "fp8" else np.int8
    rows = out if parts.values is None else out[0::2]
    rows[...] = parts.q.view(kind).astype(np.float32) * parts.scales.astype(np.float32)
    if parts.values is not None and parts.value_scales is not None:
        out[1::2] = _int4_values(parts.values, parts.value_scales)
    return out


def _int4_values(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Float32 values of packed int4 groups (see :class:`Encoded`)."""
    layers, rows, half = packed.shape
    q = np.empty((layers, rows, 2 * half), dtype=np.int8)
    q[..., 0::2] = (packed & 0x0F).astype(np.int8) - 8
    q[..., 1::2] = (packed >> 4).astype(np.int8) - 8
    groups = scales.shape[2]
    grouped = q.reshape(layers, rows, groups, -1).astype(np.float32) * scales.astype(np.float32)
    return grouped.reshape(layers, rows, 2 * half)


def page_views(payload: bytes | memoryview, layout: Any) -> Encoded | None:
    """:func:`views` of a stored page of ``layout``: ``None`` when it is exact, its parts when
    it is an encoded copy; ``InvalidPage`` when it is neither."""
    if len(payload) == layout.page_bytes:
        return None
    shape = shape_of(layout)
    if shape is None:
        raise InvalidPage(f"page has {len(payload)} bytes; layout {layout.name!r} pages have {layout.page_bytes}")
    return views(payload, shape)


def decode_page(payload: bytes | memoryview, layout: Any) -> bytes | memoryview | np.ndarray:
    """A stored page of ``layout`` as the engine's own bytes: the payload itself when it is
    exact, else its copy dequantized into the layout's dtype (a ``uint8`` array of
    ``layout.page_bytes``). Raises ``InvalidPage`` when the payload is neither an exact page
    of the layout nor an encoded one of its shape."""
    if len(payload) == layout.page_bytes:
        return payload
    shape = shape_of(layout)
    if shape is None:
        raise InvalidPage(f"page has {len(payload)} bytes; layout {layout.name!r} pages have {layout.page_bytes}")
    return decode(payload, shape).view(np.uint8).reshape(-1)
