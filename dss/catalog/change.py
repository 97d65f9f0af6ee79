"""A write as one value (the one function that applies it is :func:`dss.catalog.transaction.apply`).

Every write of the store (create, commit, save pages, rollback, branch, pin, delete,
quarantine, compaction) is a :class:`Change`: the catalog rows it adds or removes, the pages it places,
and — once applied — the feed events it emits. :mod:`dss.sessions.versions` builds changes from a
session's state; :func:`~dss.catalog.transaction.apply` writes one in the caller's transaction, and returns the events
with what this process needs to update its own caches in place (:meth:`dss.sessions.mirror.Mirror.apply`
applies them, as it applies the events of other processes read back from the feed).

A change that writes an existing session names the sequence number of the session it was
built on; :func:`~dss.catalog.transaction.apply` raises :class:`Stale` when the session moved on since, and the caller
builds it again from a fresh state (optimistic concurrency: nothing is re-read and re-checked
by hand inside the transaction).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, NamedTuple

from dss.catalog import compaction
from dss.catalog.feed import Event
from dss.catalog.pages import PageRecord
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
    and record flags, and its host copy where the tiers' precisions differ. A page flagged sealed (``flags`` bit 0) is sealed as it is written
    (:meth:`dss.pages.store.PageStore.write`, overlapping the sealing with the disk): until then
    ``stored`` is its payload and ``checksum`` 0; the written segment's pages carry the
    sealed bytes and their checksum."""

    page_id: PageId
    index: int  # type: ignore[assignment]  # a field named like tuple.index
    payload: bytes
    stored: bytes | None
    checksum: int
    flags: int
    encoding: str = "exact"
    """The precision of ``payload``, the durable copy (:mod:`dss.core.precision`)."""
    host: bytes | None = None
    """The host copy when the host tier keeps another precision than ``payload``'s."""


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
]
