"""Queries on the catalog's tables, each on an open connection.

Functions here neither begin nor commit: the caller (the store) opens a read or write
transaction with :class:`dss.catalog.Catalog` and calls several of them inside it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, TypeVar

from sqlalchemy import ColumnElement, and_, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog import aware, now
from dss.errors import CatalogCorrupt, InvalidLayout
from dss.schema import (
    Audit,
    Change,
    Erasure,
    LayoutRow,
    PageLocation,
    PageRef,
    PageRow,
    Quarantine,
    Segment,
    SessionRow,
    StoreMeta,
    Tenant,
    TierTotal,
    User,
    UserKey,
    VersionRow,
)
from dss.types import Layout

tenants, users, layouts = Tenant.__table__, User.__table__, LayoutRow.__table__
sessions, versions = SessionRow.__table__, VersionRow.__table__
pages, locations, refs = PageRow.__table__, PageLocation.__table__, PageRef.__table__
segments, quarantine = Segment.__table__, Quarantine.__table__
user_keys, store_meta = UserKey.__table__, StoreMeta.__table__
erasures, audit, changes = Erasure.__table__, Audit.__table__, Change.__table__
tier_totals = TierTotal.__table__

CHUNK = 500
"""Largest ``IN (...)`` list sent in one statement."""

T = TypeVar("T")


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- namespaces and layouts ------------------------------------------------------------------


def ensure_tenant(conn: Connection, tenant_id: str) -> int:
    ref = conn.execute(select(tenants.c.id).where(tenants.c.tenant_id == tenant_id)).scalar()
    if ref is None:
        ref = conn.execute(insert(tenants).values(tenant_id=tenant_id, created_at=now())).inserted_primary_key[0]
    return int(ref)


def find_user(conn: Connection, tenant_id: str, user_id: str) -> int | None:
    return conn.execute(select(users.c.id).join(tenants, tenants.c.id == users.c.tenant_ref).where(
        tenants.c.tenant_id == tenant_id, users.c.user_id == user_id)).scalar()


def tenant_of(conn: Connection, user_ref: int) -> str | None:
    return conn.execute(select(tenants.c.tenant_id).join(users, users.c.tenant_ref == tenants.c.id)
                        .where(users.c.id == user_ref)).scalar()


def ensure_user(conn: Connection, tenant_ref: int, user_id: str) -> int:
    where = and_(users.c.tenant_ref == tenant_ref, users.c.user_id == user_id)
    ref = conn.execute(select(users.c.id).where(where)).scalar()
    if ref is None:
        ref = conn.execute(
            insert(users).values(tenant_ref=tenant_ref, user_id=user_id, created_at=now())
        ).inserted_primary_key[0]
    return int(ref)


def ensure_layout(conn: Connection, layout: Layout) -> int:
    ref = conn.execute(select(layouts.c.id).where(layouts.c.digest == layout.digest)).scalar()
    if ref is None:
        ref = conn.execute(insert(layouts).values(
            digest=layout.digest, name=layout.name, page_tokens=layout.page_tokens,
            page_bytes=layout.page_bytes, spec=json.dumps(layout.to_dict(), sort_keys=True),
        )).inserted_primary_key[0]
    return int(ref)


# -- sessions --------------------------------------------------------------------------------


class SessionRecord(NamedTuple):
    """A session row. ``session_id`` is ``""`` as read: the id is stored only sealed
    (``sealed_name``), and :meth:`dss.mirror.Mirror.opened` fills it in."""

    ref: int
    session_id: str
    tenant_id: str
    user_id: str
    tenant_ref: int
    user_ref: int
    layout_ref: int
    layout: Layout
    head_id: int | None
    created_at: dt.datetime
    last_access: dt.datetime
    seq: int
    session_key: bytes
    sealed_name: bytes


_session_select = (
    select(sessions.c.id, tenants.c.tenant_id, users.c.user_id, sessions.c.tenant_ref,
           sessions.c.user_ref, sessions.c.layout_ref, layouts.c.spec, sessions.c.head_id, sessions.c.created_at,
           sessions.c.last_access, sessions.c.seq, sessions.c.session_key, sessions.c.name)
    .join(tenants, tenants.c.id == sessions.c.tenant_ref)
    .join(users, users.c.id == sessions.c.user_ref)
    .join(layouts, layouts.c.id == sessions.c.layout_ref)
)


def _session_record(row: tuple) -> SessionRecord:
    ref, tenant, user, tenant_ref, user_ref, layout_ref, spec, head, created, last, seq, key, name = row
    return SessionRecord(ref, "", tenant, user, tenant_ref, user_ref, layout_ref, stored_layout(layout_ref, spec),
                         head, aware(created), aware(last), seq, bytes(key), bytes(name))


def stored_layout(layout_ref: int, spec: str) -> Layout:
    """The layout of a ``layouts`` row; raises ``CatalogCorrupt`` if the row does not decode."""
    try:
        return Layout.from_dict(json.loads(spec))
    except (ValueError, TypeError, InvalidLayout) as exc:
        raise CatalogCorrupt(f"layout {layout_ref} in the catalog does not decode ({exc}): the row is damaged") \
            from None


def find_sessions(conn: Connection, session_key: bytes, tenant_id: str | None) -> list[SessionRecord]:
    """Sessions whose id has the keyed hash ``session_key`` (in ``tenant_id`` if given; several
    tenants may reuse an id)."""
    query = _session_select.where(sessions.c.session_key == session_key)
    if tenant_id is not None:
        query = query.where(tenants.c.tenant_id == tenant_id)
    return [_session_record(r) for r in conn.execute(query)]


def session_by_ref(conn: Connection, ref: int) -> SessionRecord | None:
    row = conn.execute(_session_select.where(sessions.c.id == ref)).first()
    return _session_record(row) if row else None


def list_sessions(conn: Connection, tenant_id: str | None = None, user_id: str | None = None) -> list[tuple[SessionRecord, int]]:
    """Every session (filtered by owner) with its number of versions, oldest first."""
    counts = select(versions.c.session_ref, func.count().label("n")).group_by(versions.c.session_ref).subquery()
    query = _session_select.add_columns(func.coalesce(counts.c.n, 0)).outerjoin(
        counts, counts.c.session_ref == sessions.c.id).order_by(sessions.c.id)
    if tenant_id is not None:
        query = query.where(tenants.c.tenant_id == tenant_id)
    if user_id is not None:
        query = query.where(users.c.user_id == user_id)
    return [(_session_record(r[:-1]), int(r[-1])) for r in conn.execute(query)]


def insert_session(conn: Connection, session_key: bytes, sealed_name: bytes, tenant_ref: int, user_ref: int,
                   layout_ref: int, seq: int) -> int:
    stamp = now()
    return int(conn.execute(insert(sessions).values(
        session_key=session_key, name=sealed_name, tenant_ref=tenant_ref, user_ref=user_ref, layout_ref=layout_ref,
        head_id=None, created_at=stamp, last_access=stamp, seq=seq,
    )).inserted_primary_key[0])


def update_session(conn: Connection, session_ref: int, seq: int, head_id: int | None = None) -> None:
    """Stamp a session changed by transaction ``seq`` (and move its head, if given)."""
    values: dict = {"seq": seq, "last_access": now()}
    if head_id is not None:
        values["head_id"] = head_id
    conn.execute(update(sessions).where(sessions.c.id == session_ref).values(**values))


def delete_session(conn: Connection, session_ref: int) -> list[bytes]:
    """Delete a session, its versions and its page references; return the ids of the
    pages it referenced that no session references any more."""
    held = [r[0] for r in conn.execute(select(refs.c.page_id).where(refs.c.session_ref == session_ref))]
    conn.execute(delete(refs).where(refs.c.session_ref == session_ref))
    conn.execute(delete(versions).where(versions.c.session_ref == session_ref))
    conn.execute(delete(sessions).where(sessions.c.id == session_ref))
    still = set()
    for part in chunks(held):
        still.update(r[0] for r in conn.execute(select(refs.c.page_id).where(refs.c.page_id.in_(part))))
    return [p for p in held if p not in still]


# -- versions --------------------------------------------------------------------------------


class VersionRecord(NamedTuple):
    """A version row; ``suffix`` is sealed when ``sealed`` (see :mod:`dss.crypto`). As read,
    ``label`` is ``None`` and ``sealed_label`` holds the stored label; :meth:`dss.mirror.Mirror.unsealed`
    opens both."""

    version_id: int
    session_ref: int
    parent_id: int | None
    base_id: int | None
    base_len: int
    num_tokens: int
    suffix: bytes
    label: str | None
    pinned: bool
    created_at: dt.datetime
    sealed: bool = False
    sealed_label: bytes | None = None


def _version_record(row: tuple) -> VersionRecord:
    vid, sref, parent, base, base_len, num, suffix, label, pinned, created, sealed = row
    return VersionRecord(vid, sref, parent, base, base_len, num, bytes(suffix), None, bool(pinned), aware(created),
                         bool(sealed), bytes(label) if label is not None else None)


_version_columns = (versions.c.id, versions.c.session_ref, versions.c.parent_id, versions.c.base_id,
                    versions.c.base_len, versions.c.num_tokens, versions.c.suffix, versions.c.label,
                    versions.c.pinned, versions.c.created_at, versions.c.sealed)


def session_versions(conn: Connection, session_ref: int) -> list[VersionRecord]:
    """Every version of a session, oldest first."""
    query = select(*_version_columns).where(versions.c.session_ref == session_ref).order_by(versions.c.id)
    return [_version_record(r) for r in conn.execute(query)]


def insert_version(conn: Connection, session_ref: int, parent_id: int | None, base_id: int | None, base_len: int,
                   num_tokens: int, suffix: bytes, sealed_label: bytes | None, sealed: bool) -> int:
    return int(conn.execute(insert(versions).values(
        session_ref=session_ref, parent_id=parent_id, base_id=base_id, base_len=base_len, num_tokens=num_tokens,
        suffix=suffix, label=sealed_label, pinned=False, created_at=now(), sealed=sealed,
    )).inserted_primary_key[0])


def set_pinned(conn: Connection, version_id: int, pinned: bool) -> None:
    conn.execute(update(versions).where(versions.c.id == version_id).values(pinned=pinned))


def pinned_versions(conn: Connection) -> list[tuple[int, int]]:
    """``(session_ref, version_id)`` of every pinned version."""
    return [tuple(r) for r in conn.execute(select(versions.c.session_ref, versions.c.id).where(versions.c.pinned))]


# -- pages -----------------------------------------------------------------------------------


class PageRecord(NamedTuple):
    page_id: bytes
    user_ref: int
    page_index: int
    size: int
    checksum: int
    segment: str | None
    offset: int
    length: int


_page_select = (
    select(pages.c.page_id, pages.c.user_ref, pages.c.page_index, pages.c.size, pages.c.checksum,
           segments.c.name, locations.c.offset, locations.c.length)
    .outerjoin(locations, and_(locations.c.page_id == pages.c.page_id, locations.c.tier == "disk"))
    .outerjoin(segments, segments.c.id == locations.c.segment_ref)
)


def _page_record(r: tuple) -> PageRecord:
    return PageRecord(bytes(r[0]), r[1], r[2], r[3], r[4], r[5], r[6] or 0, r[7] or 0)


def namespace_pages(conn: Connection, user_ref: int, since_seq: int | None = None) -> list[PageRecord]:
    """Pages of a namespace with their disk location (``since_seq``: changed at or after it)."""
    query = _page_select.where(pages.c.user_ref == user_ref)
    if since_seq is not None:
        query = query.where(pages.c.seq >= since_seq)
    return [_page_record(r) for r in conn.execute(query)]


def pages_by_id(conn: Connection, page_ids: Sequence[bytes]) -> list[PageRecord]:
    """The rows of these pages (absent ones are left out)."""
    out: list[PageRecord] = []
    for part in chunks(page_ids):
        out.extend(_page_record(r) for r in conn.execute(_page_select.where(pages.c.page_id.in_(part))))
    return out


def existing_pages(conn: Connection, page_ids: Sequence[bytes]) -> set[bytes]:
    found: set[bytes] = set()
    for part in chunks(page_ids):
        found.update(bytes(r[0]) for r in conn.execute(select(pages.c.page_id).where(pages.c.page_id.in_(part))))
    return found


def insert_segment(conn: Connection, name: str, tier: str, user_ref: int, size: int) -> int:
    ref = int(conn.execute(insert(segments).values(
        name=name, tier=tier, user_ref=user_ref, size=size, created_at=now())).inserted_primary_key[0])
    _count(conn, tier, size, 1)
    return ref


def delete_segments(conn: Connection, where: ColumnElement[bool]) -> list[str]:
    """Delete the segment rows matching ``where`` (keeping the tier totals); return their names."""
    gone = conn.execute(select(segments.c.name, segments.c.tier, segments.c.size).where(where)).all()
    conn.execute(delete(segments).where(where))
    for tier in {row[1] for row in gone}:
        rows = [row for row in gone if row[1] == tier]
        _count(conn, tier, -sum(row[2] for row in rows), -len(rows))
    return [row[0] for row in gone]


def _count(conn: Connection, tier: str, size: int, num: int) -> None:
    updated = conn.execute(update(tier_totals).where(tier_totals.c.tier == tier).values(
        bytes=tier_totals.c.bytes + size, num_segments=tier_totals.c.num_segments + num)).rowcount
    if not updated:
        conn.execute(insert(tier_totals).values(tier=tier, bytes=size, num_segments=num))


def insert_pages(conn: Connection, page_rows: list[dict], location_rows: list[dict]) -> None:
    if page_rows:
        conn.execute(insert(pages), page_rows)
    if location_rows:
        conn.execute(insert(locations), location_rows)


def session_refs(conn: Connection, session_ref: int) -> dict[bytes, int]:
    """The pages a session holds, with the newest of its versions holding each (0: saved ahead)."""
    return {bytes(r[0]): r[1] for r in conn.execute(
        select(refs.c.page_id, refs.c.version_ref).where(refs.c.session_ref == session_ref))}


def add_refs(conn: Connection, session_ref: int, page_ids: Iterable[bytes], version_id: int) -> None:
    rows = [{"session_ref": session_ref, "page_id": p, "version_ref": version_id} for p in page_ids]
    if rows:
        conn.execute(insert(refs), rows)


def touch_refs(conn: Connection, session_ref: int, page_ids: Sequence[bytes], version_id: int) -> None:
    """Mark ``version_id`` as the newest version of the session containing these pages."""
    for part in chunks(page_ids):
        conn.execute(update(refs).where(refs.c.session_ref == session_ref, refs.c.page_id.in_(part))
                     .values(version_ref=version_id))


def retag_refs(conn: Connection, session_ref: int, old_version: int, version_id: int) -> None:
    """Move every page of the session tagged ``old_version`` to ``version_id``."""
    conn.execute(update(refs).where(refs.c.session_ref == session_ref, refs.c.version_ref == old_version)
                 .values(version_ref=version_id))


def drop_pages(conn: Connection, page_ids: Sequence[bytes], seq: int) -> list[str]:
    """Delete pages with their references and locations; delete the rows of segments left
    with no page and return their names (their files go after the transaction commits).

    Every session that held one of the pages is stamped with ``seq`` (this transaction's):
    its references changed, so a process that cached them reloads the session before its
    next write to it instead of believing it still holds the pages.
    """
    touched: set[int] = set()
    for part in chunks(page_ids):
        touched.update(r[0] for r in conn.execute(
            select(locations.c.segment_ref).where(locations.c.page_id.in_(part)).distinct()))
        holders = select(refs.c.session_ref).where(refs.c.page_id.in_(part))
        conn.execute(update(sessions).where(sessions.c.id.in_(holders)).values(seq=seq))
        conn.execute(delete(refs).where(refs.c.page_id.in_(part)))
        conn.execute(delete(locations).where(locations.c.page_id.in_(part)))
        conn.execute(delete(pages).where(pages.c.page_id.in_(part)))
    return drop_empty_segments(conn, sorted(touched))


def drop_empty_segments(conn: Connection, segment_refs: Sequence[int]) -> list[str]:
    """Delete the rows of those segments that hold no page; return their names."""
    emptied: list[str] = []
    for part in chunks(segment_refs):
        live = {r[0] for r in conn.execute(
            select(locations.c.segment_ref).where(locations.c.segment_ref.in_(part)).distinct())}
        dead = [s for s in part if s not in live]
        if dead:
            emptied.extend(delete_segments(conn, segments.c.id.in_(dead)))
    return emptied


def add_quarantine(conn: Connection, page_id: bytes, user_ref: int, tier: str, segment: str, offset: int,
                   reason: str) -> None:
    conn.execute(insert(quarantine).values(page_id=page_id, user_ref=user_ref, tier=tier, segment=segment,
                                           offset=offset, reason=reason, detected_at=now()))


# -- tiers -----------------------------------------------------------------------------------


def tier_bytes(conn: Connection, tier: str) -> int:
    """Bytes of every segment file of a tier, the space it occupies (from the running total)."""
    return int(conn.execute(select(tier_totals.c.bytes).where(tier_totals.c.tier == tier)).scalar() or 0)


def eviction_order(conn: Connection, tier: str) -> list[tuple[int, str, int]]:
    """Segments of a tier as ``(ref, name, size)``, the first to drop first.

    A segment's age is the newest version that contains any of its pages (page_refs'
    ``version_ref``); segments whose pages no version holds come first, then oldest first.
    """
    newest = func.max(refs.c.version_ref)
    query = (
        select(segments.c.id, segments.c.name, segments.c.size, newest)
        .outerjoin(locations, locations.c.segment_ref == segments.c.id)
        .outerjoin(refs, refs.c.page_id == locations.c.page_id)
        .where(segments.c.tier == tier)
        .group_by(segments.c.id, segments.c.name, segments.c.size)
        .order_by(func.coalesce(newest, -1), segments.c.id)
    )
    return [(r[0], r[1], r[2]) for r in conn.execute(query)]


def segment_pages(conn: Connection, segment_refs: Sequence[int]) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {s: [] for s in segment_refs}
    for part in chunks(segment_refs):
        for seg, page_id in conn.execute(
                select(locations.c.segment_ref, locations.c.page_id).where(locations.c.segment_ref.in_(part))):
            out[seg].append(bytes(page_id))
    return out


def all_segments(conn: Connection, tier: str) -> dict[str, tuple[int, int]]:
    """``name -> (ref, size)`` of every segment of a tier."""
    return {r[0]: (r[1], r[2]) for r in conn.execute(
        select(segments.c.name, segments.c.id, segments.c.size).where(segments.c.tier == tier))}


# -- keys and store facts ---------------------------------------------------------------------


def wrapped_key(conn: Connection, user_ref: int) -> bytes | None:
    value = conn.execute(select(user_keys.c.wrapped).where(user_keys.c.user_ref == user_ref)).scalar()
    return bytes(value) if value is not None else None


def insert_key(conn: Connection, user_ref: int, wrapped: bytes) -> None:
    conn.execute(insert(user_keys).values(user_ref=user_ref, wrapped=wrapped, created_at=now()))


def destroy_key(conn: Connection, user_ref: int) -> bool:
    """Overwrite, then delete, a user's wrapped key; return whether there was one."""
    conn.execute(update(user_keys).where(user_keys.c.user_ref == user_ref).values(wrapped=b"\0" * 60))
    return bool(conn.execute(delete(user_keys).where(user_keys.c.user_ref == user_ref)).rowcount)


def users_without_key(conn: Connection) -> list[int]:
    """Users that have no data key and no erasure under way (rows from before revision 0002)."""
    erasing = select(erasures.c.user_ref).where(erasures.c.user_ref.is_not(None))
    return [r[0] for r in conn.execute(select(users.c.id).where(
        ~select(user_keys.c.user_ref).where(user_keys.c.user_ref == users.c.id).exists(),
        users.c.id.not_in(erasing)))]


def meta(conn: Connection, key: str) -> bytes | None:
    value = conn.execute(select(store_meta.c.value).where(store_meta.c.key == key)).scalar()
    return bytes(value) if value is not None else None


def set_meta(conn: Connection, key: str, value: bytes) -> None:
    conn.execute(insert(store_meta).values(key=key, value=value))


# -- erasures and audit ------------------------------------------------------------------------


class ErasureRecord(NamedTuple):
    id: int
    tenant_id: str
    user_id: str
    user_ref: int | None
    state: str
    plan: str
    started_at: dt.datetime


def _erasure_record(r: tuple) -> ErasureRecord:
    return ErasureRecord(r[0], r[1], r[2], r[3], r[4], r[5], aware(r[6]))


_erasure_select = select(erasures.c.id, erasures.c.tenant_id, erasures.c.user_id, erasures.c.user_ref,
                         erasures.c.state, erasures.c.plan, erasures.c.started_at)


def open_erasures(conn: Connection) -> list[ErasureRecord]:
    """Erasure jobs not finished, oldest first."""
    return [_erasure_record(r) for r in conn.execute(
        _erasure_select.where(erasures.c.finished_at.is_(None)).order_by(erasures.c.id))]


def erasure_of(conn: Connection, user_ref: int) -> ErasureRecord | None:
    row = conn.execute(_erasure_select.where(erasures.c.user_ref == user_ref, erasures.c.finished_at.is_(None))).first()
    return _erasure_record(row) if row else None


def insert_erasure(conn: Connection, tenant_id: str, user_id: str, user_ref: int | None, plan: str) -> int:
    return int(conn.execute(insert(erasures).values(
        tenant_id=tenant_id, user_id=user_id, user_ref=user_ref, state="planned", plan=plan, started_at=now(),
    )).inserted_primary_key[0])


def set_erasure(conn: Connection, erasure_id: int, state: str, plan: str | None = None, finished: bool = False) -> None:
    values: dict = {"state": state}
    if plan is not None:
        values["plan"] = plan
    if finished:
        values["finished_at"] = now()
        values["user_ref"] = None
    conn.execute(update(erasures).where(erasures.c.id == erasure_id).values(**values))


def insert_audit(conn: Connection, kind: str, tenant_id: str, user_id: str, receipt: str) -> int:
    return int(conn.execute(insert(audit).values(
        kind=kind, tenant_id=tenant_id, user_id=user_id, created_at=now(), receipt=receipt)).inserted_primary_key[0])


def audit_rows(conn: Connection, tenant_id: str | None = None) -> list[tuple[int, str, str, str, dt.datetime, str]]:
    query = select(audit.c.id, audit.c.kind, audit.c.tenant_id, audit.c.user_id, audit.c.created_at,
                   audit.c.receipt).order_by(audit.c.id)
    if tenant_id is not None:
        query = query.where(audit.c.tenant_id == tenant_id)
    return [(r[0], r[1], r[2], r[3], aware(r[4]), r[5]) for r in conn.execute(query)]
