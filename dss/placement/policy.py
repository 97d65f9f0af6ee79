"""Placement policy: which pages stay on which tier, what leaves a full tier, and when a page
moves up. Every tier consults this one module; the store and the mover carry out its decisions.

The rules (``policy="dss"``, the default):

* **Score.** A page's worth on a tier is
  ``score = w_f·frequency + w_r·recency + w_c·(1/cost)`` (weights ``policy_weights``, default
  0.6 / 0.3 / 0.1), each term scaled to [0, 1] among the pages compared:

  - *frequency* — accesses with exponential decay: each access adds 1, the sum halves every
    ``frequency_half_life_s``; on a log scale, ``min(1, log(1 + f) / log(1 + f_90))`` where
    ``f_90`` is the 90th percentile among the candidates (so a shared prompt everyone reads
    does not flatten every other page's frequency to 0). A page not read for ``OVERDUE`` (4)
    times its user's *rhythm* (below) is overdue — the conversation most likely ended — and
    from then on its frequency also halves every rhythm, so a busy user's finished
    conversation does not outlast the live ones of quieter users;
  - *recency* — the chance that the page's conversation goes on after ``age`` (since its last
    access) without the next turn: ``g·w / (1 − g + g·w)``, ``g = 1 − ending``,
    ``w = exp(−age / rhythm)`` of the page's user (``2 ** (-age / recency_half_life_s)`` for a
    page of an unknown user). A user's *rhythm* is its typical time between turns (a weighted
    mean of the gaps, from ``recency_half_life_s``, at least an eighth of it); its *ending*, the
    chance that a turn is its conversation's last, is the share of its turns that started a
    session (each conversation starts once), drawn towards everyone's (``ENDING_PRIOR``). A
    page goes stale after a few of its own user's gaps, a one-off request's within about one;
  - *cost* — the seconds to bring the page back (its bytes over the disk's read bandwidth)
    versus the recompute seconds it saves (its tokens over the prefill speed); ``1/cost`` is
    divided by the highest among the candidates (pages of one layout all score 1).

  The lowest score leaves first; ties go to the least recently used. The host's order is
  computed once and consumed by later evictions; it is computed again when it is older than a
  quarter of ``recency_half_life_s`` or once more than an eighth as many pages as it ranks
  have arrived since (pages that arrived after it are in no order, so could not leave).
* **Admission.** A page competes for room in a full host: a write or a promotion goes in only
  if it scores at least as high as every page it would displace (scored alike, now), so a
  one-off request's pages do not push out a live conversation's. A prefetch, and a page no
  durable tier holds, go in whatever they are worth; LRU admits every page.
* **New pages** (commits, saves) go to disk, and to host if admitted. A written page counts
  as an access and starts no lower than its user's *activity*: the user's turns (new versions
  of any of their sessions), decayed like frequency, this one included. A session's next turn
  reads all of its pages together, so the pages the last turn wrote are as likely to be read
  again as the older ones every turn has read; by their own count they would have one access,
  like the pages of a user seen once (a one-off request), and leave first. A user idle for 8
  frequency half-lives is forgotten. (Where one ``user_id`` carries everyone's sessions, every
  written page starts at that one high activity, and that user's rhythm is short: recency then
  fades within about an eighth of ``recency_half_life_s``.)
* **Promotion.** A page read from disk for a load the engine waits for (``read_pages``,
  ``load=True``) is promoted to host at once, if admitted. Any other read promotes a page from
  disk to host only after ``promote_after`` accesses within ``promote_interval_s`` (never on a
  single touch), and not during the ``cooldown_s`` after it was demoted from host (so a page
  just demoted does not bounce straight back). A page a prefetch moves up counts as just used
  for recency, not as an access (its frequency is unchanged), so it stays for the turn it is
  for.
* **Watermarks.** Each tier has a high and a low mark (``*_high_watermark`` /
  ``*_low_watermark``, default 85 % / 70 % of its capacity), which measure its *active* bytes.
  When a tier's active bytes pass its high mark the mover (:mod:`dss.writes.mover`) demotes its
  lowest-ranked pages until they are at its low mark, so foreground writes rarely choose victims
  inline. A demotion costs no I/O and keeps the bytes: a demoted page stays in host (disk holds
  it), a demoted segment on disk; either is *inactive* — readable, active again when read, and
  the first to go (in the order demoted) when a write needs room — so the room below the low
  mark is not left empty, and the watermarks bound the work a write does inline, not what a tier
  holds (see :mod:`dss.tiers.host` and :mod:`dss.tiers.inactive`). The disk demotes whole
  segments (:mod:`dss.placement.disk`): first abandoned branches (pages some version holds but
  no session's head does), then the lightest (a session's page weighs its decayed frequency, a
  page saved without a session its chance of being read again times log(1 + frequency)); a
  write that finds too few inactive segments ranks them so inline and frees 5 % more than it
  needs.
* **Refcount safety.** A page being read, loaded into an engine or moved is *held*
  (:meth:`Placement.hold`); no held page is ever chosen. Pinned versions' pages and registered
  shared prefixes (which are pinned) never leave the last tier.
* **Quotas.** ``host_user_quota``, ``host_tenant_quota``, ``disk_user_quota``,
  ``disk_tenant_quota`` (bytes, 0 = none): a write or promotion that would put a user (a
  tenant) over its quota on a tier first evicts that user's (tenant's) own lowest-scored pages,
  so one heavy user cannot flush everyone's cache. A page that cannot fit its owner's quota
  stays out of that tier.
* **LRU** (``policy="lru"``): the same machinery with score = recency of last access only,
  and every disk read promotes — plain LRU, for benchmarks to compare against in the same run.

All policy time comes from the injectable clock (``clock=`` in :func:`dss.open`), so traces
replay fast. Pure decisions over plain values and this object's own bookkeeping; nothing here
reads or writes files or the catalog. The page and user statistics and the score live in
:mod:`dss.placement.stats` (with the constants ``FREQUENCY_QUANTILE``, ``RHYTHM_WEIGHT``,
``ENDING_PRIOR`` and ``OVERDUE``); the decisions here.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager

from dss.catalog.segments import SegmentRow
from dss.core.types import PageId
from dss.placement import disk
from dss.placement.stats import TIERS, PageStats, Scale, Settings, Statistics, decayed
from dss.tiers.host import HostTier, Owner
from dss.tiers.inactive import InactiveSegment

ARRIVALS = 8
"""The host's eviction order is computed again once more than ``1/ARRIVALS`` of the pages it
ranked have arrived since (pages that arrived after it are in no order, so could not leave)."""


class Placement(Statistics):
    """The policy of one store: page statistics (:class:`Statistics`), holds, counters and the
    decisions.

    Thread-safe for :meth:`hold` and the counters; decisions are made under the store's lock.
    """

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        super().__init__(settings, clock)
        self.held: Counter[PageId] = Counter()
        self.counts: dict[str, Counter[str]] = {tier: Counter() for tier in TIERS}
        self.prefetch = Counter({"issued": 0, "hits": 0, "wasted": 0})
        self.prefetched: set[PageId] = set()
        self._order: list[PageId] = []
        self._order_at = -math.inf
        self._scale = Scale(1.0, 0.0)
        self._order_tick = 0
        self._arrived = 0
        self._pos = 0
        self._lock = threading.Lock()

    # -- bookkeeping -----------------------------------------------------------------------

    def forget(self, page_ids: Iterable[PageId]) -> None:
        """The pages are gone from every tier."""
        page_ids = list(page_ids)
        super().forget(page_ids)
        for page_id in page_ids:
            self.prefetched.discard(page_id)

    @contextmanager
    def hold(self, page_ids: Sequence[PageId]) -> Iterator[None]:
        """Hold the pages while they are read, loaded or moved: no decision picks them."""
        with self._lock:
            self.held.update(page_ids)
        try:
            yield
        finally:
            with self._lock:
                self.held.subtract(page_ids)
                for page_id in page_ids:
                    if self.held[page_id] <= 0:
                        del self.held[page_id]

    def count(self, tier: str, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[tier][name] += n

    def prefetch_issued(self, page_id: PageId, now: float | None = None) -> None:
        """A prefetch moved the page up to host: it counts as just used for recency (not as an
        access: its decayed frequency stays what it is), so it stays for the turn it is for."""
        t = self.now() if now is None else now
        with self._lock:
            self.prefetched.add(page_id)
            self.prefetch["issued"] += 1
            s = self.stats.get(page_id)
            if s is None:
                s = self.stats[page_id] = PageStats(t)
            elif s.last < t:
                if s.last != -math.inf:
                    s.freq = decayed(s.freq, t - s.last, self.half_life(s))
                s.last = t
            self._tick += 1
            s.tick = self._tick

    def prefetch_used(self, page_ids: Iterable[PageId]) -> None:
        """These pages were read from host: a prefetched one counts as a prefetch hit."""
        if not self.prefetched:
            return
        with self._lock:
            for page_id in page_ids:
                if page_id in self.prefetched:
                    self.prefetched.discard(page_id)
                    self.prefetch["hits"] += 1

    def prefetch_left(self, page_id: PageId) -> None:
        """The page left host: a prefetched one nobody read counts as a wasted prefetch."""
        if page_id in self.prefetched:
            with self._lock:
                self.prefetched.discard(page_id)
                self.prefetch["wasted"] += 1

    # -- decisions -------------------------------------------------------------------------

    def should_promote(self, page_id: PageId, *, load: bool, now: float | None = None) -> bool:
        """Whether a page just read from disk goes to host (call after :meth:`touch`)."""
        if load or self.is_lru:
            return True
        t = self.now() if now is None else now
        s = self.stats.get(page_id)
        if s is None:
            return False
        if t - s.demoted_at < self.settings.cooldown_s:
            return False
        return s.window_count >= self.settings.promote_after and t - s.window_start <= self.settings.promote_interval_s

    def demoted(self, page_ids: Iterable[PageId], now: float | None = None) -> None:
        """The pages left host (their cool-down starts)."""
        t = self.now() if now is None else now
        for page_id in page_ids:
            s = self.stats.get(page_id)
            if s is not None:
                s.demoted_at = t

    def host_victims(
        self,
        candidates: Sequence[tuple[PageId, int, Owner | None]],
        to_free: int,
        owner_over: Callable[[Owner | None], bool] | None = None,
        now: float | None = None,
    ) -> list[PageId]:
        """Pages to drop from host to free ``to_free`` bytes, first to leave first; held pages
        never. ``candidates``: ``(page_id, size, owner)``, least recently used first. With
        ``owner_over``, only pages whose owner it accepts are taken (a quota's own pages)."""
        pool = [c for c in candidates if c[0] not in self.held and (owner_over is None or owner_over(c[2]))]
        if not pool or to_free <= 0:
            return []
        ids = [c[0] for c in pool]
        sizes = [c[1] for c in pool]
        chosen: list[PageId] = []
        freed = 0
        for i in self.order(ids, sizes, now)[0]:
            if freed >= to_free:
                break
            chosen.append(ids[i])
            freed += sizes[i]
        return chosen

    def host_room(
        self, host: HostTier, page_id: PageId, size: int, owner: Owner | None, compete: bool = False
    ) -> list[PageId] | None:
        """The pages to drop so page ``page_id`` of ``size`` bytes of ``owner`` fits the host
        tier: first the owner's own pages while the user (then the tenant) would exceed its
        quota, then the lowest-scored pages of anyone while the tier would exceed its capacity.
        ``None``: it stays out (over a quota by itself, held pages fill the room, or, with
        ``compete``, it scores lower than a page it would displace for room)."""
        self._arrived += 1
        chosen: list[PageId] = []
        if owner is not None and not self._quota_room(host, size, owner, chosen):
            return None
        freed = sum(host.size_of(p) for p in chosen)
        need = host.used_bytes - freed + size - host.capacity_bytes
        if need <= 0:
            return chosen
        room = self._capacity_room(host, page_id, size, need, set(chosen), compete)
        return None if room is None else chosen + room

    def _quota_room(self, host: HostTier, size: int, owner: Owner, chosen: list[PageId]) -> bool:
        """Add to ``chosen`` the owner's pages to drop so ``size`` more bytes fit the user's
        quota, then the tenant's; ``False`` when they cannot."""
        s = self.settings
        freed_user = 0
        if s.host_user_quota:
            if size > s.host_user_quota:
                return False
            over = host.owner_bytes.get(owner, 0) + size - s.host_user_quota
            if over > 0:
                freed_user = self._take(host, over, lambda o: o == owner, chosen)
                if freed_user < over:
                    return False
        if s.host_tenant_quota:
            if size > s.host_tenant_quota:
                return False
            over = host.tenant_bytes.get(owner[0], 0) + size - s.host_tenant_quota - freed_user
            if over > 0 and self._take(host, over, lambda o: o is not None and o[0] == owner[0], chosen) < over:
                return False
        return True

    def _take(self, host: HostTier, to_free: int, accept: Callable[[Owner | None], bool], chosen: list[PageId]) -> int:
        """Add to ``chosen`` the lowest-scored pages ``accept`` takes until ``to_free`` bytes are
        freed; returns the bytes freed. (Every page of the tier is listed only here, when a quota
        is exceeded: a put that fits costs O(1), not O(pages held).)"""
        taken = set(chosen)
        pool = [c for c in host.candidates() if c[0] not in taken]
        got = 0
        for victim in self.host_victims(pool, to_free, accept):
            chosen.append(victim)
            got += host.size_of(victim)
        return got

    def _capacity_room(
        self, host: HostTier, page_id: PageId, size: int, need: int, taken: set[PageId], compete: bool
    ) -> list[PageId] | None:
        """The pages (beyond ``taken``) to drop for ``need`` bytes of the tier's capacity:
        inactive pages first, then the eviction order's; ``None`` when held pages fill the room
        or, with ``compete``, the page is worth less than one it would displace."""
        room: list[PageId] = []
        for victim, victim_size in host.inactive():
            if need <= 0:
                break
            if victim not in taken and victim not in self.held:
                room.append(victim)
                need -= victim_size
        pos, order = self._pos, self._order
        if need > 0:
            got = self.next_victims(host, need, taken.union(room))
            if got is None:
                return None
            room.extend(got)
        if compete and not self.is_lru and room:
            now = self.now()
            best = max(self.score(p, host.size_of(p), self._scale, now) for p in room)
            if self.score(page_id, size, self._scale, now) < best:
                self._pos = pos if self._order is order else 0  # they stay next in line
                return None
        return room

    def _lru_victims(self, host: HostTier, need: int, exclude: AbstractSet[PageId]) -> list[PageId] | None:
        """The least recently used pages not held, to free ``need`` bytes (``None``: held pages fill it)."""
        chosen: list[PageId] = []
        for page_id, page_size in host.oldest():
            if need <= 0:
                break
            if page_id not in self.held and page_id not in exclude:
                chosen.append(page_id)
                need -= page_size
        return chosen if need <= 0 else None

    def _rank(self, host: HostTier, now: float) -> None:
        """Compute the host's eviction order again, from every page it holds."""
        candidates = host.candidates()
        ids = [c[0] for c in candidates]
        ranked, self._scale = self.order(ids, [c[1] for c in candidates], now)
        self._order = [ids[i] for i in ranked]
        self._order_at, self._order_tick, self._pos = now, self._tick, 0
        self._arrived = 0

    def next_victims(
        self, host: HostTier, need: int, exclude: AbstractSet[PageId] = frozenset()
    ) -> list[PageId] | None:
        """The pages that leave host next, to free ``need`` bytes (``None``: held pages fill it).

        Scoring every page at every put would cost O(pages) a put: the order is computed once
        and consumed, skipping pages gone, held, or accessed since it was computed (their score
        only rose); it is recomputed when used up or older than a quarter of
        ``recency_half_life_s``. LRU walks the tier's own order."""
        if self.is_lru:
            return self._lru_victims(host, need, exclude)
        chosen: list[PageId] = []
        held = self.held
        now = self.now()
        if now - self._order_at > self.settings.recency_half_life_s / 4 or self._arrived * ARRIVALS > len(self._order):
            self._order = []
        refreshed = False
        stats = self.stats
        wanted = need
        while need > 0:
            if self._pos >= len(self._order):
                if refreshed:
                    return None
                self._rank(host, now)
                refreshed = True
                need, chosen = wanted, []  # the new order ranks them again
                continue
            page_id = self._order[self._pos]
            self._pos += 1
            st = stats.get(page_id)
            if (
                page_id not in host
                or page_id in held
                or page_id in exclude
                or (st is not None and st.tick > self._order_tick)
            ):
                continue
            chosen.append(page_id)
            need -= host.size_of(page_id)
        return chosen

    def segment_order(
        self, segments: Sequence[SegmentRow], pages: Mapping[int, Sequence[PageId]], now: float | None = None
    ) -> list[SegmentRow]:
        """Disk segments in the order they leave (:func:`dss.placement.disk.segment_order`)."""
        return disk.segment_order(self, segments, pages, self.now() if now is None else now)

    def disk_reclaim(self, inactive: Iterable[InactiveSegment], need: int) -> tuple[list[InactiveSegment], list[str]]:
        """The inactive disk segments a write drops for ``need`` bytes, and those read since
        they were demoted (:func:`dss.placement.disk.reclaim`); held pages' segments never."""
        return disk.reclaim(self, self.held, inactive, need)
