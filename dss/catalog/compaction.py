"""Catalog rows compaction reads and rewrites (:mod:`dss.writes.compaction`): each segment's live
bytes, the live records to copy, and the move of pages to their copies in one transaction.

Functions here run on an open connection and neither begin nor commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import chunks, insert_id, now
from dss.catalog.pages import PageRecord, count_tier, drop_empty_segments, pages_by_id
from dss.catalog.schema import locations, pages, segments


class SegmentUsage(NamedTuple):
    """A segment file with the bytes its live records take (``live``: records some page row
    still locates there); the rest of ``size`` is dead (records of dropped pages, the header)."""

    ref: int
    name: str
    user_ref: int
    size: int
    live: int
    num_pages: int


class LiveRecord(NamedTuple):
    """Where a live page's record lies in a segment, with the checksum its bytes must have."""

    page_id: bytes
    segment_ref: int
    offset: int
    length: int
    checksum: int


def segment_usage(conn: Connection, tier: str, node_ref: int, refs: Sequence[int] | None = None) -> list[SegmentUsage]:
    """Every segment of a tier on node ``node_ref`` (or of ``refs`` only) with its live bytes, oldest first."""
    live = func.coalesce(func.sum(locations.c.length), 0)
    query = (
        select(
            segments.c.id, segments.c.name, segments.c.user_ref, segments.c.size, live, func.count(locations.c.page_id)
        )
        .outerjoin(locations, locations.c.segment_ref == segments.c.id)
        .where(segments.c.tier == tier, segments.c.node_ref == node_ref)
        .group_by(segments.c.id, segments.c.name, segments.c.user_ref, segments.c.size)
        .order_by(segments.c.id)
    )
    if refs is None:
        return [SegmentUsage(r[0], r[1], r[2], r[3], int(r[4]), r[5]) for r in conn.execute(query)]
    out: list[SegmentUsage] = []
    for part in chunks(sorted(set(refs))):
        out.extend(
            SegmentUsage(r[0], r[1], r[2], r[3], int(r[4]), r[5])
            for r in conn.execute(query.where(segments.c.id.in_(part)))
        )
    return sorted(out)


def live_records(conn: Connection, segment_refs: Sequence[int]) -> list[LiveRecord]:
    """The live records of these segments, by segment and offset."""
    out: list[LiveRecord] = []
    for part in chunks(segment_refs):
        out.extend(
            LiveRecord(bytes(r[0]), r[1], r[2], r[3], r[4])
            for r in conn.execute(
                select(
                    locations.c.page_id,
                    locations.c.segment_ref,
                    locations.c.offset,
                    locations.c.length,
                    pages.c.checksum,
                )
                .join(pages, pages.c.page_id == locations.c.page_id)
                .where(locations.c.segment_ref.in_(part))
            )
        )
    return sorted(out, key=lambda r: (r.segment_ref, r.offset))


def relocate(
    conn: Connection,
    name: str,
    tier: str,
    node_ref: int,
    user_ref: int,
    size: int,
    moves: Sequence[tuple[LiveRecord, int]],
    seq: int,
) -> tuple[list[PageRecord], list[str]]:
    """Record segment file ``name`` of node ``node_ref`` holding copies of live records (``(record, new_offset)``)
    and point each page still at its old place to its copy; the rows of old segments left with
    no page go. A page dropped or moved since ``moves`` was read stays as it is (its copy is
    dead). Moved pages are stamped with ``seq`` so other processes reload their location.

    Returns the pages moved (with their new location) and the names of the files left with no
    page: the emptied old segments, and the new one itself if no page moved.
    """
    where = {(m.page_id, m.segment_ref, m.offset, m.length) for m, _ in moves}
    current: set[tuple[bytes, int, int, int]] = set()
    for part in chunks([m.page_id for m, _ in moves]):
        current.update(
            (bytes(r[0]), r[1], r[2], r[3])
            for r in conn.execute(
                select(locations.c.page_id, locations.c.segment_ref, locations.c.offset, locations.c.length).where(
                    locations.c.tier == tier, locations.c.page_id.in_(part)
                )
            )
        )
    still = [(m, offset) for m, offset in moves if (m.page_id, m.segment_ref, m.offset, m.length) in current & where]
    old_refs = sorted({m.segment_ref for m, _ in moves})
    if not still:
        return [], drop_empty_segments(conn, old_refs) + [name]
    ref = insert_id(
        conn,
        insert(segments).values(
            name=name, tier=tier, node_ref=node_ref, user_ref=user_ref, size=size, created_at=now()
        ),
    )
    count_tier(conn, tier, node_ref, size, 1)
    for m, offset in still:
        conn.execute(
            update(locations)
            .where(locations.c.page_id == m.page_id, locations.c.tier == tier)
            .values(segment_ref=ref, offset=offset)
        )
    for part in chunks([m.page_id for m, _ in still]):
        conn.execute(update(pages).where(pages.c.page_id.in_(part)).values(seq=seq))
    moved = [
        PageRecord(m.page_id, r.user_ref, r.page_index, r.size, r.checksum, name, offset, m.length)
        for (m, offset), r in zip(still, _rows_of(conn, [m.page_id for m, _ in still], node_ref))
    ]
    return moved, drop_empty_segments(conn, old_refs)


def _rows_of(conn: Connection, page_ids: Sequence[bytes], node_ref: int) -> list[PageRecord]:
    """The rows of these pages, in the order given (every one must exist)."""
    found = {r.page_id: r for r in pages_by_id(conn, page_ids, node_ref)}
    return [found[p] for p in page_ids]


def still_located(conn: Connection, found: Sequence[Any]) -> list[Any]:
    """Of ``found`` (each with ``page_id``, ``segment`` and ``offset``), those whose page the
    catalog still locates at that segment and offset on disk (segment names are unique in the
    fleet: each starts with its writer's random id)."""
    out: list[Any] = []
    for part in chunks(list(found)):
        current = {
            (bytes(r[0]), r[1], r[2])
            for r in conn.execute(
                select(locations.c.page_id, segments.c.name, locations.c.offset)
                .join(segments, segments.c.id == locations.c.segment_ref)
                .where(locations.c.tier == "disk", locations.c.page_id.in_([f.page_id for f in part]))
            )
        }
        out.extend(f for f in part if (f.page_id, f.segment, f.offset) in current)
    return out
