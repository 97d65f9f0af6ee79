"""Catalog rows of what sessions hold: which pages each session references (``session_pages``),
under which version, pinned or not. Functions here run on an open connection and neither begin
nor commit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import chunks
from dss.catalog.schema import (
    session_pages,
)
from dss.core.types import PageId

_RETAG = (
    update(session_pages)
    .where(session_pages.c.session_ref == bindparam("s_ref"), session_pages.c.version_ref == bindparam("old"))
    .values(version_ref=bindparam("new"))
)
_TOUCH = (
    update(session_pages)
    .where(
        session_pages.c.session_ref == bindparam("s_ref"), session_pages.c.page_id.in_(bindparam("ids", expanding=True))
    )
    .values(version_ref=bindparam("new"))
)
_INSERT_HOLDS = insert(session_pages)


def held_pages(conn: Connection, session_ref: int) -> dict[bytes, int]:
    """The pages a session holds, with the newest of its versions holding each (0: saved ahead)."""
    return {
        bytes(r[0]): r[1]
        for r in conn.execute(
            select(session_pages.c.page_id, session_pages.c.version_ref).where(
                session_pages.c.session_ref == session_ref
            )
        )
    }


def committed_pages(conn: Connection, session_ref: int) -> set[bytes]:
    """The pages a session holds that some committed version of it contains."""
    return {
        bytes(r[0])
        for r in conn.execute(
            select(session_pages.c.page_id).where(
                session_pages.c.session_ref == session_ref, session_pages.c.version_ref != 0
            )
        )
    }


def hold(
    conn: Connection,
    session_ref: int,
    page_ids: Iterable[bytes],
    version_id: int,
    pinned: frozenset[bytes] = frozenset(),
) -> None:
    """The session holds these pages from now on, newest in ``version_id`` (0: saved ahead)."""
    rows = [
        {"session_ref": session_ref, "page_id": p, "version_ref": version_id, "pinned": p in pinned} for p in page_ids
    ]
    if rows:
        conn.execute(_INSERT_HOLDS, rows)


def retag(conn: Connection, session_ref: int, old_version: int, version_id: int) -> None:
    """Move every page of the session whose newest version is ``old_version`` to ``version_id``."""
    conn.execute(_RETAG, {"s_ref": session_ref, "old": old_version, "new": version_id})


def touch(conn: Connection, session_ref: int, page_ids: Sequence[bytes], version_id: int) -> None:
    """Mark ``version_id`` as the newest version of the session containing these pages."""
    for part in chunks(page_ids):
        conn.execute(_TOUCH, {"s_ref": session_ref, "ids": list(part), "new": version_id})


def set_pinned_pages(conn: Connection, session_ref: int, page_ids: Sequence[bytes], pinned: bool) -> None:
    for part in chunks(page_ids):
        conn.execute(
            update(session_pages)
            .where(session_pages.c.session_ref == session_ref, session_pages.c.page_id.in_(part))
            .values(pinned=pinned)
        )


def release(conn: Connection, session_ref: int) -> list[PageId]:
    """Drop every hold of a session; return the pages no session holds any more."""
    held = [
        PageId(bytes(r[0]))
        for r in conn.execute(select(session_pages.c.page_id).where(session_pages.c.session_ref == session_ref))
    ]
    conn.execute(delete(session_pages).where(session_pages.c.session_ref == session_ref))
    still: set[bytes] = set()
    for part in chunks(held):
        still.update(
            bytes(r[0]) for r in conn.execute(select(session_pages.c.page_id).where(session_pages.c.page_id.in_(part)))
        )
    return [p for p in held if p not in still]
