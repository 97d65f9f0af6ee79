"""Page encodings: the precision a stored copy of a page keeps, and which loses more.

A page's bytes are saved ``exact`` (as the engine wrote them). A tier may be set to keep
its copies at a lower precision (``host_precision``, ``disk_precision``,
``remote_precision``; all ``exact`` by default): the copy is then encoded
(:mod:`dss.core.packing`) as it is written to or moved into that tier, and never gains
precision again by moving up. The encodings, least lossy first:

* ``exact`` — the engine's own bytes, served bit for bit;
* ``int8`` — keys and values as int8, one scale per token and KV head (absmax);
* ``fp8`` — keys and values as fp8 e4m3, one scale per token and KV head;
* ``k8v4`` — keys as ``int8``, values as int4 in groups of :data:`V_GROUP` along the head
  dimension, one scale per group.

The order is measured (KL divergence against the exact KV on SmolLM2, see
``benchmarks/precision.py``), not a promise for every model.
"""

from __future__ import annotations

from typing import NamedTuple

from dss.core.errors import ConfigError

ENCODINGS: tuple[str, ...] = ("exact", "int8", "fp8", "k8v4")
"""Every encoding, least lossy first: an encoding's position is its loss rank."""

EXACT = "exact"

CODE: dict[str, int] = {name: i for i, name in enumerate(ENCODINGS)}
"""An encoding's code in encoded page headers (its loss rank)."""

V_GROUP = 32
"""Values per int4 scale group along the head dimension (``k8v4``)."""


def check(name: str, setting: str = "precision") -> str:
    """``name`` if it is an encoding; else ``ConfigError`` naming ``setting`` and the choices."""
    if name not in CODE:
        raise ConfigError(f"{setting} must be one of {', '.join(ENCODINGS)}, got {name!r}")
    return name


def is_lossy(name: str) -> bool:
    """Whether a copy in this encoding differs from the saved bytes."""
    return name != EXACT


def lossier(a: str, b: str) -> str:
    """The lossier of two encodings (what a copy becomes when a copy in ``a`` moves to a tier
    set to ``b``: it never gains precision)."""
    return a if CODE[a] >= CODE[b] else b


class Precision(NamedTuple):
    """The encoding each tier keeps its copies in (every one ``exact`` by default)."""

    host: str = EXACT
    disk: str = EXACT
    remote: str = EXACT

    @property
    def is_exact(self) -> bool:
        """Whether every tier keeps the saved bytes."""
        return self.host == self.disk == self.remote == EXACT


EXACT_TIERS = Precision()
"""Every tier exact: the default."""
