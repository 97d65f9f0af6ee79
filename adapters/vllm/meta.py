"""What the connector's scheduler side tells its worker sides each step, and what comes back.

Both are pickled between processes in vLLM's multi-process mode, so they hold plain
values only: page ids as bytes, block ids and token ids as ints. Block ids come per KV
cache group (one list per group, the same length); ``NO_BLOCK`` marks a page a group
does not need (a sliding-window group's block outside the window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dss_adapters.vllm.settings import Scope
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

NO_BLOCK = -1


@dataclass(slots=True)
class LoadJob:
    """Copy stored pages into KV blocks: page ``page_ids[shard][i]`` into the blocks
    ``block_ids[group][i]`` of each group's layers.

    A synchronous job (``is_async`` false) is done before the step's forward; an
    asynchronous one in the background, reported through ``get_finished``. A job with
    ``fail`` set copies nothing and reports every page failed (the scheduler found it
    could not be loaded whole), so that vLLM recomputes. ``tiers[i]`` is the tier page ``i``
    was planned to load from (``host``, ``disk``, ``remote``; shard 0's), which names the
    tier of a late miss in the metrics.
    """

    req_id: str
    page_ids: list[list[bytes]]
    block_ids: list[list[int]]
    is_async: bool = False
    fail: bool = False
    tiers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class SaveJob:
    """Save the KV blocks ``block_ids[group][i]`` as page ``first_page + i`` of the request's tokens.

    ``new_tokens`` extends the token ids the worker holds for the request (it holds
    ``num_known`` before), so that it knows every token up to the last page saved.
    """

    req_id: str
    scope: Scope
    num_known: int
    new_tokens: list[int]
    first_page: int
    block_ids: list[list[int]]


@dataclass
class DssConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker sides (every worker gets the same).

    With several workers, the saves of a step with synchronous loads are held by the workers
    (``hold_saves``) until the scheduler has seen that step's outcome: ``settled`` maps such
    a step to whether a load failed in it on any rank (then its saves are dropped).
    """

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    step: int = 0
    hold_saves: bool = False
    settled: dict[int, bool] = field(default_factory=dict)
    idle: bool = False
    """No token is computed this step: a worker may wait (briefly) for its asynchronous loads
    instead of letting the engine spin through empty steps."""


@dataclass
class DssWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, once per step, merged over workers.

    ``saved``: save jobs finished (written, failed or dropped) per request, one per
    worker that writes a shard. ``dropped``: per request, the first page of a save job a
    worker dropped because a load of the same step failed (those blocks may hold KV
    computed from a block that was never loaded); the scheduler plans them again once
    vLLM has recomputed them. ``host_pages``: per shard, the pages its worker wrote or
    read this step (they are in its host tier now), oldest first. ``held``: steps whose
    saves a worker holds until they are settled (see :class:`DssConnectorMetadata`).
    ``lossy``: per request, the tokens its loads this step served from lower-precision copies,
    per encoding (the largest over shards: each shard loads the same tokens).
    """

    saved: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    host_pages: dict[int, list[bytes]] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    lossy: dict[str, dict[str, int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge two workers' reports (sums, minima, concatenations; neither is changed)."""
        assert isinstance(other, DssWorkerMetadata)
        saved = dict(self.saved)
        for req_id, count in other.saved.items():
            saved[req_id] = saved.get(req_id, 0) + count
        dropped = dict(self.dropped)
        for req_id, page in other.dropped.items():
            dropped[req_id] = min(page, dropped.get(req_id, page))
        host = {shard: list(ids) for shard, ids in self.host_pages.items()}
        for shard, ids in other.host_pages.items():
            host.setdefault(shard, []).extend(ids)
        lossy = {req_id: dict(counts) for req_id, counts in self.lossy.items()}
        for req_id, counts in other.lossy.items():
            mine = lossy.setdefault(req_id, {})
            for encoding, tokens in counts.items():
                mine[encoding] = max(tokens, mine.get(encoding, 0))
        return DssWorkerMetadata(saved, dropped, host, sorted(set(self.held) | set(other.held)), lossy)


@dataclass
class ShardHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler, once at start: the worker's shard and that shard's layout (as a dict)."""

    shard: int
    layout: dict[str, Any]
