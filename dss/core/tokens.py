"""Token sequences as packed buffers: validation and conversion.

dss compares token runs as bytes, never element by element in Python. Every token sequence
that enters the store is packed once into little-endian ``uint32`` bytes (4 bytes a token);
this module does that and refuses anything that is not a token id.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from dss.core.errors import InvalidTokens

TOKEN_BYTES = 4
MAX_TOKEN = (1 << 32) - 1

TokenInput = Sequence[int] | array.array | np.ndarray | memoryview
"""A list or tuple of ints (what engines pass), or a 1-D integer buffer (array, numpy)."""

_LITTLE = sys.byteorder == "little"
assert array.array("I").itemsize == TOKEN_BYTES, "dss needs a 4-byte C unsigned int"


def pack(tokens: TokenInput) -> bytes:
    """Pack token ids into little-endian uint32 bytes.

    Accepts a list or tuple of ints, an ``array.array`` or a 1-D integer numpy array (or
    anything numpy turns into one). Raises ``InvalidTokens`` naming the first offending
    element for a negative id, an id of 2**32 or more, or an element that is not an integer.
    Does not keep a reference to the input.
    """
    if isinstance(tokens, list):
        packed = array.array("I")
        try:
            packed.fromlist(tokens)
        except (TypeError, OverflowError):
            raise _explain(tokens) from None
        _refuse_bools(tokens, packed)
        return _to_bytes(packed)
    if isinstance(tokens, array.array) and tokens.typecode == "I":
        return _to_bytes(tokens)
    if isinstance(tokens, (str, bytes, bytearray)):
        raise InvalidTokens(f"tokens must be integer ids, not {type(tokens).__name__}")
    if isinstance(tokens, (np.ndarray, array.array, memoryview)):
        return _pack_array(np.asarray(tokens))
    if isinstance(tokens, tuple):
        try:
            packed = array.array("I", tokens)
        except (TypeError, OverflowError):
            raise _explain(tokens) from None
        _refuse_bools(tokens, packed)
        return _to_bytes(packed)
    if isinstance(tokens, Sequence):
        return pack(list(tokens))
    raise InvalidTokens(f"tokens must be a sequence of ints or an integer array, not {type(tokens).__name__}")


def view(tokens: TokenInput) -> bytes | memoryview:
    """Packed tokens for reading: a zero-copy view of a contiguous little-endian uint32
    array (numpy or ``array.array("I")``), else :func:`pack`'s bytes. Validates like ``pack``."""
    if (
        isinstance(tokens, np.ndarray)
        and tokens.dtype == np.dtype("<u4")
        and tokens.ndim == 1
        and tokens.flags.c_contiguous
    ):
        return tokens.data.cast("B")
    if isinstance(tokens, array.array) and tokens.typecode == "I" and _LITTLE:
        return memoryview(tokens).cast("B")
    return pack(tokens)


def unpack(buf: bytes) -> list[int]:
    """The token ids of a packed buffer, as a list of ints."""
    view = array.array("I")
    view.frombytes(buf)
    if not _LITTLE:
        view.byteswap()
    return view.tolist()


def num_tokens(buf: bytes) -> int:
    """How many tokens a packed buffer holds."""
    return len(buf) // TOKEN_BYTES


def _to_bytes(packed: array.array) -> bytes:
    if not _LITTLE:
        packed = array.array("I", packed)
        packed.byteswap()
    return packed.tobytes()


def _refuse_bools(tokens: Sequence[Any], packed: array.array) -> None:
    """``True`` and ``False`` pack as 1 and 0; refuse them. Only the elements that packed to
    0 or 1 are looked at, so a prompt pays one vectorised comparison, not a Python loop."""
    for i in np.flatnonzero(np.frombuffer(packed, dtype=np.uint32) <= 1).tolist():
        if type(tokens[i]) is bool:
            raise InvalidTokens(f"token {i} is {tokens[i]!r} (bool): ids must be integers")


def _pack_array(arr: np.ndarray) -> bytes:
    if arr.ndim != 1:
        raise InvalidTokens(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return b""
        raise InvalidTokens(f"tokens must have an integer dtype, got {arr.dtype}")
    if arr.size and (arr.dtype.kind == "i" or arr.dtype.itemsize > TOKEN_BYTES):
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high > MAX_TOKEN:
            bad = int(np.argmax((arr < 0) | (arr > MAX_TOKEN)))
            raise InvalidTokens(f"token {bad} is {int(arr[bad])}: ids must lie in [0, {MAX_TOKEN}]")
    return arr.astype("<u4", copy=False).tobytes()


def _explain(tokens: Sequence[Any]) -> InvalidTokens:
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            return InvalidTokens(f"token {i} is {token!r} ({type(token).__name__}): ids must be integers")
        if not 0 <= token <= MAX_TOKEN:
            return InvalidTokens(f"token {i} is {token}: ids must lie in [0, {MAX_TOKEN}]")
    return InvalidTokens("tokens must be integers in [0, 2**32)")
