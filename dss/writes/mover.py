"""The mover: moves pages down the tiers in the background so foreground writes rarely evict
inline, and moves a session's pages up ahead of its next turn (prefetch).

One :class:`Mover` per store. Its thread (``mover=True``, the default) wakes every
``mover_interval_s``, and at once when a put takes a tier past its high mark; it then runs
:meth:`Mover.run`, which does, per tier, what :mod:`dss.placement.policy` decides:

* host past its high mark: demote the lowest-scored pages in batches of ``move_batch_pages``
  until host's active pages are at its low mark. A demotion needs no I/O (disk holds the page;
  the page of a write the full disk could not take has no other copy either way): the page
  stays in host, *inactive* (readable; the first to go when a put needs room, see
  :mod:`dss.tiers.host`);
* disk's active segments past its high mark: demote the lowest-ordered unpinned segments until
  the active ones are at its low mark. A demotion needs no I/O and no transaction either: the
  segment stays on disk, *inactive* (readable; a read of one of its pages makes it active
  again), and leaves, in the order demoted, when a write needs its room
  (:meth:`dss.pages.store.PageStore.room`, in that write's transaction; files deleted after it
  committed). The watermarks bound the work a write does inline, not what the disk holds.

The store's lock is taken per batch of host pages, and once for the disk's pass (a catalog
read and a decision, no I/O), never across a whole pass. Held pages (being read, loaded, moved) are never chosen. Prefetch jobs run on
the same thread, ahead of the watermark pass. :meth:`Mover.close` stops the thread and waits
for it. ``store.run_mover()`` runs one pass in the caller's thread (tests, benchmarks).

**On an injected clock** (``clock=`` given to the store) there is no thread: the store *steps*
the mover after each of its reads and writes (:meth:`Mover.step`), which runs a pass in the
caller's thread when ``mover_interval_s`` of the clock's time has passed since the last, or at
once when the host is past its high mark (what wakes the thread), and records ``tier_policy``
every ``RECORD_EVERY_S`` of the clock's time; prefetch jobs run in the caller's thread. A
replayed trace then moves exactly the same pages on any machine, however fast.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dss.catalog import segments
from dss.catalog.database import Catalog
from dss.core.errors import DssError
from dss.core.types import PageId
from dss.pages.store import PageStore
from dss.placement import disk, fill
from dss.placement.policy import Placement
from dss.tiers.inactive import InactiveSegment
from dss.writes.guard import Guard

log = logging.getLogger("dss.writes.mover")

RECORD_EVERY_S = 5.0
"""How often the mover writes this process's row of ``tier_policy`` (seconds of its clock)."""


class Mover:
    """Watermark passes and prefetch jobs for one store (see the module docstring)."""

    def __init__(
        self,
        guard: Guard,
        pages_: PageStore,
        catalog: Catalog,
        placement: Placement,
        *,
        disk_bytes: int,
        interval_s: float,
        batch: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: the store's injected clock, which steps the mover instead of a thread
        (see the module docstring); ``None``: the thread, on wall-clock time."""
        self.guard = guard
        self.pages = pages_
        self.catalog = catalog
        self.placement = placement
        self.disk_bytes = disk_bytes
        self.interval_s = interval_s
        self.batch = batch
        self.passes = 0
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pass_lock = threading.Lock()
        self.process = f"{socket.gethostname()}:{os.getpid()}"[:128]
        self._recorded = 0.0
        self.clock = clock
        self._next_pass = -math.inf
        """Stepped: the clock's time from which the next pass is due."""

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background thread (once; never on an injected clock: the store steps it)."""
        if self._thread is None and self.clock is None:
            self._thread = threading.Thread(target=self._loop, name="dss-mover", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread and wait for it (its current batch finishes). Idempotent."""
        self._stop.set()
        self._wake.set()
        self._jobs.put(None)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wake(self) -> None:
        """Ask the thread for a pass now (a tier passed its high mark)."""
        self._wake.set()

    def step(self, urgent: bool) -> None:
        """On an injected clock, after a read or write of the store: run a pass now when it is
        ``urgent`` (the host is past its high mark) or ``mover_interval_s`` of the clock's time
        has passed since the last one, and record ``tier_policy`` every ``RECORD_EVERY_S`` of
        it. Without an injected clock: wake the thread when ``urgent``. Never call it inside a
        write, or holding the store's lock."""
        if self.clock is None:
            if urgent:
                self.wake()
            return
        now = self.clock()
        if not urgent and now < self._next_pass:
            return
        self._next_pass = now + self.interval_s
        try:
            self.run()
            if now - self._recorded >= RECORD_EVERY_S:
                self.record()
        except DssError as exc:  # a closing store: as the thread would, the next step tries again
            log.info("mover: %s", exc)

    def submit(self, job: Callable[[], Any]) -> bool:
        """Run ``job`` on the thread (``False``: no thread; the caller runs it)."""
        if self._thread is None:
            return False
        self._jobs.put(job)
        self._wake.set()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None or self._stop.is_set():
                    return
                self._safely(job)
            if not self._stop.is_set():
                self._safely(self.run)
                if self._now() - self._recorded >= RECORD_EVERY_S:
                    self._safely(self.record)

    def _now(self) -> float:
        """The mover's time: the injected clock's, or the wall clock's (monotonic)."""
        return time.monotonic() if self.clock is None else self.clock()

    def _safely(self, job: Callable[[], Any]) -> None:
        try:
            job()
        except DssError as exc:  # a closing store, a catalog hiccup: the next pass tries again
            log.info("mover: %s", exc)
        except Exception:  # never let the thread die
            log.exception("mover pass failed")

    # -- one pass --------------------------------------------------------------------------

    def record(self) -> None:
        """Write this process's tiers, watermarks, quotas and counters to ``tier_policy`` (and
        forget the statistics of pages gone from every tier)."""
        placement = self.placement
        s = placement.settings
        host = self.pages.host
        with self.guard.reading():
            entries, host_ = self.pages.index.entries, self.pages.host
            placement.prune(entries, host_)
            with self.catalog.read() as conn:
                disk_used = segments.tier_bytes(conn, "disk", self.pages.node_ref)
            rows = []
            for tier, capacity, used, user_q, tenant_q in (
                ("host", host.capacity_bytes, host.used_bytes, s.host_user_quota, s.host_tenant_quota),
                ("disk", self.disk_bytes, disk_used, s.disk_user_quota, s.disk_tenant_quota),
            ):
                high, low = fill.watermarks(s, tier, capacity)
                counts = placement.counts[tier]
                rows.append(
                    {
                        "tier": tier,
                        "policy": s.policy,
                        "capacity_bytes": capacity,
                        "used_bytes": used,
                        "high_watermark_bytes": high,
                        "low_watermark_bytes": low,
                        "user_quota_bytes": user_q,
                        "tenant_quota_bytes": tenant_q,
                        **{
                            name: int(counts[name])
                            for name in ("hits", "misses", "promotions", "demotions", "evictions", "moved_bytes")
                        },
                        "prefetch_hits": int(placement.prefetch["hits"]) if tier == "host" else 0,
                        "prefetch_wasted": int(placement.prefetch["wasted"]) if tier == "host" else 0,
                    }
                )
            with self.catalog.engine.begin() as conn:  # not a change: no feed sequence number
                segments.record_policy(conn, self.process, rows)
        self._recorded = self._now()

    def run(self) -> dict[str, int]:
        """One pass: demote host, then disk, each down to its low mark if past its high
        mark. Returns the pages moved per tier."""
        with self._pass_lock:
            self.passes += 1
            return {"host": self._host(), "disk": self._disk()}

    def _host(self) -> int:
        host = self.pages.host
        placement = self.placement
        high, low = fill.watermarks(placement.settings, "host", host.capacity_bytes)
        with self.guard.lock:
            self.guard.check_open()
            if host.active_bytes <= high:
                return 0
            active = [c for c in host.candidates() if not host.is_inactive(c[0])]
            order = placement.host_victims(active, host.active_bytes - low)
        moved = 0
        for start in range(0, len(order), self.batch):
            with self.guard.lock:
                self.guard.check_open()
                if host.active_bytes <= low:
                    break
                batch = [
                    p
                    for p in order[start : start + self.batch]
                    if p in host and not host.is_inactive(p) and p not in placement.held
                ]
                sizes = [host.size_of(p) for p in batch]
                host.demote(batch)
                self.pages.hosted.demoted(batch, sizes=sizes)
                moved += len(batch)
        return moved

    def _disk(self) -> int:
        """Demote the disk's lowest-ordered active segments until the active ones are at the low
        mark, if past the high mark (no I/O, no transaction: they stay readable, inactive, until
        a write needs their room); first take off the inactive list the segments read since
        they were demoted, or gone. Returns the pages demoted."""
        placement = self.placement
        inactive = self.pages.disk.inactive
        high, low = fill.watermarks(placement.settings, "disk", self.disk_bytes)
        with self.guard.reading(), self.catalog.read() as conn:
            used = segments.tier_bytes(conn, "disk", self.pages.node_ref)
            if len(inactive):
                held = segments.all_segments(conn, "disk", self.pages.node_ref)
                inactive.discard([s.name for s in inactive if s.name not in held or disk.is_read_since(placement, s)])
            if used - inactive.bytes <= high:
                return 0
            ordered, page_ids = self.pages.segment_order(conn)
            chosen = fill.victims([s for s in ordered if s.name not in inactive], used - inactive.bytes - low)
            tick = placement.tick
            demoted = [
                InactiveSegment(s.name, s.size, tuple(PageId(p) for p in page_ids.get(s.ref, ())), tick) for s in chosen
            ]
            inactive.demote(demoted)
        moved = sum(len(s.page_ids) for s in demoted)
        placement.count("disk", "demotions", moved)
        return moved
