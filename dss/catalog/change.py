"""A write as one value, and the one function that applies it.

Every write of the store (create, commit, save pages, rollback, branch, pin, delete,
quarantine, compaction) is a :class:`Change`: the catalog rows it adds or removes, the pages it places,
and — once applied — the feed events it emits. :mod:`dss.sessions.versions` builds changes from a
session's state; :func:`apply` writes one in the caller's transaction, and returns the events
with what this process needs to update its own caches in place (:meth:`dss.sessions.mirror.Mirror.apply`
applies them, as it applies the events of other processes read back from the feed).

A change that writes an existing session names the sequence number of the session it was
built on; :func:`apply` raises :class:`Stale` when the session moved on since, and the caller
builds it again from a fresh state (optimistic concurrency: nothing is re-read and re-checked
by hand inside the transaction).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dss.catalog import compaction, feed, holds, namespaces, pages, segments, sessions
from dss.catalog.database import Tx, now
from dss.catalog.feed import Event, PagesDropped, PagesEvicted, PagesStored, SessionChanged
from dss.catalog.pages import PageRecord
from dss.core.errors import UnknownSession
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import Layout, PageId, Version


class Stale(Exception):
    """The session a change was built on moved on (another writer); build the change again."""


class NewSession(NamedTuple):
    """A session the change creates (its id in clear is for this process only: the row holds
    the keyed hash and the sealed id)."""

    session_id: str
    session_key: bytes
    sealed_name: bytes
    tenant_id: str
    tenant_ref: int
    user_id: str
    layout: Layout


class NewVersion(NamedTuple):
    """A version the change adds (it becomes the head). ``stored_suffix`` and
    ``stored_label`` are as the row holds them (sealed); ``tokens``, ``label`` and ``walk``
    (where the builder's trie walk ended) are for this process's own trie."""

    parent_id: int | None
    base_id: int | None
    base_len: int
    stored_suffix: bytes
    sealed: bool
    stored_label: bytes | None
    tokens: bytes
    label: str | None
    walk: Any


class NewPage(NamedTuple):
    """A page to store: its id and index in its prompt, its payload, and the bytes that go
    to disk (``stored``; ``None`` when a durable tier holds it already) with their checksum
    and record flags. A page flagged sealed (``flags`` bit 0) is sealed as it is written
    (:meth:`dss.pages.store.PageStore.write`, overlapping the sealing with the disk): until then
    ``stored`` is its payload and ``checksum`` 0; the written segment's pages carry the
    sealed bytes and their checksum."""

    page_id: PageId
    index: int  # type: ignore[assignment]  # a field named like tuple.index
    payload: bytes
    stored: bytes | None
    checksum: int
    flags: int


class Quarantined(NamedTuple):
    """A page whose bytes failed verification on read, and where they were."""

    page_id: PageId
    user_ref: int
    segment: str
    offset: int
    reason: str


class WrittenSegment(NamedTuple):
    """A segment file written for a change's new pages (before its transaction), and where
    each page lies in it: ``(page, offset, length)``."""

    name: str
    size: int
    node_ref: int
    """The node whose folder holds the file."""
    pages: tuple[tuple[NewPage, int, int], ...]


class MovedSegment(NamedTuple):
    """A segment file compaction wrote (before its transaction): copies of live records of
    older segments of one namespace, each ``(record, new_offset)``."""

    name: str
    tier: str
    node_ref: int
    user_ref: int
    size: int
    moves: tuple[tuple[compaction.LiveRecord, int], ...]


class Room(NamedTuple):
    """What the placement policy decided for a change's segment files: the segments to drop
    first (``victims``), and whether the files then fit the tier (else they are not recorded)."""

    victims: tuple[int, ...] = ()
    fits: bool = True


@dataclass(frozen=True, slots=True)
class Change:
    """One write. See the module docstring; every part is optional and applied in the order
    the fields are listed."""

    user_ref: int | None = None
    session_ref: int | None = None
    """The session written (``None``: the one ``create`` makes, or none)."""
    session_id: str = ""
    base_seq: int | None = None
    """The session's sequence number the change was built on (``None``: not checked)."""
    create: NewSession | None = None
    pages: tuple[NewPage, ...] = ()
    layout_ref: int | None = None
    version: NewVersion | None = None
    hold: tuple[PageId, ...] = ()
    """Pages the session holds from now on if some tier holds them (tagged with the new version, else 0)."""
    hold_pinned: frozenset[bytes] = frozenset()
    """Of ``hold``, the pages a pinned version of the session contains."""
    retag: tuple[int, ...] = ()
    """Every page of the session whose newest version is one of these moves to the new version."""
    touch: tuple[PageId, ...] = ()
    """These pages of the session move to the new version one by one."""
    head: int | None = None
    """Rollback: the version that becomes the head (a new version always becomes it)."""
    pin: tuple[int, bool] | None = None
    pin_pages: tuple[tuple[PageId, ...], tuple[PageId, ...]] = ((), ())
    """Pages of the session to mark pinned, and to mark not pinned."""
    quarantine: tuple[Quarantined, ...] = ()
    move: tuple[MovedSegment, ...] = ()
    """Compaction: live pages copied into new segment files; their old segments go once empty."""
    delete: bool = False
    """Delete the session, its versions and its holds; pages no one holds any more go."""


class SessionWrite(NamedTuple):
    """What :func:`apply` did to a change's session, for the writer's own caches."""

    change: Change
    seq: int
    stamp: dt.datetime
    """When it was written (the session's last access, the new version's creation)."""
    version_id: int | None
    held: tuple[bytes, ...]
    """Pages the session newly holds (tagged with ``version_id``, else 0)."""
    unheld: tuple[bytes, ...]
    """Pages the session no longer holds (evicted, or quarantined)."""
    layout_ref: int


class Applied(NamedTuple):
    """What :func:`apply` did: the events (with detail), the new version, the pages now
    recorded, and the segment files to delete once the transaction committed."""

    seq: int
    session_ref: int | None
    version_id: int | None
    events: tuple[Event, ...]
    stored: tuple[PageRecord, ...]
    dropped: tuple[PageId, ...]
    """Pages the change removed from every tier (a deleted session's, quarantined ones)."""
    dead_files: tuple[str, ...]
    thinned: tuple[int, ...] = ()
    """Segments that lost pages and keep some: their dead bytes grew (compaction may be due)."""
    given: tuple[tuple[int, PageId], ...] = ()
    """The pages the change was given, stored now or before: (index, id) each."""
    version: Version | None = None
    """The version the change made, moved the head to or pinned, as this process holds it
    right after the commit (set by the writer, under the lock that applied the change;
    ``None`` from :func:`apply`, for changes about no version, or when the session is gone)."""


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
    evicted = _evict(conn, seq, room.victims, events, dead)
    stored = _store(conn, seq, stamp, change, layout_ref, written, room.fits, events, dead)
    version_id = None
    held: list[PageId] = []
    if ref is not None and not change.delete:
        version_id, held = _session(conn, seq, stamp, ref, change)
    dropped = _quarantine(conn, seq, change.quarantine, events, dead, thinned)
    _move(conn, seq, change.move, events, dead)
    released: list[PageId] = []
    if ref is not None and change.delete:
        released = holds.release(conn, ref)
        sessions.delete_session_rows(conn, ref)
        holders, emptied = pages.drop_pages(conn, released, seq, thinned)
        dead += emptied
        _changed(events, conn, holders, skip=ref)
        assert change.user_ref is not None
        events.append(PagesDropped(change.user_ref, tuple(released)))
    if ref is not None:
        assert change.user_ref is not None and layout_ref is not None
        unheld = tuple(p for p in (*evicted, *dropped))
        events.append(
            SessionChanged(
                ref, change.user_ref, SessionWrite(change, seq, stamp, version_id, tuple(held), unheld, layout_ref)
            )
        )
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


def _create(conn: Any, seq: int, stamp: dt.datetime, change: Change) -> tuple[int, int]:
    new = change.create
    assert new is not None and change.user_ref is not None
    layout_ref = namespaces.ensure_layout(conn, new.layout)
    ref = sessions.insert_session(
        conn, new.session_key, new.sealed_name, new.tenant_ref, change.user_ref, layout_ref, seq, stamp
    )
    return ref, layout_ref


def _evict(conn: Any, seq: int, victims: Sequence[int], events: list[Event], dead: list[str]) -> list[bytes]:
    """Drop the victim segments and their pages (a full disk making room)."""
    if not victims:
        return []
    owned = segments.segment_pages(conn, victims)
    ids = [page_id for page_id, _ in owned]
    holders, emptied = pages.drop_pages(conn, ids, seq)
    dead += emptied
    _changed(events, conn, holders)
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
        pages.insert_segment(
            conn,
            segment.name,
            "disk",
            segment.node_ref,
            change.user_ref,
            segment.size,
            [
                {
                    "page_id": p.page_id,
                    "user_ref": change.user_ref,
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
                {"page_id": p.page_id, "tier": "disk", "offset": offset, "length": length}
                for p, offset, length in placed
            ],
        )
        stored += [
            PageRecord(p.page_id, change.user_ref, p.index, len(p.payload), p.checksum, segment.name, offset, length)
            for p, offset, length in placed
        ]
    if stored:
        events.append(PagesStored(change.user_ref, seq, tuple(stored)))
    return stored


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


__all__ = [
    "Applied",
    "Change",
    "MovedSegment",
    "NewPage",
    "NewSession",
    "NewVersion",
    "Quarantined",
    "Room",
    "SessionWrite",
    "Stale",
    "WrittenSegment",
    "apply",
    "check",
]
