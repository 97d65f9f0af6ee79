"""What the connector's scheduler side tells its worker side each step, and what comes back.

Both are pickled between processes in vLLM's multi-process mode, so they hold plain
values only: page ids as bytes, block ids and token ids as ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dss_adapters.vllm_settings import Scope
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(slots=True)
class LoadJob:
    """Copy stored pages into KV blocks before this step's forward: ``page_ids[i]`` → ``block_ids[i]``."""

    req_id: str
    page_ids: list[bytes]
    block_ids: list[int]


@dataclass(slots=True)
class SaveJob:
    """Save the KV blocks ``block_ids[i]`` as page ``first_page + i`` of the request's tokens.

    ``new_tokens`` extends the token ids the worker holds for the request (it holds
    ``num_known`` before), so that it knows every token up to the last page saved.
    """

    req_id: str
    scope: Scope
    num_known: int
    new_tokens: list[int]
    first_page: int
    block_ids: list[int]


@dataclass
class DssConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


@dataclass
class DssWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, once per step.

    ``saved``: save jobs finished (written, failed or dropped) per request. ``dropped``:
    per request, the first page of a save job the worker dropped because a load of the
    same step failed (those blocks may hold KV computed from a block that was never
    loaded); the scheduler plans them again once vLLM has recomputed them.
    """

    saved: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge two workers' reports (one worker per engine: TP is 1)."""
        assert isinstance(other, DssWorkerMetadata)
        saved = dict(self.saved)
        for req_id, count in other.saved.items():
            saved[req_id] = saved.get(req_id, 0) + count
        dropped = dict(self.dropped)
        for req_id, page in other.dropped.items():
            dropped[req_id] = min(page, dropped.get(req_id, page))
        return DssWorkerMetadata(saved, dropped)
