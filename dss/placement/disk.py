"""What leaves the disk tier, and in which order: the policy's decisions for the last tier.

The mover demotes segments in :func:`segment_order` (no I/O: they stay readable, inactive; see
:mod:`dss.tiers.inactive`), and a write that needs room reclaims the inactive ones, first demoted
first (:func:`reclaim`), skipping those a read made active again. Only when those do not suffice
does a write rank every segment inline (:meth:`dss.pages.store.PageStore.room`).

Pure decisions over plain values and the policy's statistics; nothing here reads files or the
catalog.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping, Sequence

from dss.catalog.segments import SegmentRow
from dss.core.types import PageId
from dss.placement.stats import PageStats, Statistics, decayed
from dss.tiers.inactive import InactiveSegment


def segment_order(
    stats: Statistics, segments: Sequence[SegmentRow], pages: Mapping[int, Sequence[PageId]], now: float
) -> list[SegmentRow]:
    """Disk segments in the order they leave (pinned ones left out), given in the catalog's order
    (oldest newest-version first). ``dss``: abandoned segments first
    (:attr:`SegmentRow.is_abandoned`), then the others; within each, the lightest first (a
    segment weighs what its heaviest page does: :func:`segment_worth`), and among equals the one
    whose newest version is oldest. LRU: the least recently read first (the catalog's order
    among equals). ``pages``: each segment's page ids."""
    free = [s for s in segments if not s.is_pinned]
    if not free:
        return free
    page_stats = stats.stats
    if stats.is_lru:
        last = [_last_read(page_stats, pages.get(segment.ref, ())) for segment in free]
        return [free[i] for i in sorted(range(len(free)), key=lambda i: (last[i], i))]
    best = segment_worth(stats, free, pages, now)
    return [
        free[i] for i in sorted(range(len(free)), key=lambda i: (not free[i].is_abandoned, best[i], free[i].newest, i))
    ]


def segment_worth(
    stats: Statistics, segments: Sequence[SegmentRow], pages: Mapping[int, Sequence[PageId]], now: float
) -> list[float]:
    """What each segment weighs on disk: what its heaviest page does (0 for a page never read).
    A session's page (or one of no known session) weighs its frequency, decayed. A page saved
    without a session weighs the chance that it is read again
    (:meth:`dss.placement.sessionless.SessionlessStats.recency`) times ``log(1 + f)``, ``f`` its
    frequency as of its last read: the reads it had, counted only as long as it is likely to
    come back, so a one-off prompt's page weighs less than a prefix read again as recently, and
    a document read often outlasts one read once. The two scales are not calibrated against
    each other: on a disk both kinds share, they are compared as they are."""
    page_stats = stats.stats
    learned = stats.sessionless
    half_life = stats.settings.frequency_half_life_s
    out: list[float] = []
    for segment in segments:
        worth = 0.0
        for p in pages.get(segment.ref, ()):
            s = page_stats.get(p)
            if s is None or s.last == -math.inf:
                continue
            age = max(0.0, now - s.last)
            if s.is_sessionless:
                worth = max(worth, learned.recency(s.reads, age) * math.log1p(s.freq))
            else:
                worth = max(worth, decayed(s.freq, age, half_life))
        out.append(worth)
    return out


def _last_read(pages: Mapping[PageId, PageStats], page_ids: Iterable[PageId]) -> float:
    """When a page of these was last read (``-inf``: never)."""
    return max((s.last for p in page_ids if (s := pages.get(p)) is not None), default=-math.inf)


def is_read_since(stats: Statistics, segment: InactiveSegment) -> bool:
    """Whether a page of the inactive ``segment`` was accessed after it was demoted (so it is
    active again)."""
    pages = stats.stats
    tick = segment.tick
    return any((s := pages.get(p)) is not None and s.tick > tick for p in segment.page_ids)


def reclaim(
    stats: Statistics, held: Container[PageId], inactive: Iterable[InactiveSegment], need: int
) -> tuple[list[InactiveSegment], list[str]]:
    """The inactive segments to drop so ``need`` bytes are freed, first demoted first (fewer
    when they do not suffice), and the names of those passed over because they were read since
    they were demoted (active again: to take off the list). Segments holding a held page are
    passed over and stay inactive."""
    chosen: list[InactiveSegment] = []
    active: list[str] = []
    for segment in inactive:
        if need <= 0:
            break
        if is_read_since(stats, segment):
            active.append(segment.name)
        elif not any(p in held for p in segment.page_ids):
            chosen.append(segment)
            need -= segment.size
    return chosen, active
