"""Published block-hash traces in the Mooncake format (``benchmarks/traces/``): plain data for
``benchmarks/tiers.py`` to replay as prefix lookups.

A trace is one request per line: ``timestamp`` (milliseconds), ``input_length``,
``output_length`` and ``hash_ids``, the remapped hashes of the prompt's 512-token blocks, where
equal ids mean equal prefixes (a block's id stands for its whole prefix). A replay turns each
block into one page of ``page_tokens`` tokens that spell its id, so two prompts share exactly
the pages their hash ids share. Typical use::

    from mooncake import load, tokens
    for request in load("synthetic"):
        prompt = tokens(request.hash_ids, page_tokens=4)
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "traces"
"""Where the committed traces lie (see its README for their origin and licence)."""

BLOCK_TOKENS = 512
"""Tokens of a trace's block."""

NAMES = ("synthetic", "conversation")
"""The committed traces, by name (``NAME_trace.jsonl.gz``)."""


@dataclass(frozen=True)
class BlockRequest:
    """One request of a trace."""

    t: float
    """Arrival, seconds from the start of the trace."""
    hash_ids: tuple[int, ...]
    """The prompt's blocks, each named by the hash of its prefix."""
    input_length: int
    output_length: int


def path_of(name: str) -> Path:
    """The file of a committed trace (``synthetic``, ``conversation``) or a path as given."""
    if name in NAMES:
        return TRACES / f"{name}_trace.jsonl.gz"
    return Path(name)


def load(name: str, limit: int | None = None) -> list[BlockRequest]:
    """The requests of a trace (a name of :data:`NAMES` or a path, ``.gz`` or not), in arrival
    order; only the first ``limit`` with ``limit``."""
    path = path_of(name)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[BlockRequest] = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if limit is not None and len(out) >= limit:
                break
            row = json.loads(line)
            out.append(
                BlockRequest(
                    row["timestamp"] / 1000.0, tuple(row["hash_ids"]), row["input_length"], row["output_length"]
                )
            )
    out.sort(key=lambda r: r.t)  # stable: requests of one instant keep their order
    return out


def distinct_blocks(requests: Sequence[BlockRequest]) -> int:
    """Blocks of the trace's working set (every block any request reads)."""
    return len({h for r in requests for h in r.hash_ids})


def tokens(hash_ids: Sequence[int], page_tokens: int) -> list[int]:
    """The prompt of a request: one page of ``page_tokens`` (at least 2) per block, its first two
    tokens the block id's low and high 16 bits, then zeros."""
    pad = [0] * (page_tokens - 2)
    out: list[int] = []
    for h in hash_ids:
        out += [h & 0xFFFF, h >> 16, *pad]
    return out
