"""Shingles and their MinHash signatures: the pure computation under the LSH index (:mod:`dss.approx.lsh`).

Terms. A *shingle* is ``shingle_tokens`` consecutive tokens (a sequence shorter than that is
one shingle of all its tokens); a sequence is compared by the *set* of its shingles; the
Jaccard similarity of two sequences is ``|A ∩ B| / |A ∪ B|`` of those sets. A *signature* is
the MinHash of a set (datasketch's ``affine32`` scheme, ``permutations`` values), computed here
in one vectorised step from 32-bit shingle hashes keyed per namespace (so index contents say
nothing without the namespace's key, and an erased key makes any leftover unlinkable).

``datasketch`` is imported on first use only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from dss.core.errors import ConfigError

_P = np.uint64(0x100000001B3)
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def datasketch_module() -> Any:
    """The datasketch package (``ConfigError`` naming the extra when it is not installed)."""
    try:
        import datasketch
    except ImportError:
        raise ConfigError(
            "approximate matching (MinHash-LSH) needs the datasketch package: pip install 'dss-store[lsh]'"
        ) from None
    return datasketch


def shingles(tokens: np.ndarray, size: int) -> np.ndarray:
    """The distinct shingles of ``tokens`` as rows of ``size`` tokens (for tests and examples)."""
    if len(tokens) < size:
        return np.asarray([tokens]) if len(tokens) else np.zeros((0, size), np.uint32)
    rows = np.lib.stride_tricks.sliding_window_view(tokens, size)
    return np.unique(rows, axis=0)


def jaccard(a: np.ndarray, b: np.ndarray, size: int, salt: int = 0) -> float:
    """Exact Jaccard similarity of the shingle sets of two token arrays."""
    ha, hb = np.unique(shingle_hashes(a, size, salt)), np.unique(shingle_hashes(b, size, salt))
    if not len(ha) and not len(hb):
        return 1.0
    common = len(np.intersect1d(ha, hb, assume_unique=True))
    return common / (len(ha) + len(hb) - common)


def shingle_hashes(tokens: np.ndarray, size: int, salt: int = 0) -> np.ndarray:
    """A 32-bit hash of every shingle (in order; ``salt`` keys them per namespace)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, np.uint32)
    width = min(size, n)
    count = n - width + 1
    t = tokens.astype(np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(count, np.uint64(salt), np.uint64)
        for j in range(width):
            h = h * _P + t[j : j + count] + np.uint64(1)
        h = (h ^ (h >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)
        return (h ^ (h >> np.uint64(32))).astype(np.uint32)


class Signer:
    """MinHash signatures (datasketch ``affine32``) of hash arrays, whole and by slices."""

    def __init__(self, permutations: int) -> None:
        ds = datasketch_module()
        self._ds = ds
        proto = ds.MinHash(num_perm=permutations, seed=1, scheme="affine32")
        self.permutations = proto.permutations
        a, b = proto.permutations
        self._a = np.asarray(a, np.uint32)[:, None]
        self._b = np.asarray(b, np.uint32)[:, None]

    def permuted(self, hashes: np.ndarray) -> np.ndarray:
        """Every permutation of every hash: ``permutations`` rows, one column per hash (the
        signature of any run of hashes is the minimum of its columns)."""
        with np.errstate(over="ignore"):
            hv = hashes ^ (hashes >> np.uint32(16))
            hv = hv * _M1
            hv = hv ^ (hv >> np.uint32(13))
            hv = hv * _M2
            hv = hv ^ (hv >> np.uint32(16))
            return self._a * hv[None, :] + self._b

    def values(self, hashes: np.ndarray, bounds: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray | None]:
        """The signature of all ``hashes`` and, when ``bounds`` (slice starts, first 0) are
        given, one signature per slice (columns)."""
        return self.reduce(self.permuted(hashes), bounds)

    @staticmethod
    def reduce(phv: np.ndarray, bounds: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`values` of hashes already :meth:`permuted`."""
        starts = list(bounds)
        if starts and len(starts) > 1:
            parts = np.minimum.reduceat(phv, starts, axis=1)
            return parts.min(axis=1), parts
        return phv.min(axis=1), None

    @staticmethod
    def prefixes(phv: np.ndarray, ends: list[int]) -> np.ndarray:
        """The signatures of the first ``e`` hashes for each ``e`` of ``ends`` (ascending, each
        at least 1), as columns, from hashes already :meth:`permuted`."""
        if not ends:
            return np.zeros((phv.shape[0], 0), phv.dtype)
        parts = np.minimum.reduceat(phv[:, : ends[-1]], [0, *ends[:-1]], axis=1)
        return np.minimum.accumulate(parts, axis=1)

    def minhash(self, values: np.ndarray) -> Any:
        return self._ds.MinHash(hashvalues=values, permutations=self.permutations, scheme="affine32")


def prefix_ends(num_shingles: int, step: float, least: int) -> list[int]:
    """The shingle counts of the prompt prefixes a containment query asks for, ascending: the
    whole prompt's count divided by ``step``, ``step**2``, ... while at least ``least`` (the
    whole prompt is not among them)."""
    out: list[int] = []
    size = num_shingles / step
    while size >= least:
        end = int(size)
        if not out or end < out[-1]:
            out.append(end)
        size /= step
    return out[::-1]


def window_starts(num_tokens: int, window_tokens: int, page_tokens: int, shingle_tokens: int) -> list[int]:
    """Where the windows of a sequence start, as shingle indices (= token positions): page
    boundaries about ``window_tokens`` apart; ``[0]`` (the whole only) for a short sequence."""
    step = max(page_tokens, window_tokens - window_tokens % page_tokens)
    num_shingles = max(num_tokens - shingle_tokens + 1, 1)
    if num_tokens <= step:
        return [0]
    return [s for s in range(0, num_shingles, step)]
