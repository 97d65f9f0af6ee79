"""Applying a change (:class:`~dss.catalog.change.Change`) in the caller's transaction: one
function, :func:`apply`, after :func:`check` (see :mod:`dss.catalog.change`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from dss.catalog import compaction, feed, holds, namespaces, pages, segments, sessions
from dss.catalog.change import (
    Applied,
    Change,
    MovedSegment,
    NewPage,
    Quarantined,
    Room,
    SessionWrite,
    Stale,
    WrittenSegment,
)
from dss.catalog.database import Tx, now
from dss.catalog.feed import Event, PagesDropped, PagesEvicted, PagesStored, SessionChanged
from dss.catalog.pages import PageRecord
from dss.core.errors import UnknownSession
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import PageId


def check(tx: Tx, change: Change) -> None:
    """Whether ``change`` can be applied in ``tx`` now; reads only, so a refused change leaves
    the transaction as it was. Raises ``Stale`` when its session moved on since
    ``change.base_seq`` (or a session it would create exists already, or its namespace is
    gone or being erased), ``UnknownSession`` when its session was deleted."""
    conn = tx.conn
    if change.session_ref is not None:
        current = sessions.seq_of(conn, change.session_ref)
        if current is None:
            raise UnknownSession(f"session {change.session_id!r} was deleted")
        if change.base_seq is not None and current != change.base_seq:
            raise Stale()
    if change.create is not None:
        new = change.create
        assert change.user_ref is not None
        if sessions.find_in_tenant(conn, new.session_key, new.tenant_ref) is not None:
            raise Stale()  # made meanwhile: the builder decides whether it is the same session
        if not namespaces.is_live(conn, new.tenant_ref, change.user_ref):
            raise Stale()  # its namespace was erased (or is being) since it was built


def apply(
    tx: Tx, change: Change, written: Sequence[WrittenSegment] = (), room: Room = Room(), *, is_checked: bool = False
) -> Applied:
    """Write ``change`` in ``tx`` (with its segment files ``written`` and the policy's ``room``).

    Raises what :func:`check` raises, before writing anything (``is_checked``: the caller
    just called :func:`check` in ``tx``).
    """
    if not is_checked:
        check(tx, change)
    conn, seq = tx
    stamp = now()
    events: list[Event] = []
    ref = change.session_ref
    layout_ref = change.layout_ref
    if change.create is not None:
        ref, layout_ref = _create(conn, seq, stamp, change)
    dead: list[str] = []
    thinned: list[int] = []
    evicted = _evict(conn, seq, room.victims, events, dead, ref)
    stored = _store(conn, seq, stamp, change, layout_ref, written, room.fits, events, dead)
    version_id = None
    held: list[PageId] = []
    if ref is not None and not change.delete:
        version_id, held = _session(conn, seq, stamp, ref, change)
    dropped = _quarantine(conn, seq, change.quarantine, events, dead, thinned)
    _move(conn, seq, change.move, events, dead)
    released: list[PageId] = []
    if ref is not None and change.delete:
        assert change.user_ref is not None
        released = _delete(conn, seq, ref, change.user_ref, events, dead, thinned)
    if ref is not None:
        assert layout_ref is not None
        written_by = SessionWrite(change, seq, stamp, version_id, tuple(held), (*evicted, *dropped), layout_ref)
        events.append(_session_changed(ref, change, written_by))
    feed.record(conn, seq, events)
    return Applied(
        seq,
        ref,
        version_id,
        tuple(events),
        tuple(stored),
        (*dropped, *released),
        tuple(dead),
        tuple(sorted(set(thinned))),
        tuple((p.index, p.page_id) for p in change.pages),
    )


def _session_changed(ref: int, change: Change, write: SessionWrite) -> SessionChanged:
    """The feed event that tells every mirror what ``change`` did to its session."""
    assert change.user_ref is not None
    return SessionChanged(ref, change.user_ref, write)


def _delete(
    conn: Any, seq: int, ref: int, user_ref: int, events: list[Event], dead: list[str], thinned: list[int]
) -> list[PageId]:
    """Delete session ``ref`` and release its pages: those no other session holds go from every
    tier (their files, once emptied, into ``dead``). Returns the pages released."""
    released = holds.release(conn, ref)
    sessions.delete_session_rows(conn, ref)
    holders, emptied = pages.drop_pages(conn, released, seq, thinned)
    dead += emptied
    _changed(events, conn, holders, skip=ref)
    events.append(PagesDropped(user_ref, tuple(released)))
    return released


def _create(conn: Any, seq: int, stamp: dt.datetime, change: Change) -> tuple[int, int]:
    new = change.create
    assert new is not None and change.user_ref is not None
    layout_ref = namespaces.ensure_layout(conn, new.layout)
    ref = sessions.insert_session(
        conn, new.session_key, new.sealed_name, new.tenant_ref, change.user_ref, layout_ref, seq, stamp
    )
    return ref, layout_ref


def _evict(
    conn: Any, seq: int, victims: Sequence[int], events: list[Event], dead: list[str], ref: int | None
) -> list[bytes]:
    """Drop the victim segments and their pages (a full disk making room for the change of
    session ``ref``, whose own event lists the pages it no longer holds)."""
    if not victims:
        return []
    owned = segments.segment_pages(conn, victims)
    ids = [page_id for page_id, _ in owned]
    holders, emptied = pages.drop_pages(conn, ids, seq)
    dead += emptied
    _changed(events, conn, holders, skip=ref)
    for user_ref in sorted({user for _, user in owned}):
        events.append(PagesEvicted(user_ref, tuple(p for p, user in owned if user == user_ref)))
    return ids


def _store(
    conn: Any,
    seq: int,
    stamp: dt.datetime,
    change: Change,
    layout_ref: int | None,
    written: Sequence[WrittenSegment],
    fits: bool,
    events: list[Event],
    dead: list[str],
) -> list[PageRecord]:
    """Record the segment files written for the change's new pages (those no one stored meanwhile)."""
    if not written:
        return []
    if not fits:
        dead += [segment.name for segment in written]
        return []
    assert change.user_ref is not None and layout_ref is not None
    existing = pages.existing_pages(conn, [p.page_id for segment in written for p, _, _ in segment.pages])
    stored: list[PageRecord] = []
    for segment in written:
        placed = [(p, offset, length) for p, offset, length in segment.pages if p.page_id not in existing]
        if not placed:
            dead.append(segment.name)
            continue
        stored += _insert_segment(conn, seq, stamp, segment, placed, change.user_ref, layout_ref)
    if stored:
        events.append(PagesStored(change.user_ref, seq, tuple(stored)))
    return stored


def _insert_segment(
    conn: Any,
    seq: int,
    stamp: dt.datetime,
    segment: WrittenSegment,
    placed: Sequence[tuple[NewPage, int, int]],
    user_ref: int,
    layout_ref: int,
) -> list[PageRecord]:
    """Record one segment file and its ``placed`` pages ``(page, offset, length)``; returns their rows."""
    pages.insert_segment(
        conn,
        segment.name,
        "disk",
        segment.node_ref,
        user_ref,
        segment.size,
        [
            {
                "page_id": p.page_id,
                "user_ref": user_ref,
                "layout_ref": layout_ref,
                "page_index": p.index,
                "size": len(p.payload),
                "checksum": p.checksum,
                "created_at": stamp,
                "seq": seq,
            }
            for p, _, _ in placed
        ],
        [
            {"page_id": p.page_id, "tier": "disk", "offset": offset, "length": length, "encoding": p.encoding}
            for p, offset, length in placed
        ],
    )
    return [
        PageRecord(p.page_id, user_ref, p.index, len(p.payload), p.checksum, segment.name, offset, length, p.encoding)
        for p, offset, length in placed
    ]


def _session(conn: Any, seq: int, stamp: dt.datetime, ref: int, change: Change) -> tuple[int | None, list[PageId]]:
    """The session part: new version, holds, head, pin; the session stamped with ``seq``."""
    version_id = None
    head = change.head
    if change.version is not None:
        v = change.version
        version_id = sessions.insert_version(
            conn,
            ref,
            v.parent_id,
            v.base_id,
            v.base_len,
            len(v.tokens) // TOKEN_BYTES,
            v.stored_suffix,
            v.stored_label,
            v.sealed,
            stamp,
        )
        head = version_id
    tag = version_id or 0
    existing = pages.existing_pages(conn, change.hold) if change.hold else set()
    held = [p for p in change.hold if p in existing]
    holds.hold(conn, ref, held, tag, change.hold_pinned)
    if version_id is not None:
        for old in change.retag:
            holds.retag(conn, ref, old, version_id)
        holds.touch(conn, ref, change.touch, version_id)
    if change.pin is not None:
        sessions.set_pinned(conn, *change.pin)
        pin_on, pin_off = change.pin_pages
        holds.set_pinned_pages(conn, ref, pin_on, True)
        holds.set_pinned_pages(conn, ref, pin_off, False)
    sessions.stamp_session(conn, ref, seq, stamp, head_id=head)
    return version_id, held


def _quarantine(
    conn: Any, seq: int, bad: Sequence[Quarantined], events: list[Event], dead: list[str], thinned: list[int]
) -> list[PageId]:
    """Record pages that failed verification and drop them from the catalog."""
    if not bad:
        return []
    bad = compaction.still_located(conn, bad)  # a page compaction moved meanwhile was read from its old file
    if not bad:
        return []
    for q in bad:
        pages.add_quarantine(conn, q.page_id, q.user_ref, "disk", q.segment, q.offset, q.reason)
    ids = [q.page_id for q in bad]
    holders, emptied = pages.drop_pages(conn, ids, seq, thinned)
    dead += emptied
    _changed(events, conn, holders)
    for user_ref in sorted({q.user_ref for q in bad}):
        events.append(PagesDropped(user_ref, tuple(q.page_id for q in bad if q.user_ref == user_ref)))
    return ids


def _move(conn: Any, seq: int, moved: Sequence[MovedSegment], events: list[Event], dead: list[str]) -> None:
    """Point pages at their copies in compacted segments (those not dropped or moved meanwhile)."""
    for segment in moved:
        records, emptied = compaction.relocate(
            conn, segment.name, segment.tier, segment.node_ref, segment.user_ref, segment.size, segment.moves, seq
        )
        dead += emptied
        if records:
            events.append(PagesStored(segment.user_ref, seq, tuple(records)))


def _changed(events: list[Event], conn: Any, session_refs: Sequence[int], skip: int | None = None) -> None:
    """Tell other processes that these sessions changed (what they hold did)."""
    for ref, user_ref in sessions.owners(conn, [r for r in session_refs if r != skip]):
        events.append(SessionChanged(ref, user_ref))


__all__ = ["apply", "check"]
