"""Placement policy: which pages go where, and what leaves a full tier.

This is the small first policy; the store asks it and carries out its decisions.

* New pages go to host and disk.
* Host: least recently used pages leave first (they stay on disk) — the host tier does this
  itself.
* Disk: when a write would overflow the tier, whole segments are dropped, oldest first by
  the newest version that holds any of their pages (so pages only old versions hold go
  before pages of recent ones), never a segment holding a page of a pinned version. The
  tier is emptied to ``1 - SLACK`` of its capacity so eviction does not run at every write.
  Dropping pages never drops dialogue state: versions keep their tokens.

Pure functions of plain values; nothing here reads or writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from dss.catalog.pages import SegmentRow

SLACK = 0.05
"""Fraction of a durable tier's capacity freed beyond what a write needs."""


def room_needed(used: int, need: int, capacity: int) -> int:
    """Bytes to free so ``need`` more fit (0 when they fit already)."""
    if used + need <= capacity:
        return 0
    return used + need - int(capacity * (1 - SLACK))


def victims(segments: Iterable[SegmentRow], to_free: int) -> list[SegmentRow]:
    """Segments to drop, in the order given (oldest first), skipping pinned ones, until
    ``to_free`` bytes are freed. Returns fewer than needed when the others do not suffice."""
    chosen: list[SegmentRow] = []
    freed = 0
    for segment in segments:
        if freed >= to_free:
            break
        if segment.is_pinned:
            continue
        chosen.append(segment)
        freed += segment.size
    return chosen
