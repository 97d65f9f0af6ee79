"""Sizes in bytes from what people write: ``512MiB``, ``2 GB``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2 GB"``, ``"1048576"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 1073741824, '512MiB' or '2GB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
