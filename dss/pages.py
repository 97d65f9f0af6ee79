"""Page storage: writing new pages to the tiers and the catalog, reading them back verified.

:class:`PageStore` carries out the placement policy (:mod:`dss.placement`) for the store.
A write happens inside the caller's catalog transaction in three steps:

1. :meth:`PageStore.place` — drop disk segments if the new pages would not fit, write the
   new pages as segment files (published atomically), insert their catalog rows;
2. the caller commits the transaction (or, if anything raised, calls :meth:`PageStore.abort`,
   which deletes the files written);
3. :meth:`PageStore.settle` — delete the files of dropped segments and bring this process's
   page index and host tier up to date.

Files are deleted only after the transaction that stopped referring to them committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sqlalchemy import select

from dss import records
from dss.catalog import Catalog, Tx
from dss.hashing import checksum
from dss.pageindex import Namespace, PageEntry, PageIndex
from dss.placement import pick_segments, room_needed
from dss.tiers.base import Located, ReadRequest
from dss.tiers.disk import HEADER_BYTES, RECORD, DiskTier
from dss.tiers.host import HostTier
from dss.types import PageId

log = logging.getLogger("dss.pages")


class NewPage(NamedTuple):
    """A page to store: its id, checksum, payload and index in its prompt."""

    page_id: PageId
    checksum: int
    payload: bytes
    index: int


@dataclass
class Placement:
    """What :meth:`PageStore.place` did inside a transaction, for settling or undoing it."""

    written: list[str] = field(default_factory=list)
    emptied: list[str] = field(default_factory=list)
    evicted: list[PageId] = field(default_factory=list)
    inserted: dict[PageId, tuple[NewPage, Located]] = field(default_factory=dict)
    held: set[bytes] = field(default_factory=set)


class PageStore:
    """Pages across the host and disk tiers, recorded in the catalog."""

    def __init__(self, catalog: Catalog, disk: DiskTier, host: HostTier, index: PageIndex, *, disk_bytes: int,
                 segment_bytes: int, pinned_pages: Callable[[Tx], list[bytes]]) -> None:
        self.catalog = catalog
        self.disk = disk
        self.host = host
        self.index = index
        self.disk_bytes = disk_bytes
        self.segment_bytes = segment_bytes
        self._pinned_pages = pinned_pages

    # -- writing ---------------------------------------------------------------------------

    def fresh(self, ids: Sequence[PageId], payloads: Mapping[int, bytes]) -> list[NewPage]:
        """The given pages no durable tier holds yet (as far as this process knows)."""
        entries = self.index.entries
        return [NewPage(ids[i], checksum(p), p, i) for i, p in payloads.items()
                if not (ids[i] in entries and entries[ids[i]].disk is not None)]

    def place(self, tx: Tx, placement: Placement, *, user_ref: int, layout_ref: int, fresh: list[NewPage],
              wanted: Sequence[PageId]) -> None:
        """Store ``fresh`` on disk and in the catalog; fill ``placement``.

        ``placement.held`` becomes every page of ``wanted`` (plus the new ones) that the
        catalog holds once the transaction commits. Pages another process stored since
        this one last looked are not written again.
        """
        if fresh:
            self._make_room(tx, placement, sum(RECORD.size + len(p.payload) for p in fresh) + HEADER_BYTES)
            if self._fits(tx, fresh):
                self._write(tx, placement, user_ref, layout_ref, fresh)
        existing = records.existing_pages(tx.conn, [p for p in wanted if p not in placement.inserted])
        placement.held = existing | set(placement.inserted)
        if placement.inserted:
            self.catalog.note(tx, "pages", user_ref=user_ref)

    def abort(self, placement: Placement) -> None:
        """Undo the files of a placement whose transaction rolled back."""
        self.disk.remove(placement.written)

    def settle(self, placement: Placement, ns: Namespace, ids: Sequence[PageId], payloads: Mapping[int, bytes]) -> None:
        """After the transaction committed: delete dead files, update the index and host tier."""
        self.disk.remove(placement.emptied)
        self.index.lose_durable(placement.evicted)
        entries = self.index.entries
        for page_id, (page, where) in placement.inserted.items():
            self.index.add(PageEntry(page_id, ns, page.index, len(page.payload), page.checksum, where))
        for index, payload in payloads.items():
            page_id = ids[index]
            if page_id not in entries:  # not durable: the disk tier had no room
                self.index.add(PageEntry(page_id, ns, index, len(payload), checksum(payload), None))
            evicted = self.host.put(page_id, payload)
            if evicted is None:
                if entries[page_id].disk is None:
                    self.index.forget([page_id])
            elif evicted:
                self.index.left_host(evicted)
        ns.bump()

    def _make_room(self, tx: Tx, placement: Placement, need: int) -> None:
        to_free = room_needed(records.tier_bytes(tx.conn, "disk"), need, self.disk_bytes)
        if to_free <= 0 or need > self.disk_bytes:
            return
        protected = self._pinned_segments(tx)
        victims = pick_segments(records.eviction_order(tx.conn, "disk"), to_free, protected.__contains__)
        if not victims:
            return
        refs = [v[0] for v in victims]
        pages = [PageId(p) for ids in records.segment_pages(tx.conn, refs).values() for p in ids]
        placement.emptied += records.drop_pages(tx.conn, pages)
        placement.emptied += records.drop_empty_segments(tx.conn, refs)
        placement.evicted += pages
        self.catalog.note(tx, "evict", page_ids=pages)
        log.info("disk tier full: dropped %d pages in %d segments", len(pages), len(victims))

    def _pinned_segments(self, tx: Tx) -> set[int]:
        pinned = self._pinned_pages(tx)
        segments: set[int] = set()
        for part in records.chunks(pinned):
            segments.update(r[0] for r in tx.conn.execute(
                select(records.locations.c.segment_ref).where(records.locations.c.page_id.in_(part))))
        return segments

    def _fits(self, tx: Tx, fresh: list[NewPage]) -> bool:
        used = records.tier_bytes(tx.conn, "disk")
        need = HEADER_BYTES + sum(RECORD.size + len(p.payload) for p in fresh)
        if used + need <= self.disk_bytes:
            return True
        log.warning("disk tier full (%d of %d bytes held by pinned versions, or the batch is too large): "
                    "%d pages stay in host only", used, self.disk_bytes, len(fresh))
        return False

    def _write(self, tx: Tx, placement: Placement, user_ref: int, layout_ref: int, fresh: list[NewPage]) -> None:
        existing = records.existing_pages(tx.conn, [p.page_id for p in fresh])
        stamp = records.now()
        for batch in self._batches([p for p in fresh if p.page_id not in existing]):
            segment, size, located = self.disk.write([(p.page_id, p.checksum, p.payload) for p in batch])
            placement.written.append(segment)
            placed = list(zip(batch, located))
            segment_ref = records.insert_segment(tx.conn, segment, "disk", user_ref, size)
            records.insert_pages(
                tx.conn,
                [{"page_id": p.page_id, "user_ref": user_ref, "layout_ref": layout_ref, "page_index": p.index,
                  "size": len(p.payload), "checksum": p.checksum, "created_at": stamp, "seq": tx.seq}
                 for p, _ in placed],
                [{"page_id": p.page_id, "tier": "disk", "segment_ref": segment_ref, "offset": where.offset,
                  "length": where.length} for p, where in placed])
            placement.inserted.update((p.page_id, (p, where)) for p, where in placed)

    def _batches(self, fresh: list[NewPage]) -> list[list[NewPage]]:
        """Split pages into batches whose segment stays within ``segment_bytes``."""
        batches: list[list[NewPage]] = [[]]
        size = HEADER_BYTES
        for page in fresh:
            grow = RECORD.size + len(page.payload)
            if batches[-1] and size + grow > self.segment_bytes:
                batches.append([])
                size = HEADER_BYTES
            batches[-1].append(page)
            size += grow
        return [b for b in batches if b]

    # -- reading ---------------------------------------------------------------------------

    def read(self, ids: Sequence[PageId], write: Callable[[], object]) -> list[bytes | None]:
        """Payloads in order, ``None`` where no tier holds valid bytes; see ``Store.read_pages``.

        ``write`` opens a write transaction (the store's), used to quarantine bad pages.
        """
        out = self.host.get_many(ids)
        entries = self.index.entries
        unknown = [ids[i] for i, v in enumerate(out) if v is None and ids[i] not in entries]
        if unknown:
            self._learn(unknown)
        wanted = [(i, entries[ids[i]]) for i, v in enumerate(out)
                  if v is None and ids[i] in entries and entries[ids[i]].disk is not None]
        requests = [ReadRequest(*entry.disk, entry.page_id, entry.checksum)  # type: ignore[misc]
                    for _, entry in wanted]
        payloads, failures = self.disk.read(requests)
        for (i, entry), payload in zip(wanted, payloads):
            if payload is None:
                continue
            data = out[i] = bytes(payload)
            evicted = self.host.put(entry.page_id, data)
            if evicted:
                self.index.left_host(evicted)
            entry.ns.bump()
        if failures:
            self._quarantine([(wanted[f.index][1], f.reason) for f in failures], write)
        return out

    def _learn(self, page_ids: list[PageId]) -> None:
        """Load catalog rows of pages this process has not seen (another process wrote them)."""
        with self.catalog.read() as conn:
            found = records.pages_by_id(conn, page_ids)
        for record in found:
            self.index.apply(self.index.namespace(record.user_ref), [record])

    def _quarantine(self, bad: list[tuple[PageEntry, str]], write: Callable[[], object]) -> None:
        with write() as tx:  # type: ignore[attr-defined]
            for entry, reason in bad:
                assert entry.disk is not None
                records.add_quarantine(tx.conn, entry.page_id, entry.ns.user_ref, "disk", entry.disk.segment,
                                       entry.disk.offset, reason)
                log.error("quarantined page %s: %s", entry.page_id.hex(), reason)
            ids = [e.page_id for e, _ in bad]
            emptied = records.drop_pages(tx.conn, ids)
            self.catalog.note(tx, "drop", page_ids=ids)
        self.disk.remove(emptied)
        self.index.forget(ids)
