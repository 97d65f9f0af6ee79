"""Page encodings: sizes, hand-worked values, round trips, refusals and self-description."""

import ml_dtypes
import numpy as np
import pytest

import dss
from dss.core import packing
from dss.core.errors import InvalidPage
from dss.core.packing import HEADER, PageShape, decode, encode, encoded_size, encoding_of, header_of, shape_of

FORMAT = "[layers][k,v]x[kv_heads,page_tokens,head_dim]"


def kv_layout(dtype: str = "bfloat16", head_dim: int = 64, **extra: object) -> dss.Layout:
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}.get(dtype, 1)
    fields = {"dtype": dtype, "num_layers": 2, "num_kv_heads": 3, "head_dim": head_dim, "format": FORMAT, **extra}
    return dss.Layout("transformers", 4, 2 * 2 * 3 * 4 * head_dim * itemsize, **fields)


def page(shape: PageShape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((shape.num_parts, shape.rows, shape.head_dim)) * 3
    return x.astype(packing.DTYPES[shape.dtype])


HEADS = "[layers][kv_heads][k,v]x[page_tokens*head_size]"


def head_layout(kv_dtype: str = "bfloat16", page_bytes: int = 2 * 3 * 2 * 4 * 64 * 2) -> dss.Layout:
    """A vLLM CPU page: 2 layers, 3 KV heads, keys then values of each head (4 tokens of 64)."""
    fields = {"dtype": "bfloat16", "kv_dtype": kv_dtype, "num_layers": 2, "num_kv_heads": 3, "head_size": 64}
    return dss.Layout("vllm", 4, page_bytes, format=HEADS, **fields)


def test_shape_of_a_kv_layout() -> None:
    assert shape_of(kv_layout()) == PageShape("bfloat16", 4, 12, 64)


def test_shape_of_a_layout_by_head_has_a_part_per_layer_head_and_keys_or_values() -> None:
    """12 parts (2 layers x 3 heads x keys, values) of 4 rows of 64: the parts still alternate
    keys and values, so ``k8v4`` finds the keys at the even parts; the KV dtype is ``kv_dtype``."""
    assert shape_of(head_layout()) == PageShape("bfloat16", 12, 4, 64)
    assert shape_of(head_layout(kv_dtype="uint8", page_bytes=2 * 3 * 2 * 4 * 64)) is None  # an fp8 cache
    assert shape_of(head_layout(page_bytes=999)) is None


@pytest.mark.parametrize(
    "layout",
    [
        dss.Layout("opaque", 4, 6144),  # no fields: the engine's own packing
        kv_layout(format="vllm-flash"),  # a format whose rows dss does not know
        dss.Layout(
            "transformers", 4, 3072, dtype="float8_e4m3fn", num_layers=2, num_kv_heads=3, head_dim=64, format=FORMAT
        ),
        dss.Layout("transformers", 4, 999, dtype="bfloat16", num_layers=2, num_kv_heads=3, head_dim=64, format=FORMAT),
    ],
)
def test_pages_that_cannot_be_encoded(layout: dss.Layout) -> None:
    assert shape_of(layout) is None


def test_sizes() -> None:
    """bf16, head_dim 64: exact 128 bytes a row; int8/fp8 64 + a 2-byte scale; k8v4 keys 66,
    values 32 + two 2-byte group scales = 36. Over 48 rows (4 parts x 12) plus the header."""
    shape = PageShape("bfloat16", 4, 12, 64)
    assert encoded_size(shape, "exact") == 48 * 128
    assert encoded_size(shape, "int8") == HEADER.size + 48 * 66
    assert encoded_size(shape, "fp8") == HEADER.size + 48 * 66
    assert encoded_size(shape, "k8v4") == HEADER.size + 24 * 66 + 24 * 36


def test_int8_hand_worked() -> None:
    """A row [1.27, -0.635, 0, ...]: absmax 1.27, scale 0.01 (float16 0.01000213...),
    quantized 127, -63 (-63.49 rounds to -63), 0; decoded back within half a scale."""
    shape = PageShape("float32", 2, 1, 8)
    x = np.zeros((2, 1, 8), dtype=np.float32)
    x[0, 0, :4] = [1.27, -0.635, 0.0, 0.5]
    blob = encode(x.tobytes(), shape, "int8")
    assert blob is not None
    q = np.frombuffer(blob, dtype=np.int8, offset=HEADER.size, count=16)
    assert q.tolist() == [127, -63, 0, 50] + [0] * 12
    scales = np.frombuffer(blob, dtype=np.float16, offset=HEADER.size + 16)
    assert scales.tolist() == [np.float16(0.01), 0.0]
    assert np.allclose(decode(blob, shape), x, atol=0.005)


@pytest.mark.parametrize(
    ("encoding", "key_tol", "value_tol"),
    [("int8", 1 / 254, 1 / 254), ("fp8", 1 / 16, 1 / 16), ("k8v4", 1 / 254, 1 / 14)],
)
def test_round_trip_within_the_scale(encoding: str, key_tol: float, value_tol: float) -> None:
    """Every element decodes within half a quantization step of its row's (group's) absmax,
    up to the float16 scale and bf16 rounding."""
    shape = PageShape("bfloat16", 4, 12, 64)
    x = page(shape)
    blob = encode(x.tobytes(), shape, encoding)
    assert blob is not None and len(blob) == encoded_size(shape, encoding)
    assert encoding_of(blob) == encoding and header_of(blob) == (encoding, shape)
    y = decode(blob, shape)
    assert y.dtype == ml_dtypes.bfloat16 and y.shape == x.shape
    wide, back = x.astype(np.float32), y.astype(np.float32)
    amax = np.abs(wide).max(axis=-1, keepdims=True)
    for parity, tol in ((0, key_tol), (1, value_tol)):
        err = np.abs(back - wide)[parity::2]
        assert (err <= amax[parity::2] * tol * 1.02 + np.abs(wide[parity::2]) / 128).all()


def test_exact_is_the_bytes_themselves() -> None:
    shape = PageShape("float16", 4, 12, 64)
    raw = page(shape).tobytes()
    assert encode(raw, shape, "exact") == raw
    assert encoding_of(raw) == "exact"
    assert decode(raw, shape).tobytes() == raw


def test_non_finite_pages_stay_exact() -> None:
    shape = PageShape("float32", 2, 1, 8)
    x = np.zeros(16, dtype=np.float32)
    x[1] = np.inf
    assert encode(x.tobytes(), shape, "int8") is None
    y = np.zeros(16, dtype=np.float32)
    y[0] = 1e9  # beyond 127 x float16's largest scale
    assert encode(y.tobytes(), shape, "fp8") is None
    z = np.zeros(16, dtype=np.float32)
    z[8] = 1e6  # a value: int8's scale reaches it (127 x 65504), int4's does not (7 x 65504)
    assert encode(z.tobytes(), shape, "int8") is not None and encode(z.tobytes(), shape, "k8v4") is None


def test_k8v4_needs_a_groupable_head() -> None:
    shape = PageShape("float32", 2, 4, 5)
    assert (
        encode(np.ones(40, dtype=np.float32).tobytes(), shape, "k8v4") is None
    )  # an odd head cannot pair its int4 values
    assert encode(np.ones(40, dtype=np.float32).tobytes(), shape, "int8") is not None


def test_an_encoding_that_saves_nothing_is_not_used() -> None:
    """float32, head 4, one row a part: exact 2 x 16 = 32 bytes; int8 20 + 2 x 6 = 32."""
    shape = PageShape("float32", 2, 1, 4)
    assert encode(np.ones(8, dtype=np.float32).tobytes(), shape, "int8") is None


def test_an_exact_page_is_exact_whatever_it_begins_with() -> None:
    shape = PageShape("bfloat16", 4, 12, 64)
    raw = bytearray(page(shape).tobytes())
    raw[:4] = b"dssq"
    assert decode(bytes(raw), shape).tobytes() == bytes(raw)


def test_wrong_sizes_are_typed_errors() -> None:
    shape = PageShape("bfloat16", 4, 12, 64)
    with pytest.raises(InvalidPage, match="has 6144 bytes, not 10"):
        encode(b"0123456789", shape, "int8")
    with pytest.raises(InvalidPage, match="has 6144 bytes, not 10"):
        decode(b"0123456789", shape)
    other = PageShape("bfloat16", 4, 12, 32)
    blob = encode(page(other).tobytes(), other, "int8")
    assert blob is not None
    with pytest.raises(InvalidPage, match="is not one of"):
        decode(blob, shape)


def test_bytes_that_only_look_encoded_are_exact() -> None:
    shape = PageShape("bfloat16", 4, 12, 64)
    blob = encode(page(shape).tobytes(), shape, "int8")
    assert blob is not None
    assert encoding_of(blob[:-1]) == "exact"  # a length its header does not give
    assert encoding_of(b"dssq") == "exact"
