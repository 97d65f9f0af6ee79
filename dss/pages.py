"""Page bytes on the tiers: segment files written before a change's transaction, room made by
the policy inside it, caches settled after it; pages read back verified.

A write's pages take three steps around its catalog transaction:

1. :meth:`PageStore.write` — outside any lock and transaction, write the change's new pages
   as segment files (each published atomically: temp file, fsync, rename, fsync of the folder);
2. :meth:`PageStore.room`, inside the transaction — ask the policy (:mod:`dss.policy`) which
   segments to drop if the new ones do not fit; :func:`dss.catalog.change.apply` records both;
3. :meth:`PageStore.settle` after the commit — delete the files the transaction left without a
   page, put the payloads in the host tier; or :meth:`PageStore.abort` if it rolled back.

With a remote tier, step 3 also queues the pages the transaction recorded for it, and the
deletion of the keys of pages it removed from every tier (:mod:`dss.copies`). Reads look in
the host tier, then this node's disk, then — for the pages the catalog holds on another node's
disk only — the remote tier, in one round trip; what comes back verified is promoted to host.

Files are deleted only after the transaction that stopped referring to them committed. A
file written by a process that died before its commit is an orphan; the next opener removes
it. Reads return ``None`` for a page no tier holds, and list the pages whose bytes fail
verification, for the store to quarantine.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from dss import policy
from dss.catalog import pages
from dss.catalog.change import Applied, NewPage, Quarantined, Room, WrittenSegment
from dss.catalog.database import Catalog, Tx
from dss.copies import RemoteCopies
from dss.core.crypto import OVERHEAD, Sealer, SealError
from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.keys import DataKeys
from dss.pageindex import NamespacePages, PageEntry, PageIndex
from dss.policy import Placement
from dss.records import SealRing, batches, records, segment_size
from dss.tiers.base import ReadFailure, ReadRequest
from dss.tiers.disk import SEALED_FLAG, DiskTier
from dss.tiers.host import HostTier, Victims
from dss.tiers.remote import RemoteTier

log = logging.getLogger("dss.pages")

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""Write errors that mean no room: the write's pages stay in host only, its catalog rows commit."""


def new_pages(
    ids: Sequence[PageId], payloads: Mapping[int, bytes], index: PageIndex, seal: bool
) -> tuple[NewPage, ...]:
    """The given pages (``payloads[i]`` is page ``ids[i]``), each to be written as it is or
    sealed (``seal``) as :meth:`PageStore.write` writes it — or not at all (``stored`` is
    ``None``) when this process knows a durable tier holds it already (this node's disk,
    or another's: the catalog keeps one disk copy of a page in the fleet)."""
    entries = index.entries
    out = []
    for i, payload in payloads.items():
        page_id = ids[i]
        entry = entries.get(page_id)
        if entry is not None and (entry.disk is not None or entry.is_durable):
            out.append(NewPage(page_id, i, payload, None, 0, 0))
        elif seal:
            out.append(NewPage(page_id, i, payload, payload, 0, SEALED_FLAG))
        else:
            out.append(NewPage(page_id, i, payload, payload, checksum(payload), 0))
    return tuple(out)


class Read(NamedTuple):
    """Payloads in request order (``None``: no tier holds valid bytes), and the pages whose
    bytes failed verification (to quarantine)."""

    payloads: list[bytes | None]
    bad: list[Quarantined]


class PageStore:
    """Pages across the host and disk tiers, as recorded in the catalog."""

    def __init__(
        self,
        catalog: Catalog,
        disk: DiskTier,
        host: HostTier,
        index: PageIndex,
        keys: DataKeys,
        *,
        node_ref: int,
        disk_bytes: int,
        segment_bytes: int,
        placement: Placement,
        tenant_of: Callable[[int], str | None],
        remote: RemoteTier | None = None,
    ) -> None:
        self.placement = placement
        self.tenant_of = tenant_of
        self.filled: Callable[[], None] = lambda: None
        """Called when a put took host past its high mark (the store wakes the mover)."""
        self.catalog = catalog
        self.node_ref = node_ref
        self.remote = remote
        self.copies = RemoteCopies(remote, keys, index) if remote is not None else None
        self.disk = disk
        self.host = host
        self.index = index
        self.keys = keys
        self.disk_bytes = disk_bytes
        self.segment_bytes = segment_bytes
        self._ring = SealRing()
        self.before_full: Callable[[int], None] | None = None
        """Called with the bytes of page files about to be written (the store compacts when they would not fit)."""

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
        if self.before_full is not None:
            self.before_full(segment_size(fresh))
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
        whether they then fit (pinned pages may leave too little room)."""
        need = sum(w.size for w in written)
        if not need:
            return Room()
        s = self.placement.settings
        conn = tx.conn
        used = pages.tier_bytes(conn, "disk", self.node_ref)
        quotas = user_ref is not None and (s.disk_user_quota or s.disk_tenant_quota)
        to_free = policy.room_needed(used, need, self.disk_bytes)
        if to_free <= 0 and not quotas:
            return Room()
        ordered, page_ids = self.segment_order(conn)
        chosen: list[int] = []
        freed = 0
        if quotas:
            assert user_ref is not None
            owners = pages.segment_owners(conn, "disk")
            mine, tenant_used, tenant_ref = pages.owner_bytes(conn, "disk", user_ref)
            for quota, held, same in ((s.disk_user_quota, mine, 0), (s.disk_tenant_quota, tenant_used, 1)):
                if not quota:
                    continue
                wanted = user_ref if same == 0 else tenant_ref
                over = held - freed + need - quota
                if need > quota:
                    return Room((), False)
                for segment in ordered:
                    if over <= 0:
                        break
                    if segment.ref not in chosen and owners.get(segment.ref, (0, 0))[same] == wanted:
                        chosen.append(segment.ref)
                        freed += segment.size
                        over -= segment.size
                if over > 0:
                    log.info("disk quota of the owner full: %d new bytes stay in host only", need)
                    return Room((), False)
        to_free = policy.room_needed(used - freed, need, self.disk_bytes)
        for segment in ordered:
            if to_free <= 0:
                break
            if segment.ref not in chosen:
                chosen.append(segment.ref)
                freed += segment.size
                to_free -= segment.size
        if chosen:
            log.info("disk tier full: dropping %d segments", len(chosen))
            num = sum(len(page_ids.get(ref, ())) for ref in chosen)
            self.placement.count("disk", "evictions", num)
            self.placement.count("disk", "inline_evictions", num)
        fits = used - freed + need <= self.disk_bytes
        if not fits:
            log.warning(
                "disk tier full (%d of %d bytes held by pinned versions): %d new bytes stay in host only",
                used - freed,
                self.disk_bytes,
                need,
            )
        return Room(tuple(chosen), fits)

    def segment_order(self, conn: Any) -> tuple[list[pages.SegmentRow], dict[int, list[bytes]]]:
        """The disk's unpinned segments that hold no held page, in the order they leave, and
        the pages of every segment."""
        segments = pages.tier_segments(conn, "disk", self.node_ref)
        placement = self.placement
        page_ids = pages.segment_page_ids(conn, "disk")
        held = placement.held
        if held:
            segments = [seg for seg in segments if not any(PageId(p) in held for p in page_ids.get(seg.ref, ()))]
        return placement.segment_order(segments, lambda ref: [PageId(p) for p in page_ids.get(ref, ())]), page_ids

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
    ) -> None:
        """After the transaction committed: delete dead files, tell the policy of the write by
        namespace ``user`` (``turn``: it made a new version of a session; ``started``: the
        session's first, a version without a parent), put the payloads in
        the host tier (a page no durable tier took stays known there while it lasts), queue the
        pages of ``written`` (the change's segment files) for the remote tier, and the deletion
        of the keys of the pages it dropped from every tier."""
        self.disk.remove(applied.dead_files)
        self.placement.forget(applied.dropped)
        entries = self.index.entries
        owner = self.owner(namespace.user_ref) if namespace is not None else None
        now = self.placement.now()
        self.placement.wrote([p.page_id for p in new], user, turn=turn, started=started, now=now)
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
                    )
                )
            # a durable page competes for room; one only host holds goes in whatever it is worth
            entry = entries.get(page.page_id)
            evicted = self.host.put(page.page_id, page.payload, owner, compete=entry is not None and entry.is_durable)
            if evicted is None:
                if entry is not None and entry.disk is None and not entry.is_durable:
                    self.index.forget([page.page_id])
            else:
                self.made_room(evicted)
        if namespace is not None:
            namespace.bump()
        if self.copies is not None and applied.stored:
            self.copies.write_through(applied, written)
        if self.copies is not None and applied.dropped:
            self.copies.drop(applied.events)
        self._check_fill()

    def _check_fill(self) -> None:
        high, _ = policy.watermarks(self.placement.settings, "host", self.host.capacity_bytes)
        if self.host.active_bytes > high:
            self.filled()

    def owner(self, user_ref: int) -> tuple[str, int]:
        """``(tenant_id, user_ref)`` of a namespace, for the host tier's quotas."""
        return (self.tenant_of(user_ref) or "", user_ref)

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

    def sweep(self) -> list[str]:
        """Delete this node's page files the catalog no longer records (see :meth:`DiskTier.sweep`)."""
        with self.catalog.read() as conn:
            recorded = set(pages.all_segments(conn, "disk", self.node_ref))
        removed = self.disk.sweep(recorded)
        if removed:
            log.info("deleted %d page files the catalog no longer records", len(removed))
        return removed

    def abort(self, written: Sequence[WrittenSegment]) -> None:
        """Delete the files of a write whose transaction did not commit."""
        self.disk.remove([w.name for w in written])

    # -- reading ---------------------------------------------------------------------------

    def read(self, ids: Sequence[PageId], *, load: bool = True, prefetch: bool = False) -> Read:
        """Payloads in order, verified; see ``Store.read_pages``. A sealed page whose key is
        gone is a miss; a page whose bytes fail verification is a miss and listed in ``bad``.
        Pages read from disk go to host when ``load`` (an engine waits for them), when
        ``prefetch`` (moved up ahead of a load), or when the policy says so."""
        placement = self.placement
        with placement.hold(ids):
            return self._read(ids, load, prefetch)

    def _read(self, ids: Sequence[PageId], load: bool, prefetch: bool) -> Read:
        placement = self.placement
        now = placement.now()
        out = self.host.get_many(ids)
        if not prefetch:
            placement.touch(ids, now)
            hits = [ids[i] for i, v in enumerate(out) if v is not None]
            placement.count("host", "hits", len(hits))
            placement.prefetch_used(hits)
        entries = self.index.entries
        unknown = [ids[i] for i, v in enumerate(out) if v is None and ids[i] not in entries]
        if unknown:
            self._learn(unknown)
        wanted = [
            (i, entries[ids[i]])
            for i, v in enumerate(out)
            if v is None and ids[i] in entries and entries[ids[i]].disk is not None
        ]
        requests = [ReadRequest.at(entry.disk, entry.page_id, entry.checksum) for _, entry in wanted if entry.disk]
        failures: list[ReadFailure] = []
        for chunk in self.disk.read_chunks(requests, sealed_verified_by_caller=True, transient=True):
            failures.extend(chunk.failures)
            for j, record in chunk.records:
                i, entry = wanted[j]
                sealed = bool(record.flags & SEALED_FLAG)
                if len(record.payload) != entry.size + (OVERHEAD if sealed else 0):  # a flipped flag, say
                    failures.append(
                        ReadFailure(
                            j,
                            f"record at {requests[j].segment}:{requests[j].offset} has the wrong length for its flags",
                        )
                    )
                    continue
                if sealed:
                    sealer = self.keys.sealer_of(entry.namespace.user_ref)
                    if sealer is None:
                        continue
                    try:
                        data = sealer.open(record.payload, entry.page_id)
                    except SealError:
                        failures.append(
                            ReadFailure(j, f"record at {requests[j].segment}:{requests[j].offset} fails authentication")
                        )
                        continue
                else:
                    data = bytes(record.payload)
                out[i] = data
                if prefetch or placement.should_promote(entry.page_id, load=load, now=now):
                    evicted = self.host.put(
                        entry.page_id, data, self.owner(entry.namespace.user_ref), compete=not prefetch
                    )
                    if evicted is not None:
                        placement.count("host", "promotions")
                        placement.count("host", "moved_bytes", len(data))
                        placement.count("disk", "moved_bytes", len(data))
                        if prefetch:
                            placement.prefetch_issued(entry.page_id, now)
                    self.made_room(evicted)
                entry.namespace.bump()
        if not prefetch:
            served = sum(1 for i, _ in wanted if out[i] is not None)
            placement.count("host", "misses", len(ids) - len(hits))
            placement.count("disk", "hits", served)
            placement.count("disk", "misses", sum(v is None for v in out))
        if self.copies is not None:
            self._read_remote(ids, out)
        self._check_fill()
        bad = []
        for failure in failures:
            entry = wanted[failure.index][1]
            assert entry.disk is not None
            log.error("quarantined a page: %s", failure.reason)  # no page id: logs outlive erasures
            bad.append(
                Quarantined(
                    entry.page_id, entry.namespace.user_ref, entry.disk.segment, entry.disk.offset, failure.reason
                )
            )
        return Read(out, bad)

    def _read_remote(self, ids: Sequence[PageId], out: list[bytes | None]) -> None:
        """Fill ``out`` from the remote tier (:meth:`dss.copies.RemoteCopies.fetch`) and promote
        what came back to host."""
        assert self.copies is not None
        for i, entry, data in self.copies.fetch(ids, out):
            out[i] = data
            evicted = self.host.put(entry.page_id, data, self.owner(entry.namespace.user_ref))
            if evicted is not None:
                self.placement.count("host", "promotions")
                self.placement.count("host", "moved_bytes", len(data))
            self.made_room(evicted)
            entry.namespace.bump()

    def owners(self, ids: Sequence[PageId]) -> list[int | None]:
        """For each page id, the namespace holding it as far as this process knows (``None``: unknown)."""
        entries = self.index.entries
        unknown = [page_id for page_id in ids if page_id not in entries]
        if unknown:
            self._learn(unknown)
        return [entries[page_id].namespace.user_ref if page_id in entries else None for page_id in ids]

    def _learn(self, page_ids: list[PageId]) -> None:
        """Load catalog rows of pages this process has not seen (another process wrote them)."""
        with self.catalog.read() as conn:
            found = pages.pages_by_id(conn, page_ids, self.node_ref)
        for record in found:
            self.index.apply(self.index.namespace(record.user_ref), [record])
