"""The scheduler's picture of the workers' host tiers: which pages each worker holds in RAM.

dss's host tier is per process, and the scheduler never reads pages, so ``resume`` run in
the scheduler cannot tell whether a worker would read a page from its RAM or from disk.
Each worker reports the pages it wrote or read every step (both leave a copy in its host
tier); :class:`WorkerHosts` replays those reports into one least-recently-used list per
shard, bounded like the worker's tier. It is a prediction, not a promise: a page the
picture holds may have gone (the load is then synchronous and reads the disk), and the
connector only uses it to choose between a synchronous and an asynchronous load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

PAGE_OVERHEAD = 64
"""Bytes a host-tier copy holds beyond the payload (sealing nonce and tag), rounded up."""


class WorkerHosts:
    """One bounded LRU of page ids per shard (see the module docstring)."""

    def __init__(self, num_shards: int, capacity_bytes: int, page_bytes: int) -> None:
        self.capacity_pages = capacity_bytes // (page_bytes + PAGE_OVERHEAD)
        self._pages: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_shards)]

    def note(self, host_pages: Mapping[int, Sequence[bytes]]) -> None:
        """Record a step's report: per shard, the pages its worker wrote or read, oldest first."""
        if self.capacity_pages <= 0:
            return
        for shard, page_ids in host_pages.items():
            held = self._pages[shard]
            for page_id in page_ids:
                held[page_id] = None
                held.move_to_end(page_id)
            while len(held) > self.capacity_pages:
                held.popitem(last=False)

    def held(self, page_ids: Sequence[Sequence[bytes]]) -> list[bool]:
        """For each page ``i`` (``page_ids[shard][i]``, the same count per shard), whether every
        shard's worker holds it in RAM. Changes nothing."""
        count = len(page_ids[0]) if page_ids else 0
        if self.capacity_pages <= 0:
            return [False] * count
        return [all(ids[i] in self._pages[shard] for shard, ids in enumerate(page_ids)) for i in range(count)]

    def num_held(self, page_ids: Sequence[Sequence[bytes]]) -> int:
        """How many of the pages (as :meth:`held`) every shard's worker holds in RAM. Changes nothing."""
        return sum(self.held(page_ids))
