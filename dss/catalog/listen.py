"""Hearing of other nodes' writes: PostgreSQL ``LISTEN/NOTIFY`` on the change feed, polling as the fallback.

Processes of one folder learn of each other's writes through the folder's epoch file
(:mod:`dss.core.epoch`); nodes on other hosts cannot see it. On a PostgreSQL catalog every
write transaction also sends ``NOTIFY`` on the catalog's channel with its sequence number
(:meth:`dss.catalog.database.Catalog.write`; PostgreSQL delivers it when the transaction
commits, never before). A :class:`FeedListener` thread per process listens on that channel
and raises the folder's epoch to each number it hears, so the next call of the store
catches up from the feed (:meth:`dss.sessions.mirror.Mirror.sync`). When no notification comes for
``poll_s`` seconds, or the listening connection is lost (a restarted or killed backend), it
reads the catalog's latest sequence number itself: a node is at most about ``poll_s`` behind
even if notifications are lost. The catalog stays the source of truth; a node that is behind
only matches less, it never serves what the catalog no longer holds without verifying it.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from sqlalchemy.engine import URL

from dss.catalog.database import channel_of
from dss.core.epoch import Epoch

log = logging.getLogger("dss.catalog.listen")

WAKE_S = 0.2
"""Longest the listening thread waits before checking whether it should stop."""


def conninfo_of(url: URL) -> str:
    """A libpq connection string for a SQLAlchemy PostgreSQL URL."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class FeedListener:
    """A daemon thread raising ``epoch`` to the catalog's latest sequence number as other
    nodes commit (see the module docstring). ``heard`` counts notifications received."""

    def __init__(self, url: URL, epoch: Epoch, *, poll_s: float) -> None:
        self._conninfo = conninfo_of(url)
        self._epoch = epoch
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.heard = 0
        self.is_listening = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="dss-feed-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * WAKE_S + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except psycopg.Error as exc:
                if self.is_listening or not self._failing:  # once per loss, not per retry
                    log.warning(
                        "catalog notifications lost (%s): polling every %.1fs until they are back",
                        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                        self._poll_s,
                    )
                self.is_listening = False
                self._failing = True
                self._stop.wait(min(self._poll_s, 1.0))
            else:
                return

    def _listen(self) -> None:
        with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT current_database(), current_schema()").fetchone()
            assert row is not None
            database, schema = row
            conn.execute(f"LISTEN {channel_of(database, schema)}")
            self.is_listening = True
            if self._failing:
                log.info("catalog notifications back")
                self._failing = False
            polled = 0.0
            while not self._stop.is_set():
                if time.monotonic() - polled >= self._poll_s:  # after (re)connecting, then whenever it was quiet
                    row = conn.execute("SELECT seq FROM catalog_seq WHERE id = 1").fetchone()
                    if row is not None:
                        self._epoch.publish(int(row[0]))
                    polled = time.monotonic()
                latest = 0
                for note in conn.notifies(timeout=WAKE_S, stop_after=64):
                    self.heard += 1
                    if note.payload.isdigit():
                        latest = max(latest, int(note.payload))
                if latest:
                    self._epoch.publish(latest)
                    polled = time.monotonic()
