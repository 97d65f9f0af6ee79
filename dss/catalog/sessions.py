"""Catalog rows of sessions and versions.

A session row holds its id only sealed (``name``) and is found by a keyed hash of the id
(``session_key``); a version row holds only the tokens it adds to a base version, sealed.
Records come back as they are stored: :class:`dss.sessions.mirror.Mirror` opens what is sealed.
Functions here run on an open connection and neither begin nor commit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import aware, chunks, insert_id
from dss.catalog.namespaces import stored_layout
from dss.catalog.schema import layouts, sessions, tenants, users, versions
from dss.core.types import Layout

# Statements every commit runs, built once (see dss.catalog.pages).
_SEQ_OF = select(sessions.c.seq).where(sessions.c.id == bindparam("ref"))
_INSERT_VERSION = insert(versions)
_STAMP = (
    update(sessions)
    .where(sessions.c.id == bindparam("ref"))
    .values(seq=bindparam("seq"), last_access=bindparam("stamp"))
)
_STAMP_HEAD = _STAMP.values(head_id=bindparam("head"))


class SessionRecord(NamedTuple):
    """A session row. ``session_id`` is ``""`` as read: the id is stored only sealed
    (``sealed_name``), and :meth:`dss.sessions.mirror.Mirror.opened` fills it in."""

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


class VersionRecord(NamedTuple):
    """A version row. As read, ``suffix`` is sealed when ``sealed``, ``label`` is ``None`` and
    ``sealed_label`` holds the stored label; :meth:`dss.sessions.mirror.Mirror.unsealed` opens both."""

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


_session_select = (
    select(
        sessions.c.id,
        tenants.c.tenant_id,
        users.c.user_id,
        sessions.c.tenant_ref,
        sessions.c.user_ref,
        sessions.c.layout_ref,
        layouts.c.spec,
        sessions.c.head_id,
        sessions.c.created_at,
        sessions.c.last_access,
        sessions.c.seq,
        sessions.c.session_key,
        sessions.c.name,
    )
    .join(tenants, tenants.c.id == sessions.c.tenant_ref)
    .join(users, users.c.id == sessions.c.user_ref)
    .join(layouts, layouts.c.id == sessions.c.layout_ref)
)


def _session_record(row: tuple) -> SessionRecord:
    ref, tenant, user, tenant_ref, user_ref, layout_ref, spec, head, created, last, seq, key, name = row
    return SessionRecord(
        ref,
        "",
        tenant,
        user,
        tenant_ref,
        user_ref,
        layout_ref,
        stored_layout(layout_ref, spec),
        head,
        aware(created),
        aware(last),
        seq,
        bytes(key),
        bytes(name),
    )


def find_sessions(conn: Connection, session_key: bytes, tenant_id: str | None) -> list[SessionRecord]:
    """Sessions whose id has the keyed hash ``session_key`` (in ``tenant_id`` if given; several
    tenants may reuse an id)."""
    query = _session_select.where(sessions.c.session_key == session_key)
    if tenant_id is not None:
        query = query.where(tenants.c.tenant_id == tenant_id)
    return [_session_record(r) for r in conn.execute(query)]


def find_in_tenant(conn: Connection, session_key: bytes, tenant_ref: int) -> SessionRecord | None:
    row = conn.execute(
        _session_select.where(sessions.c.session_key == session_key, sessions.c.tenant_ref == tenant_ref)
    ).first()
    return _session_record(row) if row else None


def session_by_ref(conn: Connection, ref: int) -> SessionRecord | None:
    row = conn.execute(_session_select.where(sessions.c.id == ref)).first()
    return _session_record(row) if row else None


def seq_of(conn: Connection, ref: int) -> int | None:
    """The sequence number of the last transaction that changed the session (``None``: gone)."""
    return conn.execute(_SEQ_OF, {"ref": ref}).scalar()


def owners(conn: Connection, session_refs: Sequence[int]) -> list[tuple[int, int]]:
    """``(session_ref, user_ref)`` of these sessions (deleted ones are left out)."""
    out: list[tuple[int, int]] = []
    for part in chunks(session_refs):
        out.extend(
            (r[0], r[1])
            for r in conn.execute(select(sessions.c.id, sessions.c.user_ref).where(sessions.c.id.in_(part)))
        )
    return out


def list_sessions(
    conn: Connection, tenant_id: str | None = None, user_id: str | None = None
) -> list[tuple[SessionRecord, int]]:
    """Every session (filtered by owner) with its number of versions, oldest first."""
    counts = select(versions.c.session_ref, func.count().label("n")).group_by(versions.c.session_ref).subquery()
    query = (
        _session_select.add_columns(func.coalesce(counts.c.n, 0))
        .outerjoin(counts, counts.c.session_ref == sessions.c.id)
        .order_by(sessions.c.id)
    )
    if tenant_id is not None:
        query = query.where(tenants.c.tenant_id == tenant_id)
    if user_id is not None:
        query = query.where(users.c.user_id == user_id)
    return [(_session_record(r[:-1]), int(r[-1])) for r in conn.execute(query)]


def namespace_sessions(conn: Connection, user_ref: int) -> list[int]:
    """Row numbers of every session of a namespace, oldest first."""
    return [
        int(r[0])
        for r in conn.execute(select(sessions.c.id).where(sessions.c.user_ref == user_ref).order_by(sessions.c.id))
    ]


def count_sessions(conn: Connection) -> int:
    return int(conn.execute(select(func.count()).select_from(sessions)).scalar_one())


def insert_session(
    conn: Connection,
    session_key: bytes,
    sealed_name: bytes,
    tenant_ref: int,
    user_ref: int,
    layout_ref: int,
    seq: int,
    stamp: dt.datetime,
) -> int:
    return insert_id(
        conn,
        insert(sessions).values(
            session_key=session_key,
            name=sealed_name,
            tenant_ref=tenant_ref,
            user_ref=user_ref,
            layout_ref=layout_ref,
            head_id=None,
            created_at=stamp,
            last_access=stamp,
            seq=seq,
        ),
    )


def stamp_session(conn: Connection, session_ref: int, seq: int, stamp: dt.datetime, head_id: int | None = None) -> None:
    """Mark a session changed by transaction ``seq`` at ``stamp`` (and move its head, if given)."""
    if head_id is None:
        conn.execute(_STAMP, {"ref": session_ref, "seq": seq, "stamp": stamp})
    else:
        conn.execute(_STAMP_HEAD, {"ref": session_ref, "seq": seq, "stamp": stamp, "head": head_id})


def delete_session_rows(conn: Connection, session_ref: int) -> None:
    """Delete a session's row and its versions (its ``session_pages`` go first, see
    :func:`dss.catalog.holds.release`)."""
    conn.execute(delete(versions).where(versions.c.session_ref == session_ref))
    conn.execute(delete(sessions).where(sessions.c.id == session_ref))


# -- versions --------------------------------------------------------------------------------


def _version_record(row: tuple) -> VersionRecord:
    vid, sref, parent, base, base_len, num, suffix, label, pinned, created, sealed = row
    return VersionRecord(
        vid,
        sref,
        parent,
        base,
        base_len,
        num,
        bytes(suffix),
        None,
        bool(pinned),
        aware(created),
        bool(sealed),
        bytes(label) if label is not None else None,
    )


_version_columns = (
    versions.c.id,
    versions.c.session_ref,
    versions.c.parent_id,
    versions.c.base_id,
    versions.c.base_len,
    versions.c.num_tokens,
    versions.c.suffix,
    versions.c.label,
    versions.c.pinned,
    versions.c.created_at,
    versions.c.sealed,
)


def session_versions(conn: Connection, session_ref: int) -> list[VersionRecord]:
    """Every version of a session, oldest first."""
    query = select(*_version_columns).where(versions.c.session_ref == session_ref).order_by(versions.c.id)
    return [_version_record(r) for r in conn.execute(query)]


def insert_version(
    conn: Connection,
    session_ref: int,
    parent_id: int | None,
    base_id: int | None,
    base_len: int,
    num_tokens: int,
    suffix: bytes,
    sealed_label: bytes | None,
    sealed: bool,
    stamp: dt.datetime,
) -> int:
    """Insert a version row made at ``stamp``; return its id."""
    return insert_id(
        conn,
        _INSERT_VERSION,
        {
            "session_ref": session_ref,
            "parent_id": parent_id,
            "base_id": base_id,
            "base_len": base_len,
            "num_tokens": num_tokens,
            "suffix": suffix,
            "label": sealed_label,
            "pinned": False,
            "created_at": stamp,
            "sealed": sealed,
        },
    )


def set_pinned(conn: Connection, version_id: int, pinned: bool) -> None:
    conn.execute(update(versions).where(versions.c.id == version_id).values(pinned=pinned))
