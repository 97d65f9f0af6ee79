"""Page storage: writing new pages to the tiers and the catalog, reading them back verified.

:class:`PageStore` carries out the placement policy (:mod:`dss.placement`) for the store.
A write takes four steps:

1. :meth:`PageStore.write` — outside any lock and transaction, write the new pages as segment
   files (each published atomically: temp file, fsync, rename, fsync of the folder);
2. :meth:`PageStore.place`, inside the caller's catalog transaction — drop disk segments if
   the new ones do not fit, and insert the rows of the pages no one stored meanwhile;
3. the caller commits the transaction (or, if anything raised, calls :meth:`PageStore.abort`,
   which deletes the files written);
4. :meth:`PageStore.settle` — delete the files of dropped or unused segments and bring this
   process's page index and host tier up to date.

Files are deleted only after the transaction that stopped referring to them committed. A
file written by a process that died before step 3 is an orphan; the next opener removes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from sqlalchemy import select

from dss import records
from dss.catalog import Catalog, Tx
from dss.crypto import Sealer, SealError
from dss.hashing import checksum
from dss.pageindex import Namespace, PageEntry, PageIndex
from dss.placement import pick_segments, room_needed
from dss.tiers.base import Located, ReadFailure, ReadRequest
from dss.tiers.disk import HEADER_BYTES, RECORD, DiskTier
from dss.tiers.host import HostTier
from dss.types import PageId

log = logging.getLogger("dss.pages")


class NewPage(NamedTuple):
    """A page to store: its id and index in its prompt, its payload, and the bytes that go
    to disk (sealed unless the store does not encrypt) with their checksum and record flags."""

    page_id: PageId
    index: int
    payload: bytes
    stored: bytes
    checksum: int
    flags: int


SEALED = 1
"""Record flag: the payload on disk is sealed under the owner's data key."""


class Written(NamedTuple):
    """A segment file written for new pages, and where each page lies in it."""

    segment: str
    size: int
    pages: list[tuple[NewPage, Located]]


@dataclass
class Placement:
    """What a page write did, for settling or undoing it."""

    written: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
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

    def fresh(self, ids: Sequence[PageId], payloads: Mapping[int, bytes], sealer: Sealer | None) -> list[NewPage]:
        """The given pages no durable tier holds yet (as far as this process knows), sealed
        with ``sealer`` (bound to their page ids) unless it is ``None``."""
        entries = self.index.entries
        out = []
        for i, payload in payloads.items():
            page_id = ids[i]
            if page_id in entries and entries[page_id].disk is not None:
                continue
            stored = sealer.seal(payload, page_id) if sealer is not None else payload
            out.append(NewPage(page_id, i, payload, stored, checksum(stored), SEALED if sealer is not None else 0))
        return out

    def write(self, placement: Placement, fresh: list[NewPage]) -> list[Written]:
        """Write ``fresh`` as segment files of at most ``segment_bytes`` each; no catalog, no lock.

        Writes nothing when the pages could never fit the tier.
        """
        out: list[Written] = []
        if not fresh or _segment_size(fresh) > self.disk_bytes:
            return out
        for batch in self._batches(fresh):
            segment, size, located = self.disk.write([(p.page_id, p.checksum, p.stored, p.flags) for p in batch])
            placement.written.append(segment)
            out.append(Written(segment, size, list(zip(batch, located))))
        return out

    def place(self, tx: Tx, placement: Placement, *, user_ref: int, layout_ref: int, written: list[Written],
              wanted: Sequence[PageId]) -> None:
        """Record the written segments in the catalog, making room first; fill ``placement``.

        ``placement.held`` becomes every page of ``wanted`` (plus the new ones) that the
        catalog holds once the transaction commits. Pages someone stored since they were
        written are not recorded twice; a segment left with no page of its own is unused.
        """
        if written:
            need = sum(w.size for w in written)
            self._make_room(tx, placement, need)
            if self._fits(tx, need):
                self._record(tx, placement, user_ref, layout_ref, written)
            else:
                placement.unused += [w.segment for w in written]
        existing = records.existing_pages(tx.conn, [p for p in wanted if p not in placement.inserted])
        placement.held = existing | set(placement.inserted)
        if placement.inserted:
            self.catalog.note(tx, "pages", user_ref=user_ref)

    def abort(self, placement: Placement) -> None:
        """Undo the files of a placement whose transaction rolled back."""
        self.disk.remove(placement.written)

    def settle(self, placement: Placement, ns: Namespace, ids: Sequence[PageId], payloads: Mapping[int, bytes]) -> None:
        """After the transaction committed: delete dead files, update the index and host tier."""
        self.disk.remove([*placement.emptied, *placement.unused])
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
        self._note_gone(tx, "evict", [(PageId(r.page_id), r.user_ref) for r in records.pages_by_id(tx.conn, pages)])
        placement.emptied += records.drop_pages(tx.conn, pages, tx.seq)
        placement.emptied += records.drop_empty_segments(tx.conn, refs)
        placement.evicted += pages
        log.info("disk tier full: dropped %d pages in %d segments", len(pages), len(victims))

    def _pinned_segments(self, tx: Tx) -> set[int]:
        pinned = self._pinned_pages(tx)
        segments: set[int] = set()
        for part in records.chunks(pinned):
            segments.update(r[0] for r in tx.conn.execute(
                select(records.locations.c.segment_ref).where(records.locations.c.page_id.in_(part))))
        return segments

    def _fits(self, tx: Tx, need: int) -> bool:
        used = records.tier_bytes(tx.conn, "disk")
        if used + need <= self.disk_bytes:
            return True
        log.warning("disk tier full (%d of %d bytes held by pinned versions): %d new bytes stay in host only",
                    used, self.disk_bytes, need)
        return False

    def _record(self, tx: Tx, placement: Placement, user_ref: int, layout_ref: int, written: list[Written]) -> None:
        existing = records.existing_pages(tx.conn, [p.page_id for w in written for p, _ in w.pages])
        stamp = records.now()
        for segment in written:
            placed = [(p, where) for p, where in segment.pages if p.page_id not in existing]
            if not placed:
                placement.unused.append(segment.segment)
                continue
            segment_ref = records.insert_segment(tx.conn, segment.segment, "disk", user_ref, segment.size)
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
            grow = RECORD.size + len(page.stored)
            if batches[-1] and size + grow > self.segment_bytes:
                batches.append([])
                size = HEADER_BYTES
            batches[-1].append(page)
            size += grow
        return [b for b in batches if b]

    # -- reading ---------------------------------------------------------------------------

    def read(self, ids: Sequence[PageId], write: Callable[[], object],
             sealer_of: Callable[[int], Sealer | None]) -> list[bytes | None]:
        """Payloads in order, ``None`` where no tier holds valid bytes; see ``Store.read_pages``.

        ``write`` opens a write transaction (the store's), used to quarantine bad pages;
        ``sealer_of(user_ref)`` gives the sealer of a namespace (``None``: its key is gone,
        so its sealed pages are a miss).
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
        found, failures = self.disk.read(requests)
        failures = list(failures)
        for j, ((i, entry), record) in enumerate(zip(wanted, found)):
            if record is None:
                continue
            if record.flags & SEALED:
                sealer = sealer_of(entry.ns.user_ref)
                if sealer is None:
                    continue
                try:
                    data = sealer.open(record.payload, entry.page_id)
                except SealError:
                    failures.append(ReadFailure(j, f"record at {requests[j].segment}:{requests[j].offset} "
                                                   "fails authentication"))
                    continue
            else:
                data = bytes(record.payload)
            out[i] = data
            evicted = self.host.put(entry.page_id, data)
            if evicted:
                self.index.left_host(evicted)
            entry.ns.bump()
        if failures:
            self._quarantine([(wanted[f.index][1], f.reason) for f in failures], write)
        return out

    def owned_by(self, ids: Sequence[PageId], allowed: Callable[[int], bool]) -> list[bool]:
        """For each page id, whether this process knows it and ``allowed(owner's user_ref)``."""
        entries = self.index.entries
        unknown = [page_id for page_id in ids if page_id not in entries]
        if unknown:
            self._learn(unknown)
        return [page_id in entries and allowed(entries[page_id].ns.user_ref) for page_id in ids]

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
                log.error("quarantined a page: %s", reason)  # no page id: logs must outlive no erasure
            ids = [e.page_id for e, _ in bad]
            emptied = records.drop_pages(tx.conn, ids, tx.seq)
            self._note_gone(tx, "drop", [(e.page_id, e.ns.user_ref) for e, _ in bad])
        self.disk.remove(emptied)
        self.index.forget(ids)

    def _note_gone(self, tx: Tx, kind: str, owned: list[tuple[PageId, int]]) -> None:
        """Record in the change feed that these pages left the catalog, under each page's
        namespace (an erasure deletes a namespace's feed rows with it: no page id survives)."""
        by_owner: dict[int, list[bytes]] = {}
        for page_id, user_ref in owned:
            by_owner.setdefault(user_ref, []).append(page_id)
        for user_ref, ids in by_owner.items():
            self.catalog.note(tx, kind, user_ref=user_ref, page_ids=ids)


def _segment_size(fresh: Sequence[NewPage]) -> int:
    return HEADER_BYTES + sum(RECORD.size + len(p.stored) for p in fresh)
