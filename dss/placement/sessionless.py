"""What the placement policy learns of pages saved without a session — prefix lookups with no
session or user, as the vLLM connector serves a request that names none — in place of the
users' rhythm the session path has (:mod:`dss.placement.stats`).

Such a page has no user whose turns say when it will be read next. What the store sees is how
its prefix lookups read pages again, and it learns three things from them:

* the **rhythm**: the typical seconds between two reads of one page. Each read that reads pages
  again moves it ``RHYTHM_WEIGHT`` of the way to the mean gap of those pages (one step per read,
  not per page, so a long prompt does not outweigh a short one); it starts at
  ``recency_half_life_s`` and is at least an eighth of it;
* the **going on** after ``k`` reads: of the pages read ``k`` times (``k`` up to ``MAX_READS``),
  the share that was read again, drawn towards the share over every count (``GOING_PRIOR``). A
  one-off prompt's pages, read once, are read again far less often than a prefix read twice
  (on the published Mooncake traces: 24-42 % against 42-84 %), so this is what keeps one-off
  prompts from displacing prefixes that come back;
* the **memory**: a sessionless page's frequency halves every
  ``max(frequency_half_life_s, MEMORY × rhythm)``, so a prefix is remembered across a few of the
  gaps between its reads, however long they are.

A sessionless page's recency is the chance that it is read again after ``age`` seconds without a
read: ``g·w / (1 − g + g·w)``, ``g`` its going on, ``w = exp(−age / rhythm)`` — the session
path's formula, with the page's reads in place of its user's turns. Every page of a prefix is
read whenever a longer prompt is, so a page's frequency counts the lookups through the prefix it
ends, and the head of a shared prefix is worth at least as much as any page after it.

Pure bookkeeping over plain values; not thread-safe (the store calls it under its lock).
"""

from __future__ import annotations

import math

RHYTHM_WEIGHT = 0.05
"""How far one read that reads pages again moves the rhythm towards their mean gap."""

MAX_READS = 8
"""Pages read this many times or more share one count for their going on."""

GOING_PRIOR = 8.0
"""A count's going on is drawn towards the share over every count as if it had this many pages
more at that share: a count seen a few times is not judged on them."""

MEMORY = 2.5
"""A sessionless page's frequency halves every ``max(frequency_half_life_s, MEMORY × rhythm)``."""


class SessionlessStats:
    """The rhythm, going on and memory of a store's sessionless pages (see the module docstring)."""

    __slots__ = ("frequency_half_life_s", "min_rhythm", "reached", "rhythm", "went_on")

    def __init__(self, recency_half_life_s: float, frequency_half_life_s: float) -> None:
        self.rhythm = recency_half_life_s
        """Typical seconds between two reads of a sessionless page."""
        self.min_rhythm = recency_half_life_s / 8
        self.frequency_half_life_s = frequency_half_life_s
        self.reached = [0] * (MAX_READS + 1)
        """``reached[k]``: sessionless pages read ``k`` times (``MAX_READS``: or more)."""
        self.went_on = [0] * (MAX_READS + 1)
        """``went_on[k]``: of ``reached[k]``, those read again (at ``MAX_READS`` each read counts
        as reaching it)."""

    @property
    def half_life(self) -> float:
        """Seconds in which a sessionless page's frequency halves."""
        return max(self.frequency_half_life_s, MEMORY * max(self.rhythm, self.min_rhythm))

    def first(self, num_pages: int) -> None:
        """``num_pages`` sessionless pages were read (written) for the first time."""
        self.reached[1] += num_pages

    def again(self, reads: int) -> None:
        """A sessionless page read ``reads`` times before was read again."""
        self.went_on[min(reads, MAX_READS)] += 1
        self.reached[min(reads + 1, MAX_READS)] += 1

    def gap(self, mean_gap: float) -> None:
        """One read read pages again after ``mean_gap`` seconds on average: move the rhythm."""
        self.rhythm += RHYTHM_WEIGHT * (mean_gap - self.rhythm)

    def going(self, reads: int) -> float:
        """The chance that a sessionless page read ``reads`` times is read again, within
        [0.01, 0.99] (see the module docstring)."""
        k = min(max(reads, 1), MAX_READS)
        total = sum(self.reached)
        share = sum(self.went_on) / total if total else 0.5
        going = (self.went_on[k] + GOING_PRIOR * share) / (self.reached[k] + GOING_PRIOR)
        return min(0.99, max(0.01, going))

    def recency(self, reads: int, age: float) -> float:
        """The chance that a sessionless page read ``reads`` times, last ``age`` seconds ago, is
        read again: ``g·w / (1 − g + g·w)``, ``w = exp(−age / rhythm)``."""
        going = self.going(reads)
        waiting = math.exp(-age / max(self.rhythm, self.min_rhythm))
        return going * waiting / (1.0 - going + going * waiting)
