"""Placement policy: which pages go where, and what leaves a full tier.

This is the small first policy; the store calls it and carries out its decisions.

* New pages go to host and disk.
* Host: least recently used pages leave first (they stay on disk) — the host
  tier does this itself.
* Disk: when a write would overflow the tier, whole segments are dropped, oldest first by
  the newest version that contains any of their pages (so pages only old versions hold go
  before pages of recent ones), never a segment holding a page of a pinned version. The
  tier is emptied to ``1 - SLACK`` of its capacity so eviction does not run at every write.
  Dropping pages never drops dialogue state: versions keep their tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

SLACK = 0.05
"""Fraction of a durable tier's capacity freed beyond what a write needs."""


def room_needed(used: int, need: int, capacity: int) -> int:
    """Bytes to free so ``need`` more fit (0 when they fit already)."""
    if used + need <= capacity:
        return 0
    return used + need - int(capacity * (1 - SLACK))


def pick_segments(order: Iterable[tuple[int, str, int]], to_free: int,
                  is_protected: Callable[[int], bool]) -> list[tuple[int, str, int]]:
    """Segments to drop, in ``order``, skipping protected ones, until ``to_free`` bytes are freed.

    Returns fewer than needed when the unprotected segments do not suffice.
    """
    chosen: list[tuple[int, str, int]] = []
    freed = 0
    for segment in order:
        if freed >= to_free:
            break
        if is_protected(segment[0]):
            continue
        chosen.append(segment)
        freed += segment[2]
    return chosen
