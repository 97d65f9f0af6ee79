"""What the placement policy (:mod:`dss.placement.policy`) remembers of pages and users, and what a page
is worth: its score. The rules are written in :mod:`dss.placement.policy`'s docstring; this module holds
the bookkeeping they need (accesses, writes, users' activity and rhythm) and the score.

Pure computation over plain values and this object's own state; all time comes from the
injected clock. Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Sequence
from typing import NamedTuple

from dss.core.types import PageId
from dss.placement.sessionless import SessionlessStats

TIERS = ("host", "disk")
"""The tiers this process places pages on, fastest first."""

COUNTERS = ("hits", "misses", "promotions", "demotions", "evictions", "moved_bytes", "inline_evictions")
"""Per-tier counters (see :attr:`dss.placement.policy.Placement.counts`)."""

FREQUENCY_QUANTILE = 0.9
"""The frequency term is ``log(1 + f)`` over that of this quantile of the candidates' frequencies,
capped at 1: the few pages everyone reads (shared prompts) do not flatten everyone else's."""

IDLE_ACTIVITY = 1.0 / 256
"""A user whose activity decayed below this (8 half-lives without a turn) is forgotten by
:meth:`Statistics.prune`: its new pages would inherit nothing worth keeping."""

RHYTHM_WEIGHT = 0.3
"""A user's *rhythm* (typical seconds between its turns) moves this share of the way to each
new gap between two of its turns (an exponentially weighted mean)."""

ENDING_PRIOR = 8.0
"""A user's *ending* (the chance that a turn is its conversation's last) is its share of turns
that started a session, drawn towards the share among all users as if it had this many turns
more at that share: a user seen once is not judged on one turn."""

OVERDUE = 4.0
"""A page not read for this many times its user's rhythm is *overdue* (the conversation most
likely ended): from then on its frequency also halves every rhythm."""


class Settings(NamedTuple):
    """The policy's settings, plain values taken from ``StoreConfig``."""

    policy: str = "dss"
    weights: tuple[float, float, float] = (0.6, 0.3, 0.1)
    frequency_half_life_s: float = 120.0
    recency_half_life_s: float = 60.0
    promote_after: int = 2
    promote_interval_s: float = 300.0
    cooldown_s: float = 30.0
    host_high: float = 0.85
    host_low: float = 0.70
    disk_high: float = 0.85
    disk_low: float = 0.70
    host_user_quota: int = 0
    host_tenant_quota: int = 0
    disk_user_quota: int = 0
    disk_tenant_quota: int = 0
    move_batch_pages: int = 16
    disk_bytes_per_s: float = 1e9
    recompute_tokens_per_s: float = 4000.0


class UserStats:
    """What the policy remembers of one user (namespace)."""

    __slots__ = ("activity", "rhythm", "starts", "turns", "when")

    def __init__(self, activity: float, when: float, rhythm: float) -> None:
        self.activity = activity
        """The user's turns (new versions of any of its sessions), decayed like frequency, as
        of ``when``."""
        self.when = when
        """When the user's last turn was."""
        self.rhythm = rhythm
        """Typical seconds between the user's turns (starts at ``recency_half_life_s``)."""
        self.turns = 0
        """The user's turns seen by this process."""
        self.starts = 0
        """Of ``turns``, those that started a session (its first version)."""


class Scale(NamedTuple):
    """How one ranking scaled the frequency and ``1/cost`` terms of its candidates."""

    top_f: float
    """``log(1 + f_90)``: the frequency term is ``min(1, log(1 + f) / top_f)``."""
    top_v: float
    """The highest ``1/cost``: the cost term is ``(1/cost) / top_v`` (1 when 0)."""


class PageStats:
    """What the policy remembers of one page."""

    __slots__ = (
        "demoted_at",
        "freq",
        "is_sessionless",
        "last",
        "reads",
        "tick",
        "tokens",
        "user",
        "window_count",
        "window_start",
    )

    def __init__(self, now: float) -> None:
        self.freq = 0.0
        self.reads = 0
        """Accesses recorded, undecayed."""
        self.is_sessionless = False
        """Saved without a session (:mod:`dss.placement.sessionless`), by its last write."""
        self.last = now
        self.window_start = now
        self.window_count = 0
        self.demoted_at = -math.inf
        self.tokens = 0
        self.tick = 0
        self.user: int | None = None
        """The namespace that wrote the page (``None``: written by another process)."""


class Statistics:
    """Page and user statistics of one store, and the score of a page among others."""

    def __init__(self, settings: Settings, clock: Callable[[], float]) -> None:
        self.settings = settings
        self.clock = clock
        self.is_lru = settings.policy == "lru"
        self.stats: dict[PageId, PageStats] = {}
        self.users: dict[int, UserStats] = {}
        """What the policy remembers of each user (namespace) that wrote here."""
        self.turns = 0
        """Turns of every user seen by this process."""
        self.starts = 0
        """Of ``turns``, those that started a session."""
        self.sessionless = SessionlessStats(settings.recency_half_life_s, settings.frequency_half_life_s)
        """What the policy learns of pages saved without a session."""
        self._tick = 0

    def now(self) -> float:
        return float(self.clock())

    @property
    def tick(self) -> int:
        """How many accesses were recorded so far (a page's ``tick`` is the last that touched it)."""
        return self._tick

    def touch(self, page_ids: Iterable[PageId], now: float | None = None) -> None:
        """Record an access to each page (a sessionless page's read counts for its going on and
        the sessionless rhythm: :mod:`dss.placement.sessionless`)."""
        t = self.now() if now is None else now
        h = self.settings.frequency_half_life_s
        window = self.settings.promote_interval_s
        stats = self.stats
        sessionless = self.sessionless
        self._tick += 1
        tick = self._tick
        gaps = 0.0
        again = 0
        for page_id in page_ids:
            s = stats.get(page_id)
            if s is None:
                s = stats[page_id] = PageStats(t)
            s.tick = tick
            half = h
            if s.is_sessionless:
                half = sessionless.half_life
                sessionless.again(s.reads)
                if s.reads and t >= s.last:
                    gaps += t - s.last
                    again += 1
            s.freq = (decayed(s.freq, t - s.last, half) if t >= s.last else s.freq) + 1.0
            s.reads += 1
            s.last = max(t, s.last)
            if t - s.window_start > window:
                s.window_start, s.window_count = t, 0
            s.window_count += 1
        if again:
            sessionless.gap(gaps / again)

    def wrote(
        self,
        page_ids: Sequence[PageId],
        user: int | None,
        *,
        turn: bool,
        started: bool = False,
        sessionless: bool = False,
        now: float | None = None,
    ) -> None:
        """Record a write of the pages by namespace ``user`` (``turn``: it made a new version of
        a session; ``started``: the session's first; ``sessionless``: a save without a session).
        Each page is accessed once and starts no lower than the user's activity (the user's
        turns, decayed like frequency, this one included); a turn also moves the user's rhythm
        towards the time since its last turn, and counts towards its ending. A sessionless
        write marks its pages sessionless (any other, not)."""
        t = self.now() if now is None else now
        self.touch(page_ids, t)
        self._mark(page_ids, sessionless)
        if user is None:
            return
        activity = self.activity(user, t) + (1.0 if turn else 0.0)
        if turn:
            got = self.users.get(user)
            if got is None:
                got = self.users[user] = UserStats(activity, t, self.settings.recency_half_life_s)
            else:
                got.rhythm += RHYTHM_WEIGHT * (max(0.0, t - got.when) - got.rhythm)
                got.activity, got.when = activity, max(t, got.when)
            got.turns += 1
            self.turns += 1
            if started:
                got.starts += 1
                self.starts += 1
        stats = self.stats
        for page_id in page_ids:
            s = stats[page_id]
            s.user = user
            s.freq = max(s.freq, activity)

    def _mark(self, page_ids: Sequence[PageId], sessionless: bool) -> None:
        """Mark the pages just written sessionless or not; a page read for the first time
        counts for the sessionless pages' going on."""
        stats = self.stats
        first = 0
        for page_id in page_ids:
            s = stats[page_id]
            if sessionless and not s.is_sessionless and s.reads == 1:
                first += 1
            s.is_sessionless = sessionless
        if first:
            self.sessionless.first(first)

    def half_life(self, s: PageStats) -> float:
        """Seconds in which the page's frequency halves (longer for a sessionless page)."""
        return self.sessionless.half_life if s.is_sessionless else self.settings.frequency_half_life_s

    def ending(self, user: UserStats) -> float:
        """The chance that a turn of ``user`` is its conversation's last, within [0.01, 0.99]:
        each conversation starts once, so the share of a user's turns that started a session
        is about one over the length of its conversations (see ``ENDING_PRIOR``)."""
        share = self.starts / self.turns  # a known user took a turn: turns >= 1
        ending = (user.starts + ENDING_PRIOR * share) / (user.turns + ENDING_PRIOR)
        return min(0.99, max(0.01, ending))

    def activity(self, user: int, now: float) -> float:
        """The user's turns, decayed like frequency, at ``now`` (0 for one never seen)."""
        got = self.users.get(user)
        if got is None:
            return 0.0
        return decayed(got.activity, max(0.0, now - got.when), self.settings.frequency_half_life_s)

    def note_tokens(self, page_ids: Iterable[PageId], tokens: int) -> None:
        """The pages hold ``tokens`` tokens each (their layout's page size), for the cost term."""
        t = self.now()
        for page_id in page_ids:
            s = self.stats.get(page_id)
            if s is None:
                s = self.stats[page_id] = PageStats(t)
                s.last = -math.inf  # known, never accessed
            s.tokens = tokens

    def forget(self, page_ids: Iterable[PageId]) -> None:
        """The pages are gone from every tier."""
        for page_id in page_ids:
            self.stats.pop(page_id, None)

    def prune(self, *held: Container[PageId]) -> int:
        """Forget the statistics of pages none of ``held`` (what the tiers hold) contains any
        more (deleted, evicted from disk, erased); returns how many went."""
        gone = [p for p in self.stats if not any(p in kept for kept in held)]
        self.forget(gone)
        t = self.now()
        for user in [k for k in self.users if self.activity(k, t) < IDLE_ACTIVITY]:
            del self.users[user]
        return len(gone)

    def scored(
        self, page_ids: Sequence[PageId], sizes: Sequence[int], now: float | None = None
    ) -> tuple[list[float], Scale]:
        """The score of each page among these candidates, and the scale they were scored on
        (to score other pages alike with :meth:`score`)."""
        t = self.now() if now is None else now
        if self.is_lru:
            stats = self.stats
            return [(s.last if (s := stats.get(p)) is not None else -math.inf) for p in page_ids], Scale(1.0, 0.0)
        terms = [self._terms(p, size, t) for p, size in zip(page_ids, sizes)]
        ranked = sorted(f for f, _, _ in terms)
        scale = Scale(
            math.log1p(ranked[int(len(ranked) * FREQUENCY_QUANTILE)] if ranked else 0.0) or 1.0,
            max((v for _, _, v in terms), default=0.0),
        )
        return [self._combine(term, scale) for term in terms], scale

    def score(self, page_id: PageId, size: int, scale: Scale, now: float) -> float:
        """One page's score at ``now`` on the ``scale`` of an earlier ranking."""
        if self.is_lru:
            s = self.stats.get(page_id)
            return s.last if s is not None else -math.inf
        return self._combine(self._terms(page_id, size, now), scale)

    def _terms(self, page_id: PageId, size: int, t: float) -> tuple[float, float, float]:
        """``(decayed frequency, recency, 1/cost)`` of a page at ``t``, before scaling."""
        s = self.stats.get(page_id)
        if s is None or s.last == -math.inf:
            f = r = 0.0
        elif s.is_sessionless:
            age = max(0.0, t - s.last)
            f = decayed(s.freq, age, self.sessionless.half_life)
            r = self.sessionless.recency(s.reads, age)
        else:
            f, r = self._session_terms(s, max(0.0, t - s.last))
        tokens = s.tokens if s is not None and s.tokens else 0
        # 1/cost = recompute seconds saved / seconds to move; unknown tokens: neutral
        per_byte = self.settings.recompute_tokens_per_s / self.settings.disk_bytes_per_s
        return f, r, (tokens / (size * per_byte) if tokens and size else 0.0)

    def _session_terms(self, s: PageStats, age: float) -> tuple[float, float]:
        """``(decayed frequency, recency)`` of a page of a session (or of no known user)."""
        f = decayed(s.freq, age, self.settings.frequency_half_life_s)
        h_r = self.settings.recency_half_life_s
        user = self.users.get(s.user) if s.user is not None else None
        if user is None:
            return f, decayed(1.0, age, h_r)
        rhythm = max(user.rhythm, h_r / 8)
        if age > OVERDUE * rhythm:
            f = decayed(f, age - OVERDUE * rhythm, rhythm)
        # the chance the conversation goes on, after ``age`` without the next turn
        going, waiting = 1.0 - self.ending(user), math.exp(-age / rhythm)
        return f, going * waiting / (1.0 - going + going * waiting)

    def _combine(self, terms: tuple[float, float, float], scale: Scale) -> float:
        f, r, v = terms
        w_f, w_r, w_c = self.settings.weights
        return w_f * min(1.0, math.log1p(f) / scale.top_f) + w_r * r + w_c * (v / scale.top_v if scale.top_v else 1.0)

    def order(
        self, page_ids: Sequence[PageId], sizes: Sequence[int], now: float | None = None
    ) -> tuple[list[int], Scale]:
        """Indexes of the candidates, the first to leave first (lowest score, then the
        earliest given — callers list candidates least recently used first), and the scale
        they were scored on."""
        scores, scale = self.scored(page_ids, sizes, now)
        return sorted(range(len(page_ids)), key=lambda i: (scores[i], i)), scale


def decayed(value: float, age: float, half_life: float) -> float:
    """``value`` after ``age`` seconds of exponential decay that halves it every ``half_life``."""
    return value * 2.0 ** (-age / half_life)
