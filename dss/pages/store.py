"""The write side of the page plane: segment files written before a change's transaction,
room made by the policy inside it, caches settled after it. Reads are
:mod:`dss.pages.reader`'s; puts into host, :mod:`dss.pages.host`'s.

A write's pages take three steps around its catalog transaction:

1. :meth:`PageStore.write` — outside any lock and transaction, write the change's new pages
   as segment files (each published atomically: temp file, fsync, rename, fsync of the folder);
2. :meth:`PageStore.room`, inside the transaction — ask the policy (:mod:`dss.placement.policy`) which
   segments to drop if the new ones do not fit; :func:`dss.catalog.transaction.apply` records both;
3. :meth:`PageStore.settle` after the commit — delete the files the transaction left without a
   page, put the payloads in the host tier; or :meth:`PageStore.abort` if it rolled back.

With a remote tier, step 3 also queues the pages the transaction recorded for it, and the
deletion of the keys of pages it removed from every tier (:mod:`dss.pages.copies`).

Files are deleted only after the transaction that stopped referring to them committed. A
file written by a process that died before its commit is an orphan; the next opener removes
it.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dss.catalog import segments
from dss.catalog.change import Applied, NewPage, Room, WrittenSegment
from dss.catalog.database import Catalog, Tx
from dss.core import packing
from dss.core.crypto import Sealer
from dss.core.hashing import checksum
from dss.core.precision import EXACT, EXACT_TIERS, Precision
from dss.core.types import Layout, PageId
from dss.pages.copies import RemoteCopies
from dss.pages.host import HostPages
from dss.pages.index import NamespacePages, PageEntry, PageIndex
from dss.pages.records import SealRing, batches, records, segment_size
from dss.placement import fill
from dss.placement.policy import Placement
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.remote import RemoteTier
from dss.tiers.segment import SEALED_FLAG

log = logging.getLogger("dss.pages.store")

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Write errors that mean no room: the write's pages stay in host only, its catalog rows commit."""


def new_pages(
    ids: Sequence[PageId],
    payloads: Mapping[int, bytes],
    index: PageIndex,
    seal: bool,
    layout: Layout | None = None,
    precision: Precision = EXACT_TIERS,
) -> tuple[NewPage, ...]:
    """The given pages (``payloads[i]`` is page ``ids[i]``), each to be written as it is or
    sealed (``seal``) as :meth:`PageStore.write` writes it — or not at all (``stored`` is
    ``None``) when this process knows a durable tier holds it already (this node's disk,
    or another's: the catalog keeps one disk copy of a page in the fleet).

    With a lossy ``precision`` and a ``layout`` whose pages can be encoded
    (:func:`dss.core.packing.shape_of`), the durable copy is encoded at ``precision.disk``
    and the host copy at ``precision.host``; a page that cannot be encoded stays exact."""
    entries = index.entries
    out = []
    encode = _encoder(layout, precision)
    for i, payload in payloads.items():
        page_id = ids[i]
        entry = entries.get(page_id)
        if entry is not None and (entry.disk is not None or entry.is_durable):  # only its host copy is new
            out.append(NewPage(page_id, i, encode(payload, False)[2] or payload, None, 0, 0))
            continue
        durable, encoding, host = encode(payload, True)
        if seal:
            out.append(NewPage(page_id, i, durable, durable, 0, SEALED_FLAG, encoding, host))
        else:
            out.append(NewPage(page_id, i, durable, durable, checksum(durable), 0, encoding, host))
    return tuple(out)


def _encoder(layout: Layout | None, precision: Precision) -> Callable[[bytes, bool], tuple[bytes, str, bytes | None]]:
    """A function of a saved payload (and whether its durable copy is wanted) to ``(durable
    copy, its encoding, host copy or None: the same bytes)`` for these settings; chosen once
    per write."""
    shape = packing.shape_of(layout) if layout is not None and not precision.is_exact else None
    if shape is None:
        return lambda payload, durable: (payload, EXACT, None)

    def encode(payload: bytes, wanted: bool) -> tuple[bytes, str, bytes | None]:
        if not wanted:
            host = packing.encode(payload, shape, precision.host)
            return payload, EXACT, host if host is not None and host is not payload else None
        disk = packing.encode(payload, shape, precision.disk)
        durable, encoding = (payload, EXACT) if disk is None else (disk, precision.disk)
        if precision.host == encoding:
            return durable, encoding, None
        host = packing.encode(payload, shape, precision.host)
        return durable, encoding, payload if host is None else host

    return encode


class PageStore:
    """Writes pages to the tiers for one store, as recorded in the catalog."""

    def __init__(
        self,
        catalog: Catalog,
        disk: DiskTier,
        hosted: HostPages,
        *,
        node_ref: int,
        disk_bytes: int,
        segment_bytes: int,
        copies: RemoteCopies | None = None,
        precision: Precision = EXACT_TIERS,
    ) -> None:
        self.catalog = catalog
        self.precision = precision
        self.disk = disk
        self.hosted = hosted
        self.host: HostTier = hosted.host
        self.placement: Placement = hosted.placement
        self.index: PageIndex = hosted.index
        self.node_ref = node_ref
        self.copies = copies
        self.remote: RemoteTier | None = copies.remote if copies is not None else None
        self.disk_bytes = disk_bytes
        self.segment_bytes = segment_bytes
        self._ring = SealRing()

    # -- writing ---------------------------------------------------------------------------

    def write(
        self, new: Sequence[NewPage], sealer: Sealer | None = None, *, publish: bool = True
    ) -> list[WrittenSegment]:
        """Write the pages that need it as segment files of at most ``segment_bytes`` each; no
        catalog, no lock. Pages flagged sealed are sealed with ``sealer`` (bound to their id)
        as they are written, while the disk writes the ones before them. Writes nothing when
        they could never fit the tier, or when the disk is full (the pages stay in host).
        ``publish=False``: the files' names are not yet durable; :meth:`publish` them before
        the transaction that records them."""
        fresh = [p for p in new if p.stored is not None]
        if not fresh or segment_size(fresh) > self.disk_bytes:
            return []
        if any(p.flags & SEALED_FLAG for p in fresh) and sealer is None:
            raise ValueError("sealed pages need their namespace's sealer")
        out: list[WrittenSegment] = []
        ring = self._ring if self._ring.lock.acquire(blocking=False) else None
        keep = self.remote is not None
        try:
            for batch in batches(fresh, self.segment_bytes):
                done: list[NewPage] = []
                name, size, located = self.disk.write(records(batch, sealer, ring, done, keep), publish=publish)
                out.append(
                    WrittenSegment(
                        name,
                        size,
                        self.node_ref,
                        tuple((p, where.offset, where.length) for p, where in zip(done, located)),
                    )
                )
        except OSError as exc:
            self.abort(out)
            if exc.errno not in DISK_FULL:
                raise
            log.warning("the disk holding page files is full (%s): the new pages stay in host only", exc.strerror)
            return []
        except BaseException:
            self.abort(out)
            raise
        finally:
            if ring is not None:
                ring.lock.release()
        return out

    def publish(self, written: Sequence[WrittenSegment]) -> None:
        """Make the names of segment files written with ``publish=False`` durable (one fsync
        of the folder for all of them)."""
        if written:
            self.disk.publish()

    def room(self, tx: Tx, written: Sequence[WrittenSegment], user_ref: int | None = None) -> Room:
        """What the policy decides for ``written`` (pages of namespace ``user_ref``) in
        transaction ``tx``: segments to drop so they fit the tier and the owner's quotas, and
        whether they then fit (pinned pages may leave too little room). The mover's inactive
        segments go first, in the order demoted, exactly as many as the room needs; only when
        they do not suffice are the others ranked here, inline, freeing 5 % more."""
        need = sum(w.size for w in written)
        if not need:
            return Room()
        s = self.placement.settings
        conn = tx.conn
        used = segments.tier_bytes(conn, "disk", self.node_ref)
        quotas = user_ref is not None and (s.disk_user_quota or s.disk_tenant_quota)
        if used + need <= self.disk_bytes and not quotas:
            return Room()
        chosen: list[int] = []
        freed = 0
        if quotas:
            assert user_ref is not None
            ordered, _ = self.segment_order(conn)
            if not self._within_quotas(conn, ordered, chosen, need, user_ref):
                return Room((), False)
            freed = sum(segment.size for segment in ordered if segment.ref in chosen)
        if used - freed + need > self.disk_bytes:
            freed += self._reclaim(conn, used - freed + need - self.disk_bytes, chosen)
        if used - freed + need > self.disk_bytes:
            freed += self._rank_inline(conn, fill.room_needed(used - freed, need, self.disk_bytes), chosen)
        fits = used - freed + need <= self.disk_bytes
        if not fits:
            log.warning(
                "disk tier full (%d of %d bytes held by pinned versions): %d new bytes stay in host only",
                used - freed,
                self.disk_bytes,
                need,
            )
        return Room(tuple(chosen), fits)

    def _reclaim(self, conn: Any, to_free: int, chosen: list[int]) -> int:
        """Add to ``chosen`` the inactive segments (beyond those in it) the policy drops to free
        ``to_free`` bytes, first demoted first; returns the bytes freed (less when they do not
        suffice). Takes off the list the segments read since, gone, or pinned since."""
        inactive = self.disk.inactive
        freed = evicted = 0
        while to_free > freed and len(inactive):
            victims, active = self.placement.disk_reclaim(inactive, to_free - freed)
            inactive.discard(active)
            rows = segments.named_segments(conn, "disk", self.node_ref, [v.name for v in victims])
            for victim in victims:
                row = rows.get(victim.name)
                inactive.discard([victim.name])  # dropped now, or gone, or pinned meanwhile
                if row is not None and not row.is_pinned and row.ref not in chosen:
                    chosen.append(row.ref)
                    freed += row.size
                    evicted += len(victim.page_ids)
            if not victims:
                break
        self.placement.count("disk", "evictions", evicted)
        return freed

    def _rank_inline(self, conn: Any, to_free: int, chosen: list[int]) -> int:
        """Add to ``chosen`` the segments (beyond those in it) to drop for ``to_free`` bytes, in
        the order they leave, ranked now; returns the bytes freed."""
        ordered, page_ids = self.segment_order(conn)
        freed = num = 0
        for segment in ordered:
            if freed >= to_free:
                break
            if segment.ref not in chosen:
                chosen.append(segment.ref)
                freed += segment.size
                num += len(page_ids.get(segment.ref, ()))
        if num:
            log.info("disk tier full: dropping %d pages inline", num)
            self.placement.count("disk", "evictions", num)
            self.placement.count("disk", "inline_evictions", num)
        return freed

    def _within_quotas(
        self, conn: Any, ordered: Sequence[segments.SegmentRow], chosen: list[int], need: int, user_ref: int
    ) -> bool:
        """Add to ``chosen`` the owner's own segments (in the order they leave) until ``need``
        more bytes fit the user's quota, then the tenant's; ``False`` when they cannot."""
        s = self.placement.settings
        owners = segments.segment_owners(conn, "disk")
        mine, tenant_used, tenant_ref = segments.owner_bytes(conn, "disk", user_ref)
        freed = 0
        for quota, held, same in ((s.disk_user_quota, mine, 0), (s.disk_tenant_quota, tenant_used, 1)):
            if not quota:
                continue
            if need > quota:
                return False
            wanted = user_ref if same == 0 else tenant_ref
            over = held - freed + need - quota
            for segment in ordered:
                if over <= 0:
                    break
                if segment.ref not in chosen and owners.get(segment.ref, (0, 0))[same] == wanted:
                    chosen.append(segment.ref)
                    freed += segment.size
                    over -= segment.size
            if over > 0:
                log.info("disk quota of the owner full: %d new bytes stay in host only", need)
                return False
        return True

    def segment_order(self, conn: Any) -> tuple[list[segments.SegmentRow], dict[int, list[PageId]]]:
        """The disk's unpinned segments that hold no held page, in the order they leave, and
        the pages of every segment."""
        rows = segments.tier_segments(conn, "disk", self.node_ref)
        placement = self.placement
        page_ids = segments.segment_page_ids(conn, "disk")
        held = placement.held
        if held:
            rows = [seg for seg in rows if not any(p in held for p in page_ids.get(seg.ref, ()))]
        return placement.segment_order(rows, page_ids), page_ids

    def settle(
        self,
        applied: Applied,
        new: Sequence[NewPage],
        namespace: NamespacePages | None,
        written: Sequence[WrittenSegment] = (),
        *,
        user: int | None = None,
        turn: bool = False,
        started: bool = False,
        sessionless: bool = False,
    ) -> None:
        """After the transaction committed: delete dead files, tell the policy of the write by
        namespace ``user`` (``turn``: it made a new version of a session; ``started``: the
        session's first, a version without a parent; ``sessionless``: a save without a
        session), put the payloads in
        the host tier (a page no durable tier took stays known there while it lasts), queue the
        pages of ``written`` (the change's segment files) for the remote tier, and the deletion
        of the keys of the pages it dropped from every tier."""
        self.disk.remove(applied.dead_files)
        self.placement.forget(applied.dropped)
        entries = self.index.entries
        now = self.placement.now()
        self.placement.wrote(
            [p.page_id for p in new], user, turn=turn, started=started, sessionless=sessionless, now=now
        )
        for page in new:
            if page.page_id not in entries and namespace is not None:  # not durable: the disk tier had no room
                self.index.add(
                    PageEntry(
                        page.page_id,
                        namespace,
                        page.index,
                        len(page.payload),
                        checksum(page.payload),
                        None,
                        is_durable=False,
                        encoding=page.encoding,
                    )
                )
            # a durable page competes for room; one only host holds goes in whatever it is worth
            entry = entries.get(page.page_id)
            host_copy = page.payload if page.host is None else page.host
            kept = self.hosted.put(page.page_id, host_copy, namespace, compete=entry is not None and entry.is_durable)
            if not kept and entry is not None and entry.disk is None and not entry.is_durable:
                self.index.forget([page.page_id])
        if namespace is not None:
            namespace.bump()
        if self.copies is not None and applied.stored:
            self.copies.write_through(applied, written)
        if self.copies is not None and applied.dropped:
            self.copies.drop(applied.events)

    def disk_need(self, new: Sequence[NewPage]) -> int:
        """Bytes of page files :meth:`write` would add to the disk tier for ``new`` beyond
        its capacity less its inactive segments (0 when they fit, or when it would write none)."""
        fresh = [p for p in new if p.stored is not None]
        size = segment_size(fresh) if fresh else 0
        if not size or size > self.disk_bytes:
            return 0
        with self.catalog.read() as conn:
            used = segments.tier_bytes(conn, "disk", self.node_ref)
        return max(0, used - self.disk.inactive.bytes + size - self.disk_bytes)

    def sweep(self) -> list[str]:
        """Delete this node's page files the catalog no longer records (see :meth:`DiskTier.sweep`)."""
        with self.catalog.read() as conn:
            recorded = set(segments.all_segments(conn, "disk", self.node_ref))
        removed = self.disk.sweep(recorded)
        if removed:
            log.info("deleted %d page files the catalog no longer records", len(removed))
        return removed

    def abort(self, written: Sequence[WrittenSegment]) -> None:
        """Delete the files of a write whose transaction did not commit."""
        self.disk.remove([w.name for w in written])
