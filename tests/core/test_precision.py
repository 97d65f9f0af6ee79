"""Encoding names, their validation and their loss order."""

import pytest

from dss.core.errors import ConfigError
from dss.core.precision import CODE, ENCODINGS, check, is_lossy, lossier


def test_encodings_least_lossy_first() -> None:
    assert ENCODINGS == ("exact", "int8", "fp8", "k8v4")
    assert [CODE[name] for name in ENCODINGS] == [0, 1, 2, 3]


def test_check_names_the_setting_and_choices() -> None:
    assert check("int8") == "int8"
    with pytest.raises(ConfigError, match=r"^disk_precision must be one of exact, int8, fp8, k8v4, got 'int4'$"):
        check("int4", "disk_precision")


def test_lossy_and_lossier() -> None:
    assert not is_lossy("exact")
    assert is_lossy("int8") and is_lossy("k8v4")
    assert lossier("exact", "int8") == "int8"
    assert lossier("k8v4", "int8") == "k8v4"  # a k8v4 copy moving to an int8 tier stays k8v4
    assert lossier("fp8", "fp8") == "fp8"
