"""The host tier: page payloads in this process's RAM, bounded in bytes, LRU.

Payloads are immutable ``bytes``, so a reader keeps what it got even when the page is
evicted right after; nothing needs pinning. Thread safety is the caller's (the store
serialises access).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dss.core.types import PageId
from dss.tiers.base import CacheTier


class HostTier(CacheTier):
    """A byte-bounded LRU of payloads keyed by page id."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pages: OrderedDict[PageId, bytes] = OrderedDict()

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def get_many(self, page_ids: Sequence[PageId]) -> list[bytes | None]:
        """Payloads in order, ``None`` where absent; found ones become most recently used."""
        pages = self._pages
        out: list[bytes | None] = []
        for page_id in page_ids:
            payload = pages.get(page_id)
            if payload is not None:
                pages.move_to_end(page_id)
            out.append(payload)
        return out

    def put(self, page_id: PageId, payload: bytes) -> list[PageId] | None:
        """Store ``payload``; return the ids evicted for it (oldest first).

        Returns ``None`` and changes nothing when the page is larger than the tier.
        Putting a page already present only refreshes its recency.
        """
        if page_id in self._pages:
            self._pages.move_to_end(page_id)
            return []
        size = len(payload)
        if size > self.capacity_bytes:
            return None
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[PageId] = []
        if need > 0:
            for victim, data in self._pages.items():
                victims.append(victim)
                need -= len(data)
                if need <= 0:
                    break
            self.discard(victims)
        self._pages[page_id] = payload
        self.used_bytes += size
        return victims

    def discard(self, page_ids: Iterable[PageId]) -> int:
        """Drop these pages; return the bytes freed."""
        freed = 0
        for page_id in page_ids:
            payload = self._pages.pop(page_id, None)
            if payload is not None:
                freed += len(payload)
        self.used_bytes -= freed
        return freed

    def ids(self) -> list[PageId]:
        """Every page id held, least recently used first."""
        return list(self._pages)

    def check(self) -> list[str]:
        """Problems with the tier's own accounting (empty when sound)."""
        problems = []
        actual = sum(len(p) for p in self._pages.values())
        if actual != self.used_bytes:
            problems.append(f"host tier counts {self.used_bytes} bytes but holds {actual}")
        if self.used_bytes > self.capacity_bytes:
            problems.append(f"host tier holds {self.used_bytes} bytes, over its capacity {self.capacity_bytes}")
        return problems
