"""Packing token ids: every accepted form gives the same bytes; everything else is refused."""

from __future__ import annotations

import array

import numpy as np
import pytest

from dss.core.errors import InvalidTokens
from dss.core.tokens import MAX_TOKEN, pack, unpack

EXPECTED = b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00"  # 1, 2**32-1, 256 little-endian


@pytest.mark.parametrize(
    "tokens",
    [
        [1, MAX_TOKEN, 256],
        (1, MAX_TOKEN, 256),
        array.array("I", [1, MAX_TOKEN, 256]),
        np.array([1, MAX_TOKEN, 256], dtype=np.uint32),
        np.array([1, MAX_TOKEN, 256], dtype=np.int64),
        np.array([1, MAX_TOKEN, 256], dtype=np.uint64),
        array.array("q", [1, MAX_TOKEN, 256]),
        [np.int64(1), MAX_TOKEN, 256],
    ],
    ids=["list", "tuple", "array-I", "uint32", "int64", "uint64", "array-q", "numpy-scalars"],
)
def test_accepted_forms_pack_identically(tokens: object) -> None:
    assert pack(tokens) == EXPECTED  # type: ignore[arg-type]
    assert unpack(EXPECTED) == [1, MAX_TOKEN, 256]


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([1, -1], "token 1 is -1"),
        ([1, MAX_TOKEN + 1], f"token 1 is {MAX_TOKEN + 1}"),
        ([1, 2.0], "token 1 is 2.0 (float)"),
        ([None], "token 0 is None"),
        (np.array([3, -4]), "token 1 is -4"),
        (np.array([1.5]), "integer dtype"),
        (np.zeros((2, 2), dtype=np.int32), "one-dimensional"),
        ([5, True], "token 1 is True (bool): ids must be integers"),
        ((False, 3), "token 0 is False (bool): ids must be integers"),
        ([True] * 3, "token 0 is True (bool)"),
        (np.array([True, False]), "integer dtype, got bool"),
        ("12", "not str"),
        (b"12", "not bytes"),
        (7, "not int"),
    ],
)
def test_bad_tokens_name_the_offender(tokens: object, message: str) -> None:
    with pytest.raises(InvalidTokens, match=message.replace("(", r"\(").replace(")", r"\)")):
        pack(tokens)  # type: ignore[arg-type]


def test_empty_inputs() -> None:
    assert pack([]) == pack(()) == pack(np.array([], dtype=np.int64)) == b""
