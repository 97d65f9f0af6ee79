"""Compaction of the disk tier: sparse segment files rewritten so dead bytes stop taking room.

Segment files are never changed once written, so a page dropped from a segment (its session
deleted, the page quarantined) leaves its record behind as **dead** bytes that still count
against ``disk_bytes``. A segment is **sparse** when its dead records (those no page row
locates there) reach ``compact_dead_share`` of its size. Compaction:

1. reads, in one catalog read, the sparse segments and the live records in them;
2. per namespace, reads those records (batched, verified: page id, length, checksum) and
   copies them as they are — sealed bytes are never opened — into new segment files of at
   most ``segment_bytes`` of live data, each published like any segment (temp file, fsync,
   rename, fsync of the folder);
3. applies one :class:`~dss.catalog.change.Change` per new file in one transaction: the new
   segment's row, every copied page pointed at its copy (a page dropped or moved meanwhile is
   left alone), the rows of old segments left without a page gone;
4. after that commit, deletes the old files.

Inactive segments (demoted by the mover: the first to leave when a write needs room, see
:mod:`dss.tiers.inactive`) are left alone: rewriting them would spend I/O on bytes about to go,
and their pages would land in a new file the mover has not demoted, undoing its order.

A kill before step 3 commits leaves the new file unrecorded: the next opener deletes it (its
writer is dead) and the old files still hold every page. A kill after the commit and before
step 4 leaves the old files unrecorded: the next opener deletes them once their writers are
gone. Either way no page is lost and ``check()`` is empty. A record that fails verification
while being copied is quarantined in the same change (it would be on its next read).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

from dss.catalog import compaction as rows
from dss.catalog.change import Change, MovedSegment, Quarantined
from dss.catalog.compaction import LiveRecord, SegmentUsage
from dss.catalog.database import Catalog
from dss.core.types import PageId
from dss.tiers.base import ReadRequest
from dss.tiers.disk import DiskTier
from dss.tiers.segment import HEADER_BYTES

log = logging.getLogger("dss.writes.compaction")


class Compaction(NamedTuple):
    """What a compaction did (or, with ``dry_run``, would do): segment files rewritten and
    written, pages copied, and the disk tier's bytes before and after."""

    dry_run: bool
    segments: int
    new_segments: int
    pages: int
    bytes_before: int
    bytes_after: int
    quarantined: int = 0

    @property
    def freed_bytes(self) -> int:
        return self.bytes_before - self.bytes_after


def is_sparse(segment: SegmentUsage, dead_share: float) -> bool:
    """Whether a segment's dead records (its header aside: a file just compacted has none,
    so it is never rewritten again until a page of it goes) reach ``dead_share`` of its size."""
    dead = segment.size - HEADER_BYTES - segment.live
    return dead > 0 and dead >= dead_share * segment.size


def plan(
    usage: Sequence[SegmentUsage], dead_share: float, segment_bytes: int, skip: Container[str] = frozenset()
) -> list[list[SegmentUsage]]:
    """The sparse segments (but those named in ``skip``), grouped: one group per new file (one
    namespace, at most ``segment_bytes`` of live records, or one segment alone)."""
    groups: list[list[SegmentUsage]] = []
    sparse = sorted(
        (s for s in usage if s.name not in skip and is_sparse(s, dead_share)), key=lambda s: (s.user_ref, s.ref)
    )
    for _, same_user in itertools.groupby(sparse, key=lambda s: s.user_ref):
        group: list[SegmentUsage] = []
        live = HEADER_BYTES
        for segment in same_user:
            if group and live + segment.live > segment_bytes:
                groups.append(group)
                group, live = [], HEADER_BYTES
            group.append(segment)
            live += segment.live
        if group:
            groups.append(group)
    return groups


Apply = Callable[[Change, Sequence[str]], object]
"""``apply(change, files)``: apply a change in one transaction of its own and delete the files
the change left without a page once it committed (the writer's), or ``files`` when it did not."""


class Compactor:
    """Rewrites sparse segments of the disk tier (see the module docstring); the writer runs
    it (:meth:`dss.writes.writer.Writer.compact`), between writes, never inside one."""

    def __init__(
        self, catalog: Catalog, disk: DiskTier, *, node_ref: int, dead_share: float, segment_bytes: int
    ) -> None:
        """``node_ref``: this node (only its own segment files are compacted)."""
        self.catalog = catalog
        self.disk = disk
        self.node_ref = node_ref
        self.dead_share = dead_share
        self.segment_bytes = segment_bytes

    def usage(self, refs: Sequence[int] | None = None) -> list[SegmentUsage]:
        with self.catalog.read() as conn:
            return rows.segment_usage(conn, "disk", self.node_ref, refs)

    def has_sparse(self, refs: Sequence[int] | None = None) -> bool:
        """Whether some active segment (of ``refs``, if given) is sparse (one catalog read)."""
        return any(is_sparse(s, self.dead_share) and s.name not in self.disk.inactive for s in self.usage(refs))

    def run(self, apply: Apply, *, dry_run: bool = False) -> Compaction:
        """Compact every sparse active segment now, each group's change applied with ``apply`` (or,
        with ``dry_run``, say what that would do)."""
        usage = self.usage()
        before = sum(s.size for s in usage)
        groups = plan(usage, self.dead_share, self.segment_bytes, self.disk.inactive)
        if dry_run:
            after = (
                before
                - sum(s.size for g in groups for s in g)
                + sum(HEADER_BYTES + sum(s.live for s in g) for g in groups)
            )
            return Compaction(
                True,
                sum(len(g) for g in groups),
                len(groups),
                sum(s.num_pages for g in groups for s in g),
                before,
                after,
            )
        copied = written = quarantined = rewritten = 0
        for group in groups:
            moved, bad, made = self._rewrite(group, apply)
            copied += moved
            quarantined += bad
            written += made
            rewritten += len(group)
        after = sum(s.size for s in self.usage())
        if rewritten:
            log.info("compacted %d segment files into %d: %d bytes freed", rewritten, written, before - after)
        return Compaction(False, rewritten, written, copied, before, after, quarantined)

    def _rewrite(self, group: list[SegmentUsage], apply: Apply) -> tuple[int, int, int]:
        """Copy a group's live records into one new file and apply the change; returns
        ``(pages copied, pages quarantined, files written)``."""
        names = {s.ref: s.name for s in group}
        user_ref = group[0].user_ref
        with self.catalog.read() as conn:
            records = rows.live_records(conn, list(names))
        requests = [
            ReadRequest(names[r.segment_ref], r.offset, r.length, PageId(r.page_id), r.checksum) for r in records
        ]
        found, failures = self.disk.read(requests)
        bad = tuple(
            Quarantined(
                PageId(records[f.index].page_id),
                user_ref,
                requests[f.index].segment,
                requests[f.index].offset,
                f.reason,
            )
            for f in failures
        )
        good: list[tuple[LiveRecord, int, bytes, int]] = []
        for record, stored in zip(records, found):
            if stored is not None:
                good.append((record, record.checksum, stored.payload, stored.flags))  # type: ignore[arg-type]
        moved: tuple[MovedSegment, ...] = ()
        files: list[str] = []
        if good:
            name, size, located = self.disk.write([(PageId(r.page_id), c, p, f) for r, c, p, f in good])
            files.append(name)
            moves = tuple((r, where.offset) for (r, _, _, _), where in zip(good, located))
            moved = (MovedSegment(name, "disk", self.node_ref, user_ref, size, moves),)
        if moved or bad:
            apply(Change(user_ref=user_ref, quarantine=bad, move=moved), files)
        return len(good), len(bad), len(files)
