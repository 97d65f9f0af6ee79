"""The host tier: page payloads in this process's RAM, bounded in bytes.

Payloads are immutable ``bytes``, so a reader keeps what it got even when the page is
evicted right after. Which pages leave when a put needs room is the placement policy's choice
(``choose``, see :mod:`dss.policy`); without one the least recently used leave first. Every
page may carry an owner ``(tenant_id, user_ref)``; the tier counts bytes per owner and per
tenant for the policy's quotas. Thread safety is the caller's (the store serialises access).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from dss.core.types import PageId
from dss.tiers.base import CacheTier

Owner = tuple[str, int]


class HostTier(CacheTier):
    """A byte-bounded cache of payloads keyed by page id, in least-recently-used order."""

    name = "host"

    def __init__(self, capacity_bytes: int,
                 choose: Callable[[HostTier, PageId, int, Owner | None], list[PageId] | None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.choose = choose
        """``choose(tier, page_id, size, owner)``: the pages to drop so page ``page_id`` of
        ``size`` bytes of ``owner`` fits (``None``: it may not go in)."""
        self._pages: OrderedDict[PageId, bytes] = OrderedDict()
        self._owner: dict[PageId, Owner] = {}
        self.owner_bytes: Counter[Owner] = Counter()
        self.tenant_bytes: Counter[str] = Counter()

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

    def put(self, page_id: PageId, payload: bytes, owner: Owner | None = None) -> list[PageId] | None:
        """Store ``payload``; return the ids evicted for it (in the order they left).

        Returns ``None`` and changes nothing when the page is larger than the tier, or the
        policy keeps it out. Putting a page already present only refreshes its recency.
        """
        if page_id in self._pages:
            self._pages.move_to_end(page_id)
            return []
        size = len(payload)
        if size > self.capacity_bytes:
            return None
        victims: list[PageId] | None
        if self.choose is not None:
            victims = self.choose(self, page_id, size, owner)
            if victims is None:
                return None
        else:
            need = self.used_bytes + size - self.capacity_bytes
            victims = []
            if need > 0:
                for victim, data in self._pages.items():
                    victims.append(victim)
                    need -= len(data)
                    if need <= 0:
                        break
        self.discard(victims)
        self._pages[page_id] = payload
        self.used_bytes += size
        if owner is not None:
            self._owner[page_id] = owner
            self.owner_bytes[owner] += size
            self.tenant_bytes[owner[0]] += size
        return victims

    def discard(self, page_ids: Iterable[PageId]) -> int:
        """Drop these pages; return the bytes freed."""
        freed = 0
        for page_id in page_ids:
            payload = self._pages.pop(page_id, None)
            if payload is not None:
                freed += len(payload)
                owner = self._owner.pop(page_id, None)
                if owner is not None:
                    self.owner_bytes[owner] -= len(payload)
                    self.tenant_bytes[owner[0]] -= len(payload)
                    if not self.owner_bytes[owner]:
                        del self.owner_bytes[owner]
                    if not self.tenant_bytes[owner[0]]:
                        del self.tenant_bytes[owner[0]]
        self.used_bytes -= freed
        return freed

    def ids(self) -> list[PageId]:
        """Every page id held, least recently used first."""
        return list(self._pages)

    def candidates(self) -> list[tuple[PageId, int, Owner | None]]:
        """``(page_id, size, owner)`` of every page held, least recently used first."""
        owners = self._owner
        return [(p, len(data), owners.get(p)) for p, data in self._pages.items()]

    def oldest(self) -> Iterator[tuple[PageId, int]]:
        """``(page_id, size)`` of the pages held, least recently used first, lazily (do not
        change the tier while iterating)."""
        for page_id, data in self._pages.items():
            yield page_id, len(data)

    def size_of(self, page_id: PageId) -> int:
        """Bytes of a page held (0 when absent)."""
        payload = self._pages.get(page_id)
        return len(payload) if payload is not None else 0

    def check(self) -> list[str]:
        """Problems with the tier's own accounting (empty when sound)."""
        problems = []
        actual = sum(len(p) for p in self._pages.values())
        if actual != self.used_bytes:
            problems.append(f"host tier counts {self.used_bytes} bytes but holds {actual}")
        if self.used_bytes > self.capacity_bytes:
            problems.append(f"host tier holds {self.used_bytes} bytes, over its capacity {self.capacity_bytes}")
        owned: Counter[Owner] = Counter()
        for page_id, owner in self._owner.items():
            owned[owner] += len(self._pages[page_id])
        if owned != +self.owner_bytes:
            problems.append("host tier's bytes per owner do not add up")
        return problems
