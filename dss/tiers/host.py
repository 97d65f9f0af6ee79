"""The host tier: page payloads in this process's RAM, bounded in bytes.

Payloads are immutable ``bytes``, so a reader keeps what it got even when the page is
evicted right after. Which pages leave when a put needs room is the placement policy's
decision (:meth:`dss.placement.policy.Placement.host_room`), made by the caller and given
to :meth:`HostTier.put` as ``drop``; without one the least recently used leave first. Every
page may carry an owner ``(tenant_id, user_ref)``; the tier counts bytes per owner and per
tenant for the policy's quotas. Thread safety is the caller's (the store serialises access).

A page the mover demotes (:meth:`HostTier.demote`; disk holds a copy) becomes *inactive*: it
stays readable, and a read makes it active again, but it leaves before any active page when a
put needs room, in the order demoted, with no ranking to do (the policy takes the inactive
pages before it ranks the rest; without a decision the tier does the same). So the room the
mover makes below the low watermark is not left empty, and a foreground put still finds its
room ready. :attr:`active_bytes` is what the watermarks measure.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from dss.core.types import PageId
from dss.tiers.base import CacheTier

Owner = tuple[str, int]


class Victims(list[PageId]):
    """The pages a put dropped, in the order they left; the first :attr:`reclaimed` of them
    were inactive (demoted before, so they were already counted as leaving)."""

    reclaimed: int = 0


class HostTier(CacheTier):
    """A byte-bounded cache of payloads keyed by page id, in least-recently-used order."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._pages: OrderedDict[PageId, bytes] = OrderedDict()
        self._owner: dict[PageId, Owner] = {}
        self._inactive: OrderedDict[PageId, int] = OrderedDict()
        """Demoted pages still held, ``page_id -> size``, in the order demoted."""
        self.inactive_bytes = 0
        self.owner_bytes: Counter[Owner] = Counter()
        self.tenant_bytes: Counter[str] = Counter()

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def active_bytes(self) -> int:
        """Bytes held less the inactive pages' (what the watermarks measure)."""
        return self.used_bytes - self.inactive_bytes

    def peek(self, page_id: PageId) -> bytes | None:
        """A page's payload (``None`` if absent), leaving its recency as it is."""
        return self._pages.get(page_id)

    def get_many(self, page_ids: Sequence[PageId]) -> list[bytes | None]:
        """Payloads in order, ``None`` where absent; found ones become most recently used
        (and active again)."""
        pages = self._pages
        out: list[bytes | None] = []
        for page_id in page_ids:
            payload = pages.get(page_id)
            if payload is not None:
                pages.move_to_end(page_id)
                if self._inactive:
                    self._activate(page_id)
            out.append(payload)
        return out

    def demote(self, page_ids: Iterable[PageId]) -> int:
        """Make these held pages inactive, in this order after those before (see the module
        docstring); returns the bytes that became inactive."""
        moved = 0
        for page_id in page_ids:
            payload = self._pages.get(page_id)
            if payload is not None and page_id not in self._inactive:
                self._inactive[page_id] = len(payload)
                moved += len(payload)
        self.inactive_bytes += moved
        return moved

    def is_inactive(self, page_id: PageId) -> bool:
        return page_id in self._inactive

    def inactive(self) -> Iterator[tuple[PageId, int]]:
        """``(page_id, size)`` of the inactive pages, first demoted first, lazily (do not change
        the tier while iterating)."""
        yield from self._inactive.items()

    def _activate(self, page_id: PageId) -> None:
        size = self._inactive.pop(page_id, None)
        if size is not None:
            self.inactive_bytes -= size

    def put(
        self, page_id: PageId, payload: bytes, owner: Owner | None = None, *, drop: Sequence[PageId] | None = None
    ) -> Victims | None:
        """Store ``payload``; return the ids evicted for it (in the order they left).

        ``drop``: the pages to evict for it, as the policy decided (they must make the room);
        without it, inactive pages leave first, then the least recently used. Returns
        ``None`` and changes nothing when the page is larger than the tier. Putting a page
        already present only refreshes its recency (and makes it active again).
        """
        if page_id in self._pages:
            self._pages.move_to_end(page_id)
            self._activate(page_id)
            return Victims()
        size = len(payload)
        if size > self.capacity_bytes:
            return None
        chosen: list[PageId]
        if drop is not None:
            chosen = list(drop)
        else:
            need = self.used_bytes + size - self.capacity_bytes
            chosen = []
            if need > 0:
                for victim, data in chain(self.inactive(), self.oldest()):
                    if need <= 0:
                        break
                    if victim not in chosen:
                        chosen.append(victim)
                        need -= data
        inactive = [p for p in chosen if p in self._inactive]
        victims = Victims(inactive + [p for p in chosen if p not in self._inactive])
        victims.reclaimed = len(inactive)
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
                self._activate(page_id)
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
        if any(p not in self._pages for p in self._inactive) or sum(self._inactive.values()) != self.inactive_bytes:
            problems.append("host tier's inactive pages do not add up")
        owned: Counter[Owner] = Counter()
        for page_id, owner in self._owner.items():
            owned[owner] += len(self._pages[page_id])
        if owned != +self.owner_bytes:
            problems.append("host tier's bytes per owner do not add up")
        return problems
