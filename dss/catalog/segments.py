"""Catalog rows of what each tier holds: its segments and their pages, bytes per tier, owner and
node, and the policy's recorded statistics. Functions here run on an open connection and
neither begin nor commit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Select, bindparam, case, delete, func, insert, select
from sqlalchemy.engine import Connection

from dss.catalog.database import chunks, now
from dss.catalog.schema import (
    locations,
    nodes,
    pages,
    segments,
    session_pages,
    sessions,
    tier_policy,
    tier_totals,
    users,
)
from dss.core.types import PageId

_TIER_BYTES = select(tier_totals.c.bytes).where(
    tier_totals.c.tier == bindparam("tier"), tier_totals.c.node_ref == bindparam("node_ref")
)


class SegmentRow(NamedTuple):
    """A segment file of a durable tier: ``ref`` its row id, ``newest`` the newest version
    holding any of its pages (-1: none), ``is_pinned`` whether a pinned version holds one,
    ``is_live`` whether a session's head holds one (read from each page's newest version, so
    just after a rollback, until the session's next commit, the pages the head shares with the
    branch it left look not live)."""

    ref: int
    name: str
    size: int
    newest: int
    is_pinned: bool
    is_live: bool

    @property
    def is_abandoned(self) -> bool:
        """Versions of sessions hold some of its pages, but no session's head does: a branch
        left behind (pages saved without a session, or ahead of a commit, are not)."""
        return self.newest > 0 and not self.is_live


def disk_nodes(conn: Connection, page_ids: Sequence[bytes]) -> dict[bytes, str]:
    """For each of these pages that some node's disk holds, that node's id (the catalog keeps
    one disk copy of a page in the fleet)."""
    out: dict[bytes, str] = {}
    for part in chunks(page_ids):
        rows = conn.execute(
            select(locations.c.page_id, nodes.c.node_id)
            .join(segments, segments.c.id == locations.c.segment_ref)
            .join(nodes, nodes.c.id == segments.c.node_ref)
            .where(locations.c.page_id.in_(part), locations.c.tier == "disk")
        )
        out.update({bytes(page_id): node_id for page_id, node_id in rows})
    return out


def tier_bytes(conn: Connection, tier: str, node_ref: int) -> int:
    """Bytes of every segment file of a node's tier, the space it occupies (from the running total)."""
    return int(conn.execute(_TIER_BYTES, {"tier": tier, "node_ref": node_ref}).scalar() or 0)


def _weighed(tier: str, node_ref: int) -> Select:
    """Segments of a node's tier with what eviction weighs (newest version, pinned, live)."""
    newest = func.coalesce(func.max(session_pages.c.version_ref), -1)
    pinned = func.coalesce(func.max(case((session_pages.c.pinned, 1), else_=0)), 0)
    live = func.coalesce(func.max(case((session_pages.c.version_ref == sessions.c.head_id, 1), else_=0)), 0)
    return (
        select(segments.c.id, segments.c.name, segments.c.size, newest, pinned, live)
        .outerjoin(locations, locations.c.segment_ref == segments.c.id)
        .outerjoin(session_pages, session_pages.c.page_id == locations.c.page_id)
        .outerjoin(sessions, sessions.c.id == session_pages.c.session_ref)
        .where(segments.c.tier == tier, segments.c.node_ref == node_ref)
        .group_by(segments.c.id, segments.c.name, segments.c.size)
        .order_by(newest, segments.c.id)
    )


def tier_segments(conn: Connection, tier: str, node_ref: int) -> list[SegmentRow]:
    """Every segment of a node's tier with what eviction weighs, oldest newest-version first."""
    return [_row(r) for r in conn.execute(_weighed(tier, node_ref))]


def _row(r: Any) -> SegmentRow:
    return SegmentRow(r[0], r[1], r[2], r[3], bool(r[4]), bool(r[5]))


def named_segments(conn: Connection, tier: str, node_ref: int, names: Sequence[str]) -> dict[str, SegmentRow]:
    """``name -> row`` of those of these segments that a node's tier still holds."""
    out: dict[str, SegmentRow] = {}
    for part in chunks(names):
        for r in conn.execute(_weighed(tier, node_ref).where(segments.c.name.in_(part))):
            out[r[1]] = _row(r)
    return out


def segment_pages(conn: Connection, segment_refs: Sequence[int]) -> list[tuple[bytes, int]]:
    """``(page_id, user_ref)`` of every page in these segments."""
    out: list[tuple[bytes, int]] = []
    for part in chunks(segment_refs):
        out.extend(
            (bytes(r[0]), r[1])
            for r in conn.execute(
                select(locations.c.page_id, pages.c.user_ref)
                .join(pages, pages.c.page_id == locations.c.page_id)
                .where(locations.c.segment_ref.in_(part))
            )
        )
    return out


def all_segments(conn: Connection, tier: str, node_ref: int) -> dict[str, tuple[int, int]]:
    """``name -> (ref, size)`` of every segment of a node's tier."""
    return {
        r[0]: (r[1], r[2])
        for r in conn.execute(
            select(segments.c.name, segments.c.id, segments.c.size).where(
                segments.c.tier == tier, segments.c.node_ref == node_ref
            )
        )
    }


def disk_extents(conn: Connection, node_ref: int) -> dict[int, list[tuple[int, int]]]:
    """``segment_ref -> [(offset, length), ...]`` of every page located on a node's disk."""
    extents: dict[int, list[tuple[int, int]]] = {}
    for seg, offset, length in conn.execute(
        select(locations.c.segment_ref, locations.c.offset, locations.c.length)
        .join(segments, segments.c.id == locations.c.segment_ref)
        .where(locations.c.tier == "disk", segments.c.node_ref == node_ref)
    ):
        extents.setdefault(seg, []).append((offset, length))
    return extents


def count_located(conn: Connection, tier: str, node_ref: int) -> int:
    """Pages located on a node's tier."""
    return int(
        conn.execute(
            select(func.count())
            .select_from(locations)
            .join(segments, segments.c.id == locations.c.segment_ref)
            .where(locations.c.tier == tier, segments.c.node_ref == node_ref)
        ).scalar_one()
    )


def user_page_ids(conn: Connection, user_ref: int) -> list[bytes]:
    """Every page id of a namespace (on any node), sorted."""
    return sorted(bytes(r[0]) for r in conn.execute(select(pages.c.page_id).where(pages.c.user_ref == user_ref)))


def count_unheld_pages(conn: Connection) -> int:
    """Pages no session holds."""
    return int(
        conn.execute(
            select(func.count())
            .select_from(pages)
            .where(~select(session_pages.c.page_id).where(session_pages.c.page_id == pages.c.page_id).exists())
        ).scalar_one()
    )


def count_homeless_pages(conn: Connection) -> int:
    """Pages with no location on any tier."""
    return int(
        conn.execute(
            select(func.count())
            .select_from(pages)
            .where(~select(locations.c.page_id).where(locations.c.page_id == pages.c.page_id).exists())
        ).scalar_one()
    )


def owner_bytes(conn: Connection, tier: str, user_ref: int) -> tuple[int, int, int]:
    """Bytes of a tier's segments of the namespace ``user_ref``, of its whole tenant, and the
    tenant's row number."""
    tenant_ref = int(conn.execute(select(users.c.tenant_ref).where(users.c.id == user_ref)).scalar_one())
    mine = conn.execute(
        select(func.coalesce(func.sum(segments.c.size), 0)).where(
            segments.c.tier == tier, segments.c.user_ref == user_ref
        )
    ).scalar_one()
    theirs = conn.execute(
        select(func.coalesce(func.sum(segments.c.size), 0))
        .join(users, users.c.id == segments.c.user_ref)
        .where(segments.c.tier == tier, users.c.tenant_ref == tenant_ref)
    ).scalar_one()
    return int(mine), int(theirs), tenant_ref


def segment_owners(conn: Connection, tier: str) -> dict[int, tuple[int, int]]:
    """``segment_ref -> (user_ref, tenant_ref)`` of every segment of a tier."""
    return {
        r[0]: (r[1], r[2])
        for r in conn.execute(
            select(segments.c.id, segments.c.user_ref, users.c.tenant_ref)
            .join(users, users.c.id == segments.c.user_ref)
            .where(segments.c.tier == tier)
        )
    }


def segment_page_ids(conn: Connection, tier: str) -> dict[int, list[PageId]]:
    """``segment_ref -> [page_id, ...]`` of every page located on a tier."""
    out: dict[int, list[PageId]] = {}
    for ref, page_id in conn.execute(
        select(locations.c.segment_ref, locations.c.page_id).where(locations.c.tier == tier)
    ):
        out.setdefault(ref, []).append(PageId(bytes(page_id)))
    return out


def record_policy(conn: Connection, process: str, rows: Sequence[dict]) -> None:
    """Replace ``process``'s rows of ``tier_policy`` (one per tier) with ``rows``."""
    conn.execute(delete(tier_policy).where(tier_policy.c.process == process))
    if rows:
        stamp = now()
        conn.execute(insert(tier_policy), [{**row, "process": process, "updated_at": stamp} for row in rows])
