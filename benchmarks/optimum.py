"""Belady's offline optimum over a sequence of requests, each reading its pages in order: the
bound ``benchmarks/tiers.py`` compares the policies with.

The cache holds ``capacity`` pages; when it is full, the page whose next read is furthest away
leaves (the arriving one, if that is it). A page a request reads but the cache lacks is offered
to it (the store wrote it, or read it from a slower tier); a page never read again is never
kept. With ``prefix`` (prefix lookups, as a store serves them) only the leading run of cached
pages counts: a page past the first miss is recomputed, and offered like the rest. Without it
every cached page of a request counts (a host tier, whose misses a disk holding everything
serves, so prefixes never break).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


def belady(requests: Sequence[Sequence[Hashable]], capacity: int, *, prefix: bool) -> int:
    """How many page reads of ``requests`` Belady's optimum serves from a cache of ``capacity``
    pages (see the module docstring)."""
    inf = float("inf")
    nexts: dict[Hashable, list[int]] = {}  # every read's position, in one global order
    pos = 0
    for pages in requests:
        for p in pages:
            nexts.setdefault(p, []).append(pos)
            pos += 1
    for positions in nexts.values():
        positions.reverse()  # pop() gives the next read

    def next_read(p: Hashable) -> float:
        positions = nexts[p]
        return positions[-1] if positions else inf

    cache: set[Hashable] = set()
    heap: list[tuple[float, int, Hashable]] = []  # (-next read, tie, page): stale entries skipped
    tie = 0

    def offer(p: Hashable) -> None:
        nonlocal tie
        soon = next_read(p)
        if soon == inf:
            cache.discard(p)
            return
        if p not in cache and len(cache) >= capacity:
            while heap and (heap[0][2] not in cache or -heap[0][0] != next_read(heap[0][2])):
                heapq.heappop(heap)
            if not heap or -heap[0][0] <= soon:
                return  # every cached page is read sooner
            cache.discard(heapq.heappop(heap)[2])
        cache.add(p)
        tie += 1
        heapq.heappush(heap, (-soon, tie, p))

    hits = 0
    for pages in requests:
        broken = False
        for p in pages:
            nexts[p].pop()
            if p in cache and not broken:
                hits += 1
            else:
                broken = prefix
            offer(p)
    return hits
