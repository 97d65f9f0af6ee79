"""The change feed: what each write transaction changed, as typed events.

A write (:func:`dss.catalog.transaction.apply`) returns its events and records them in the
``feed`` table under its transaction's sequence number. The process that wrote applies the
events it got back, which carry what it wrote in detail (``own``); every other process reads
them back from the feed, without the detail, and applies them with the same function
(:meth:`dss.sessions.mirror.Mirror.apply`). Rows older than the newest :data:`KEPT` are pruned; a
process that falls further behind reloads everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.pages import PageRecord
from dss.catalog.schema import catalog_seq, feed

KEPT = 100_000
"""How many feed rows survive pruning; a process further behind reloads everything."""
PRUNE_EVERY = 1000
"""Every this many write transactions, the feed is pruned (in that transaction)."""


class SessionChanged(NamedTuple):
    """A session's rows changed: made, committed to, moved, pinned, its pages, or deleted."""

    session_ref: int
    user_ref: int
    own: object | None = None
    """The write in detail, a :class:`dss.catalog.change.SessionWrite` (only in the process
    that made it; opaque here, so the feed does not import the module that writes it)."""

    def rows(self, seq: int) -> list[dict]:
        return [_row(seq, "session", self.user_ref, session_ref=self.session_ref)]


class PagesStored(NamedTuple):
    """Pages of a namespace were stored; their rows carry the transaction's ``seq``."""

    user_ref: int
    seq: int
    records: tuple[PageRecord, ...] | None = None
    """The rows (only in the process that stored them)."""

    def rows(self, seq: int) -> list[dict]:
        return [_row(seq, "pages", self.user_ref)]


class PagesDropped(NamedTuple):
    """Pages of a namespace are gone from every tier (their session was deleted, or they were
    quarantined)."""

    user_ref: int
    page_ids: tuple[bytes, ...]

    def rows(self, seq: int) -> list[dict]:
        return [_row(seq, "drop", self.user_ref, page_id=p) for p in self.page_ids]


class PagesEvicted(NamedTuple):
    """Pages of a namespace left the durable tiers (a full disk made room)."""

    user_ref: int
    page_ids: tuple[bytes, ...]

    def rows(self, seq: int) -> list[dict]:
        return [_row(seq, "evict", self.user_ref, page_id=p) for p in self.page_ids]


class NamespaceForgotten(NamedTuple):
    """A namespace's key was destroyed and its rows purged (an erasure)."""

    user_ref: int

    def rows(self, seq: int) -> list[dict]:
        return [_row(seq, "forget", self.user_ref)]


Event = SessionChanged | PagesStored | PagesDropped | PagesEvicted | NamespaceForgotten


_INSERT_FEED = insert(feed)


def record(conn: Connection, seq: int, events: Sequence[Event]) -> None:
    """Write the feed rows of ``events`` for transaction ``seq`` (without their detail)."""
    rows = [row for event in events for row in event.rows(seq)]
    if rows:
        conn.execute(_INSERT_FEED, rows)
    if seq % PRUNE_EVERY == 0:
        _prune(conn)


def _row(seq: int, kind: str, user_ref: int, *, session_ref: int | None = None, page_id: bytes | None = None) -> dict:
    return {"seq": seq, "kind": kind, "session_ref": session_ref, "user_ref": user_ref, "page_id": page_id}


def latest_seq(conn: Connection) -> int:
    return int(conn.execute(select(catalog_seq.c.seq).where(catalog_seq.c.id == 1)).scalar_one())


def read_since(conn: Connection, seq: int) -> tuple[int, list[tuple[int, Event]] | None]:
    """``(latest_seq, [(seq, event), ...])`` of every transaction after ``seq``, in order; the
    list is ``None`` when pruning removed some of them (the caller must reload everything)."""
    latest, floor = conn.execute(select(catalog_seq.c.seq, catalog_seq.c.floor).where(catalog_seq.c.id == 1)).one()
    if seq < floor:
        return latest, None
    rows = conn.execute(
        select(feed.c.seq, feed.c.kind, feed.c.session_ref, feed.c.user_ref, feed.c.page_id)
        .where(feed.c.seq > seq)
        .order_by(feed.c.id)
    ).all()
    out: list[tuple[int, Event]] = []
    for row_seq, kind, session_ref, user_ref, page_id in rows:
        if kind == "session":
            out.append((row_seq, SessionChanged(session_ref, user_ref)))
        elif kind == "pages":
            out.append((row_seq, PagesStored(user_ref, row_seq)))
        elif kind == "forget":
            out.append((row_seq, NamespaceForgotten(user_ref)))
        else:
            event_type = PagesDropped if kind == "drop" else PagesEvicted
            last = out[-1] if out else None
            if last is not None and last[0] == row_seq and type(last[1]) is event_type and last[1].user_ref == user_ref:
                out[-1] = (row_seq, event_type(user_ref, (*last[1].page_ids, bytes(page_id))))
            else:
                out.append((row_seq, event_type(user_ref, (bytes(page_id),))))
    return latest, out


def _prune(conn: Connection) -> None:
    """Keep the newest :data:`KEPT` feed rows (whole transactions); record the new floor."""
    count = conn.execute(select(func.count()).select_from(feed)).scalar_one()
    if count <= KEPT:
        return
    cut = conn.execute(select(feed.c.seq).order_by(feed.c.id.desc()).offset(KEPT).limit(1)).scalar_one()
    conn.execute(feed.delete().where(feed.c.seq <= cut))
    conn.execute(update(catalog_seq).where(catalog_seq.c.id == 1).values(floor=cut))
