"""How much of a published trace any host-tier policy can serve: classic online policies and
two oracles, simulated on the trace's block reads.

``benchmarks/tiers.py`` replays a trace through the real store, for dss's policy, LRU and
Belady. This asks the question beside it: is a host share of 1.5× LRU's within reach of an
online policy at all? Each policy is a cache of ``capacity`` blocks (a share of the trace's
distinct blocks) in front of a disk that holds everything, so every block of every request is
one read, a hit or a miss, and a miss is offered to the cache (as a store offers what it wrote
or loaded). The online policies see only the past: LRU, SLRU, LRU-2, ARC, LFU with and without
decay, and W-TinyLFU. The two oracles see the future: ``count oracle`` knows how many more
times each block will be read (not when) and keeps those read most; ``belady`` knows when, the
bound. Deterministic: the same command prints the same table on any machine::

    PYTHONPATH=. .venv/bin/python benchmarks/policies.py --trace synthetic --capacity 0.02
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mooncake import NAMES, distinct_blocks, load, path_of
from optimum import belady


class Cache(Protocol):
    def read(self, page: Hashable) -> bool:
        """Read ``page``: whether the cache held it (a miss is offered to the cache)."""
        ...


class Lru:
    """Least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[Hashable, None] = OrderedDict()

    def read(self, page: Hashable) -> bool:
        if page in self.pages:
            self.pages.move_to_end(page)
            return True
        self.pages[page] = None
        if len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return False


class Slru:
    """Segmented LRU: a page read again moves from the probationary segment (a fifth) to the
    protected one; the protected segment's oldest goes back to probation."""

    def __init__(self, capacity: int) -> None:
        self.protected_size = max(1, capacity * 4 // 5)
        self.capacity = capacity
        self.probation: OrderedDict[Hashable, None] = OrderedDict()
        self.protected: OrderedDict[Hashable, None] = OrderedDict()

    def read(self, page: Hashable) -> bool:
        if page in self.protected:
            self.protected.move_to_end(page)
            return True
        hit = page in self.probation
        if hit:
            del self.probation[page]
            self.protected[page] = None
            if len(self.protected) > self.protected_size:
                oldest, _ = self.protected.popitem(last=False)
                self.probation[oldest] = None
        else:
            self.probation[page] = None
        while len(self.probation) + len(self.protected) > self.capacity:
            self.probation.popitem(last=False)
        return hit


class Ranked:
    """A cache that evicts the page of lowest rank (a heap whose stale entries are skipped).
    Subclasses give ``rank(page, now)``, a page's rank after its read at ``now``; ``admit``
    decides whether a missed page enters in place of the lowest-ranked one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.ranks: dict[Hashable, tuple[float, ...]] = {}
        self.heap: list[tuple[tuple[float, ...], int, Hashable]] = []
        self.now = 0

    def rank(self, page: Hashable, now: int) -> tuple[float, ...]:
        raise NotImplementedError

    def admit(self, rank: tuple[float, ...], lowest: tuple[float, ...]) -> bool:
        return True

    def _lowest(self) -> tuple[tuple[float, ...], Hashable]:
        while True:
            rank, _, page = self.heap[0]
            if self.ranks.get(page) == rank:
                return rank, page
            heapq.heappop(self.heap)

    def read(self, page: Hashable) -> bool:
        self.now += 1
        hit = page in self.ranks
        rank = self.rank(page, self.now)
        if not hit and len(self.ranks) >= self.capacity:
            lowest, victim = self._lowest()
            if not self.admit(rank, lowest):
                return False
            del self.ranks[victim]
        self.ranks[page] = rank
        heapq.heappush(self.heap, (rank, self.now, page))
        return hit


class Lru2(Ranked):
    """LRU-2: evicts the page whose second-to-last read is oldest (a page read once first);
    every page's last two reads are remembered, cached or not."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.reads: dict[Hashable, tuple[int, int]] = {}

    def rank(self, page: Hashable, now: int) -> tuple[float, ...]:
        _, last = self.reads.get(page, (-1, -1))
        self.reads[page] = (last, now)
        return (last, now)


class Lfu(Ranked):
    """LFU over every read of the trace so far, cached or not, each read's weight halving every
    ``half_life`` reads (``None``: never); ties go to the least recently read."""

    def __init__(self, capacity: int, half_life: float | None) -> None:
        super().__init__(capacity)
        self.half_life = half_life
        self.weight: dict[Hashable, float] = {}

    def rank(self, page: Hashable, now: int) -> tuple[float, ...]:
        if self.half_life is None:
            value = self.weight.get(page, 0.0) + 1.0
        else:  # log2 of the decayed count, scaled to read ``now``: comparable across pages
            value = _log2_add(self.weight.get(page, -math.inf), now / self.half_life)
        self.weight[page] = value
        return (value, now)


def _log2_add(a: float, b: float) -> float:
    high, low = max(a, b), min(a, b)
    return high + math.log2(1.0 + 2.0 ** (low - high)) if low > -math.inf else high


class CountOracle(Ranked):
    """Knows each page's number of reads to come (not when): keeps the pages read most from now
    on, admits a page only when it will be read more than the page it would evict."""

    def __init__(self, capacity: int, reads: Sequence[Hashable]) -> None:
        super().__init__(capacity)
        self.left = Counter(reads)

    def rank(self, page: Hashable, now: int) -> tuple[float, ...]:
        self.left[page] -= 1
        return (self.left[page], now)

    def admit(self, rank: tuple[float, ...], lowest: tuple[float, ...]) -> bool:
        return rank[0] > 0 and rank > lowest


class Arc:
    """Adaptive replacement (Megiddo and Modha): recency and frequency lists with ghosts of what
    each evicted, the split between them learned from the ghosts' hits."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def _replace(self, page: Hashable) -> None:
        if self.t1 and (len(self.t1) > self.p or (page in self.b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        else:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None

    def read(self, page: Hashable) -> bool:
        if page in self.t1:
            del self.t1[page]
            self.t2[page] = None
            return True
        if page in self.t2:
            self.t2.move_to_end(page)
            return True
        if page in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) // len(self.b1), 1))
            self._replace(page)
            del self.b1[page]
            self.t2[page] = None
            return False
        if page in self.b2:
            self.p = max(0, self.p - max(len(self.b1) // len(self.b2), 1))
            self._replace(page)
            del self.b2[page]
            self.t2[page] = None
            return False
        known = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
        if len(self.t1) + len(self.b1) == self.c:
            if len(self.t1) < self.c:
                self.b1.popitem(last=False)
                self._replace(page)
            else:
                self.t1.popitem(last=False)
        elif known >= self.c:
            if known == 2 * self.c:
                self.b2.popitem(last=False)
            self._replace(page)
        self.t1[page] = None
        return False


class TinyLfu:
    """W-TinyLFU (Einziger et al.): a small LRU window in front of an SLRU; a page leaving the
    window enters the main cache only if read more often than the main cache's next victim.
    Frequencies count every read, halved every ten capacities of reads."""

    def __init__(self, capacity: int, window: float) -> None:
        self.window_size = max(1, int(capacity * window))
        self.window: OrderedDict[Hashable, None] = OrderedDict()
        self.main = Slru(max(1, capacity - self.window_size))
        self.freq: Counter[Hashable] = Counter()
        self.reads = 0
        self.age_every = 10 * capacity

    def read(self, page: Hashable) -> bool:
        self.freq[page] += 1
        self.reads += 1
        if self.reads % self.age_every == 0:
            self.freq = Counter({p: n // 2 for p, n in self.freq.items() if n > 1})
        main = self.main
        if page in main.protected or page in main.probation:
            return main.read(page)
        window = self.window
        if page in window:
            window.move_to_end(page)
            return True
        window[page] = None
        if len(window) > self.window_size:
            candidate, _ = window.popitem(last=False)
            full = len(main.probation) + len(main.protected) >= main.capacity
            victim = next(iter(main.probation or main.protected), None)
            if not full or victim is None or self.freq[candidate] > self.freq[victim]:
                main.read(candidate)
        return False


@dataclass(frozen=True)
class Row:
    """One policy's result: ``hits`` of the trace's ``reads`` block reads served from host."""

    policy: str
    hits: int
    reads: int

    @property
    def share(self) -> float:
        return self.hits / self.reads


def policies(capacity: int, reads: Sequence[Hashable]) -> dict[str, Callable[[], Cache]]:
    """The simulated policies by name, each a factory of a fresh cache of ``capacity`` pages."""
    return {
        "lru": lambda: Lru(capacity),
        "slru": lambda: Slru(capacity),
        "lru-2": lambda: Lru2(capacity),
        "arc": lambda: Arc(capacity),
        "lfu": lambda: Lfu(capacity, None),
        **{f"lfu, half-life {k}x": (lambda k=k: Lfu(capacity, k * capacity)) for k in (1, 4, 16)},
        **{f"w-tinylfu {w:.0%}": (lambda w=w: TinyLfu(capacity, w)) for w in (0.01, 0.2)},
        "count oracle": lambda: CountOracle(capacity, reads),
    }


def run(trace: str, share: float, limit: int | None = None) -> list[Row]:
    """Every policy's hits on ``trace`` with a host of ``share`` of its distinct blocks, then
    Belady's."""
    trace_requests = load(trace, limit)
    requests = [r.hash_ids for r in trace_requests]
    reads = [h for r in requests for h in r]
    if not reads:
        raise ValueError("it has no block reads")
    capacity = max(1, int(share * distinct_blocks(trace_requests)))
    rows = []
    for name, make in policies(capacity, reads).items():
        cache = make()
        rows.append(Row(name, sum(cache.read(page) for page in reads), len(reads)))
    rows.append(Row("belady", belady(requests, capacity, prefix=False), len(reads)))
    return rows


def versus_lru(row: Row, rows: Sequence[Row]) -> str:
    """``row``'s share as a multiple of LRU's (``-`` where LRU served nothing)."""
    lru = next(r for r in rows if r.policy == "lru").share
    return f"{row.share / lru:.2f}x" if lru else "-"


def table(rows: Sequence[Row]) -> str:
    lines = ["| policy | host share | / lru |", "|---|---|---|"]
    lines += [f"| {r.policy} | {100 * r.share:.2f} % | {versus_lru(r, rows)} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="synthetic", help="synthetic, conversation or a path (default synthetic)")
    parser.add_argument(
        "--capacity", type=float, default=0.02, help="host, as a share of the distinct blocks (default 0.02)"
    )
    parser.add_argument("--requests", type=int, default=None, help="simulate only the first N requests")
    args = parser.parse_args(argv)
    if not 0 < args.capacity <= 1:
        parser.error(f"--capacity must be a share in (0, 1], not {args.capacity}")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be at least 1, not {args.requests}")
    if not path_of(args.trace).is_file():
        parser.error(f"no trace {args.trace!r}: name one of {', '.join(NAMES)} or a file")
    try:
        rows = run(args.trace, args.capacity, args.requests)
    except (ValueError, KeyError, TypeError) as error:  # not a trace of this format
        parser.error(f"cannot read trace {args.trace!r}: {error!r}")
    print(f"trace {args.trace}: {rows[0].reads} block reads, host {args.capacity:.0%} of its distinct blocks")
    print(table(rows))
    lru = next(r for r in rows if r.policy == "lru").share
    online = [r for r in rows if r.policy not in ("count oracle", "belady")]
    best = max(online, key=lambda r: r.share)
    print(
        f"1.5x lru: {150 * lru:.2f} %; best online policy: {best.policy}, {100 * best.share:.2f} % "
        f"({versus_lru(best, rows)} lru)"
    )
    rerun = sys.argv[1:] if argv is None else list(argv)
    print("rerun: PYTHONPATH=. .venv/bin/python benchmarks/policies.py " + " ".join(rerun))


if __name__ == "__main__":
    main()
