"""Catalog rows of pages: pages, their locations in segment files, the segments, quarantine
and the tiers' running totals. Which sessions hold which pages is :mod:`dss.catalog.holds`';
what each tier holds, :mod:`dss.catalog.segments`'.

Functions here run on an open connection and neither begin nor commit. Deleting rows never
deletes a file: functions return the names of segment files left without a page, and the
caller deletes them once the transaction committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import ColumnElement, Select, and_, bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import chunks, insert_id, now
from dss.catalog.schema import (
    locations,
    pages,
    quarantine,
    segments,
    session_pages,
    sessions,
    tenants,
    tier_totals,
    users,
)

# The statements every commit runs, built once: building and keying a statement costs more
# than executing it (SQLAlchemy memoizes a statement object's cache key, not an equal one's).
_EXISTING = select(pages.c.page_id).where(pages.c.page_id.in_(bindparam("ids", expanding=True)))
_INSERT_SEGMENT = insert(segments)
_INSERT_PAGES = insert(pages)
_INSERT_LOCATIONS = insert(locations)
_COUNT_TIER = (
    update(tier_totals)
    .where(tier_totals.c.tier == bindparam("t_tier"), tier_totals.c.node_ref == bindparam("t_node"))
    .values(
        bytes=tier_totals.c.bytes + bindparam("t_bytes"), num_segments=tier_totals.c.num_segments + bindparam("t_num")
    )
)


class PageRecord(NamedTuple):
    """A page row with its disk location (``segment`` ``None``: on no disk segment)."""

    page_id: bytes
    user_ref: int
    page_index: int
    size: int
    checksum: int
    segment: str | None
    offset: int
    length: int
    encoding: str = "exact"
    """The precision of the page's durable copy (its disk copy, which the remote tier shares)."""


def _page_select(node_ref: int) -> Select:
    """Page rows with their disk location on node ``node_ref`` (none where another node's disk holds them)."""
    return (
        select(
            pages.c.page_id,
            pages.c.user_ref,
            pages.c.page_index,
            pages.c.size,
            pages.c.checksum,
            segments.c.name,
            locations.c.offset,
            locations.c.length,
            locations.c.encoding,
        )
        .outerjoin(locations, and_(locations.c.page_id == pages.c.page_id, locations.c.tier == "disk"))
        .outerjoin(segments, and_(segments.c.id == locations.c.segment_ref, segments.c.node_ref == node_ref))
    )


def _page_record(r: tuple) -> PageRecord:
    encoding = r[8] or "exact"
    if r[5] is None:
        return PageRecord(bytes(r[0]), r[1], r[2], r[3], r[4], None, 0, 0, encoding)
    return PageRecord(bytes(r[0]), r[1], r[2], r[3], r[4], r[5], r[6] or 0, r[7] or 0, encoding)


def namespace_pages(conn: Connection, user_ref: int, node_ref: int, since_seq: int | None = None) -> list[PageRecord]:
    """Pages of a namespace with their disk location on node ``node_ref`` (``since_seq``: stored at or after it)."""
    query = _page_select(node_ref).where(pages.c.user_ref == user_ref)
    if since_seq is not None:
        query = query.where(pages.c.seq >= since_seq)
    return [_page_record(r) for r in conn.execute(query)]


def pages_by_id(conn: Connection, page_ids: Sequence[bytes], node_ref: int) -> list[PageRecord]:
    """The rows of these pages, with their disk location on node ``node_ref`` (absent ones are left out)."""
    out: list[PageRecord] = []
    query = _page_select(node_ref)
    for part in chunks(page_ids):
        out.extend(_page_record(r) for r in conn.execute(query.where(pages.c.page_id.in_(part))))
    return out


def existing_pages(conn: Connection, page_ids: Sequence[bytes]) -> set[bytes]:
    found: set[bytes] = set()
    for part in chunks(page_ids):
        found.update(bytes(r[0]) for r in conn.execute(_EXISTING, {"ids": list(part)}))
    return found


def page_owners(conn: Connection, page_ids: Sequence[bytes]) -> dict[bytes, tuple[str, int]]:
    """``page_id -> (tenant_id, size)`` for the pages the catalog knows (others are left out)."""
    query = (
        select(pages.c.page_id, tenants.c.tenant_id, pages.c.size)
        .join(users, users.c.id == pages.c.user_ref)
        .join(tenants, tenants.c.id == users.c.tenant_ref)
    )
    out: dict[bytes, tuple[str, int]] = {}
    for part in chunks(list(dict.fromkeys(page_ids))):
        for page_id, tenant_id, size in conn.execute(query.where(pages.c.page_id.in_(part))):
            out[bytes(page_id)] = (tenant_id, size)
    return out


def insert_segment(
    conn: Connection,
    name: str,
    tier: str,
    node_ref: int,
    user_ref: int,
    size: int,
    page_rows: list[dict],
    location_rows: list[dict],
) -> None:
    """Record a segment file of node ``node_ref`` and the pages it holds (``segment_ref`` is filled in)."""
    ref = insert_id(
        conn,
        _INSERT_SEGMENT,
        {"name": name, "tier": tier, "node_ref": node_ref, "user_ref": user_ref, "size": size, "created_at": now()},
    )
    count_tier(conn, tier, node_ref, size, 1)
    conn.execute(_INSERT_PAGES, page_rows)
    conn.execute(_INSERT_LOCATIONS, [{**row, "segment_ref": ref} for row in location_rows])


def delete_segments(conn: Connection, where: ColumnElement[bool]) -> list[str]:
    """Delete the segment rows matching ``where`` (keeping the tier totals); return their names."""
    gone = conn.execute(
        select(segments.c.name, segments.c.tier, segments.c.node_ref, segments.c.size).where(where)
    ).all()
    conn.execute(delete(segments).where(where))
    for tier, node_ref in sorted({(row[1], row[2]) for row in gone}):
        rows = [row for row in gone if (row[1], row[2]) == (tier, node_ref)]
        count_tier(conn, tier, node_ref, -sum(row[3] for row in rows), -len(rows))
    return [row[0] for row in gone]


def count_tier(conn: Connection, tier: str, node_ref: int, size: int, num: int) -> None:
    """Add ``size`` bytes and ``num`` segments to node ``node_ref``'s running total of a tier."""
    updated = conn.execute(_COUNT_TIER, {"t_tier": tier, "t_node": node_ref, "t_bytes": size, "t_num": num}).rowcount
    if not updated:
        conn.execute(insert(tier_totals).values(tier=tier, node_ref=node_ref, bytes=size, num_segments=num))


def drop_pages(
    conn: Connection, page_ids: Sequence[bytes], seq: int, thinned: list[int] | None = None
) -> tuple[list[int], list[str]]:
    """Delete pages with their holds and locations; delete the rows of segments left with no
    page. Returns the sessions that held any of them and the names of the emptied files;
    ``thinned`` (if given) gets the segments that lost pages but keep some (their dead bytes grew).

    Every session that held one of the pages is stamped with ``seq`` (this transaction's):
    what it holds changed, so a process that cached it reloads it before its next write.
    """
    touched: set[int] = set()
    holders: set[int] = set()
    for part in chunks(page_ids):
        touched.update(
            r[0] for r in conn.execute(select(locations.c.segment_ref).where(locations.c.page_id.in_(part)).distinct())
        )
        holders.update(
            r[0]
            for r in conn.execute(
                select(session_pages.c.session_ref).where(session_pages.c.page_id.in_(part)).distinct()
            )
        )
        conn.execute(delete(session_pages).where(session_pages.c.page_id.in_(part)))
        conn.execute(delete(locations).where(locations.c.page_id.in_(part)))
        conn.execute(delete(pages).where(pages.c.page_id.in_(part)))
    for refs in chunks(sorted(holders)):
        conn.execute(update(sessions).where(sessions.c.id.in_(refs)).values(seq=seq))
    emptied = drop_empty_segments(conn, sorted(touched), kept=thinned)
    return sorted(holders), emptied


def drop_empty_segments(conn: Connection, segment_refs: Sequence[int], kept: list[int] | None = None) -> list[str]:
    """Delete the rows of those segments that hold no page; return their names (``kept``, if
    given, gets the others)."""
    emptied: list[str] = []
    for part in chunks(segment_refs):
        live = {
            r[0]
            for r in conn.execute(select(locations.c.segment_ref).where(locations.c.segment_ref.in_(part)).distinct())
        }
        if kept is not None:
            kept.extend(s for s in part if s in live)
        dead = [s for s in part if s not in live]
        if dead:
            emptied.extend(delete_segments(conn, segments.c.id.in_(dead)))
    return emptied


def add_quarantine(
    conn: Connection, page_id: bytes, user_ref: int, tier: str, segment: str, offset: int, reason: str
) -> None:
    conn.execute(
        insert(quarantine).values(
            page_id=page_id,
            user_ref=user_ref,
            tier=tier,
            segment=segment,
            offset=offset,
            reason=reason,
            detected_at=now(),
        )
    )
