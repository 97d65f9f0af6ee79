"""Catalog rows of erasures: the jobs, the audit receipts, and the queries an erasure runs on
a namespace's rows (count them, purge them, look for any left).

Functions here run on an open connection and neither begin nor commit.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import NamedTuple

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import aware, chunks, insert_id, now
from dss.catalog.namespaces import destroy_key
from dss.catalog.pages import delete_segments
from dss.catalog.schema import (
    audit,
    erasures,
    feed,
    locations,
    pages,
    quarantine,
    segments,
    session_pages,
    sessions,
    user_keys,
    users,
    versions,
)
from dss.core.errors import ErasureInProgress


class JobRecord(NamedTuple):
    """An erasure job row; ``plan`` is its JSON document."""

    id: int
    tenant_id: str
    user_id: str
    user_ref: int | None
    state: str
    plan: str
    started_at: dt.datetime


class AuditRecord(NamedTuple):
    id: int
    kind: str
    tenant_id: str
    user_id: str
    created_at: dt.datetime
    receipt: str


_job_select = select(
    erasures.c.id,
    erasures.c.tenant_id,
    erasures.c.user_id,
    erasures.c.user_ref,
    erasures.c.state,
    erasures.c.plan,
    erasures.c.started_at,
)


def _job(r: tuple) -> JobRecord:
    return JobRecord(r[0], r[1], r[2], r[3], r[4], r[5], aware(r[6]))


def job(conn: Connection, job_id: int) -> JobRecord:
    return _job(conn.execute(_job_select.where(erasures.c.id == job_id)).one())


def open_jobs(conn: Connection) -> list[JobRecord]:
    """Erasure jobs not finished, oldest first."""
    return [_job(r) for r in conn.execute(_job_select.where(erasures.c.finished_at.is_(None)).order_by(erasures.c.id))]


def open_job_of(conn: Connection, user_ref: int) -> JobRecord | None:
    row = conn.execute(_job_select.where(erasures.c.user_ref == user_ref, erasures.c.finished_at.is_(None))).first()
    return _job(row) if row else None


def open_job_for(conn: Connection, tenant_id: str, user_id: str) -> JobRecord | None:
    """The unfinished erasure job of a user, found by name (it outlives the user's row)."""
    row = conn.execute(
        _job_select.where(
            erasures.c.tenant_id == tenant_id, erasures.c.user_id == user_id, erasures.c.finished_at.is_(None)
        ).order_by(erasures.c.id)
    ).first()
    return _job(row) if row else None


def check_fence(conn: Connection, user_ref: int) -> None:
    """Raise ``ErasureInProgress`` when an erasure of namespace ``user_ref`` has begun and not
    finished. Run inside a write transaction (which the catalog serialises with the one that
    records the job), it fences the namespace for every process and node at once."""
    if (
        conn.execute(
            select(erasures.c.id).where(erasures.c.user_ref == user_ref, erasures.c.finished_at.is_(None))
        ).first()
        is not None
    ):
        raise ErasureInProgress("this user's data is being erased; try again when the erasure has finished")


def insert_job(
    conn: Connection,
    tenant_id: str,
    user_id: str,
    user_ref: int | None,
    plan: str,
    state: str = "planned",
    *,
    finished: bool = False,
) -> int:
    """A new job row in ``state`` (``finished``: a job that is final from the start)."""
    return insert_id(
        conn,
        insert(erasures).values(
            tenant_id=tenant_id,
            user_id=user_id,
            user_ref=user_ref,
            state=state,
            plan=plan,
            started_at=now(),
            finished_at=now() if finished else None,
        ),
    )


def record_plan(conn: Connection, job_id: int, state: str, plan: str) -> bool:
    """Replace job ``job_id``'s document while it stands in ``state``; say whether it did."""
    return bool(
        conn.execute(
            update(erasures).where(erasures.c.id == job_id, erasures.c.state == state).values(plan=plan)
        ).rowcount
    )


def advance_job(conn: Connection, job_id: int, state: str, to: str, plan: str | None, *, finished: bool) -> bool:
    """Move job ``job_id`` from ``state`` to ``to`` unless another process already moved it;
    say whether it moved. A finished job forgets the namespace row it erased."""
    values: dict = {"state": to}
    if plan is not None:
        values["plan"] = plan
    if finished:
        values["finished_at"] = now()
        values["user_ref"] = None
    return bool(
        conn.execute(
            update(erasures).where(erasures.c.id == job_id, erasures.c.state == state).values(**values)
        ).rowcount
    )


def insert_audit(conn: Connection, kind: str, tenant_id: str, user_id: str, receipt: str) -> int:
    return insert_id(
        conn, insert(audit).values(kind=kind, tenant_id=tenant_id, user_id=user_id, created_at=now(), receipt=receipt)
    )


def audit_rows(conn: Connection, tenant_id: str | None = None) -> list[AuditRecord]:
    query = select(
        audit.c.id, audit.c.kind, audit.c.tenant_id, audit.c.user_id, audit.c.created_at, audit.c.receipt
    ).order_by(audit.c.id)
    if tenant_id is not None:
        query = query.where(audit.c.tenant_id == tenant_id)
    return [AuditRecord(r[0], r[1], r[2], r[3], aware(r[4]), r[5]) for r in conn.execute(query)]


# -- a namespace's rows ----------------------------------------------------------------------


class Counts(NamedTuple):
    """What a namespace holds in the catalog."""

    sessions: int
    versions: int
    pages: int
    disk_files: int
    disk_bytes: int


def counts(conn: Connection, user_ref: int | None) -> Counts:
    if user_ref is None:
        return Counts(0, 0, 0, 0, 0)
    s, v, p, seg = sessions, versions, pages, segments
    num_sessions = conn.execute(select(func.count()).select_from(s).where(s.c.user_ref == user_ref)).scalar_one()
    num_versions = conn.execute(
        select(func.count()).select_from(v).join(s, s.c.id == v.c.session_ref).where(s.c.user_ref == user_ref)
    ).scalar_one()
    num_pages = conn.execute(select(func.count()).select_from(p).where(p.c.user_ref == user_ref)).scalar_one()
    files, size = conn.execute(
        select(func.count(), func.coalesce(func.sum(seg.c.size), 0)).where(
            seg.c.user_ref == user_ref, seg.c.tier == "disk"
        )
    ).one()
    return Counts(num_sessions, num_versions, num_pages, files, int(size))


def rows_left(conn: Connection, user_ref: int) -> dict[str, int]:
    """Rows of the namespace left in each table (the erasure's own ``forget`` notes in the feed
    carry only the number of a deleted row and do not count)."""
    s = sessions
    out = {
        "users": conn.execute(select(func.count()).select_from(users).where(users.c.id == user_ref)).scalar_one(),
        "user_keys": conn.execute(
            select(func.count()).select_from(user_keys).where(user_keys.c.user_ref == user_ref)
        ).scalar_one(),
        "sessions": conn.execute(select(func.count()).select_from(s).where(s.c.user_ref == user_ref)).scalar_one(),
        "versions": conn.execute(
            select(func.count())
            .select_from(versions)
            .join(s, s.c.id == versions.c.session_ref)
            .where(s.c.user_ref == user_ref)
        ).scalar_one(),
        "pages": conn.execute(select(func.count()).select_from(pages).where(pages.c.user_ref == user_ref)).scalar_one(),
    }
    for table in (segments, quarantine):
        out[table.name] = conn.execute(
            select(func.count()).select_from(table).where(table.c.user_ref == user_ref)
        ).scalar_one()
    out["feed"] = conn.execute(
        select(func.count()).select_from(feed).where(feed.c.user_ref == user_ref, feed.c.kind != "forget")
    ).scalar_one()
    return out


class Purged(NamedTuple):
    """What a purge deleted: counts before it, the page ids (sorted) and the segment files."""

    counts: Counts
    page_ids: list[bytes]
    files: list[str]


def purge(conn: Connection, user_ref: int) -> Purged:
    """Delete every catalog row of a namespace (its key too); return what went."""
    before = counts(conn, user_ref)
    session_refs = [r[0] for r in conn.execute(select(sessions.c.id).where(sessions.c.user_ref == user_ref))]
    page_ids = sorted(bytes(r[0]) for r in conn.execute(select(pages.c.page_id).where(pages.c.user_ref == user_ref)))
    files = [r[0] for r in conn.execute(select(segments.c.name).where(segments.c.user_ref == user_ref))]
    for part in chunks(session_refs):
        conn.execute(delete(session_pages).where(session_pages.c.session_ref.in_(part)))
        conn.execute(delete(versions).where(versions.c.session_ref.in_(part)))
    for part in chunks(page_ids):
        conn.execute(delete(session_pages).where(session_pages.c.page_id.in_(part)))
        conn.execute(delete(locations).where(locations.c.page_id.in_(part)))
    conn.execute(delete(pages).where(pages.c.user_ref == user_ref))
    delete_segments(conn, segments.c.user_ref == user_ref)
    conn.execute(delete(sessions).where(sessions.c.user_ref == user_ref))
    for table in (quarantine, feed):
        conn.execute(delete(table).where(table.c.user_ref == user_ref))
    destroy_key(conn, user_ref)
    conn.execute(delete(users).where(users.c.id == user_ref))
    return Purged(before, page_ids, files)


def digest_of(page_ids: list[bytes]) -> str:
    """The SHA-256 over sorted page ids that a receipt names them by."""
    digest = hashlib.sha256()
    for page_id in page_ids:
        digest.update(page_id)
    return digest.hexdigest()


VACUUMED = (
    "user_keys",
    "versions",
    "sessions",
    "pages",
    "session_pages",
    "page_locations",
    "segments",
    "users",
    "feed",
    "quarantine",
)
"""The PostgreSQL tables an erasure vacuums."""
