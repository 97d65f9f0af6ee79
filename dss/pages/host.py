"""The host tier as the page store fills it: each put makes the room the policy decides,
and what left host is counted as the policy sees it.

:func:`put_host` asks the policy (:meth:`dss.placement.policy.Placement.host_room`) which
pages to drop and tells the tier (:meth:`dss.tiers.host.HostTier.put`); :class:`HostPages`
does that for the page store's writes and reads, with each namespace's owner for the quotas,
and counts demotions, inline evictions and wasted prefetches.
"""

from __future__ import annotations

from collections.abc import Sequence

from dss.catalog import namespaces
from dss.catalog.database import Catalog
from dss.core.packing import encoding_of
from dss.core.precision import EXACT
from dss.core.types import PageId
from dss.pages.index import NamespacePages, PageIndex
from dss.placement import fill
from dss.placement.policy import Placement
from dss.tiers.host import HostTier, Owner, Victims


def put_host(
    host: HostTier,
    placement: Placement,
    page_id: PageId,
    payload: bytes,
    owner: Owner | None,
    *,
    compete: bool = False,
) -> Victims | None:
    """Put a page in the host tier, making the room the policy decides (``compete``: only if
    it is worth more than what it displaces). Returns the pages dropped for it, or ``None``
    when it stays out."""
    if page_id in host:
        return host.put(page_id, payload, owner)
    if len(payload) > host.capacity_bytes:
        return None
    drop = placement.host_room(host, page_id, len(payload), owner, compete)
    return None if drop is None else host.put(page_id, payload, owner, drop=drop)


class HostPages:
    """Puts into the host tier and the policy's count of what left it. Not thread-safe; the
    store locks."""

    def __init__(self, host: HostTier, placement: Placement, index: PageIndex, catalog: Catalog) -> None:
        self.host = host
        self.placement = placement
        self.index = index
        self.catalog = catalog

    def put(self, page_id: PageId, payload: bytes, namespace: NamespacePages | None, *, compete: bool = False) -> bool:
        """Put a page of ``namespace`` in host by the policy's decision (:func:`put_host`), and
        count what it displaced; returns whether it went in."""
        owner = self.owner(namespace) if namespace is not None else None
        victims = put_host(self.host, self.placement, page_id, payload, owner, compete=compete)
        self.made_room(victims)
        if victims is not None and not self.index.has_lossy and encoding_of(payload) != EXACT:
            self.index.has_lossy = True
        return victims is not None

    @property
    def above_high_mark(self) -> bool:
        """Whether the host tier's active pages are past its high watermark (the mover's
        work: the store wakes it when a write or a read left it so)."""
        high, _ = fill.watermarks(self.placement.settings, "host", self.host.capacity_bytes)
        return self.host.active_bytes > high

    def owner(self, namespace: NamespacePages) -> Owner:
        """``(tenant_id, user_ref)`` of a namespace, for the host tier's quotas and the tenant
        filter of ``read_pages`` (its tenant read from the catalog once per namespace object;
        ``""`` for a namespace the catalog no longer has)."""
        if namespace.tenant_id is None:
            with self.catalog.read() as conn:
                namespace.tenant_id = namespaces.tenant_of(conn, namespace.user_ref) or ""
        return (namespace.tenant_id, namespace.user_ref)

    def demoted(self, page_ids: Sequence[PageId], *, inline: bool = False, sizes: Sequence[int] = ()) -> None:
        """Count pages that left host as the policy sees it: a demotion when disk holds the page,
        else an eviction (the mover's demoted pages stay in host, inactive, until dropped)."""
        entries = self.index.entries
        placement = self.placement
        demoted = moved = evictions = 0
        for i, page_id in enumerate(page_ids):
            entry = entries.get(page_id)
            if entry is not None and entry.disk is not None:
                demoted += 1
                moved += sizes[i] if sizes else entry.size
            else:
                evictions += 1
        placement.demoted(page_ids)
        placement.count("host", "demotions", demoted)
        placement.count("host", "moved_bytes", moved)
        placement.count("host", "evictions", evictions)
        if inline:
            placement.count("host", "inline_evictions", len(page_ids))

    def dropped(self, page_ids: Sequence[PageId]) -> None:
        """These pages are no longer in host: a prefetched one nobody read was wasted; the
        index forgets pages no tier holds."""
        for page_id in page_ids:
            self.placement.prefetch_left(page_id)
        self.index.left_host(page_ids)

    def made_room(self, victims: Victims | None) -> None:
        """A put into host dropped ``victims``: inactive ones were counted when the mover
        demoted them; the others were evicted inline."""
        if not victims:
            return
        evicted = victims[victims.reclaimed :]
        if evicted:
            self.demoted(evicted, inline=True)  # while the index still knows their disk copies
        self.dropped(victims)
