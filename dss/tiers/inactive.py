"""The disk tier's inactive segments: those the mover demoted, still on disk and readable, that
leave first, in the order demoted, when a write needs their room.

The disk is the last tier, so a demotion from it is the decision that a segment goes when room is
needed, not a move: the file stays, its pages are read as before, and the room it takes is
reclaimed only by a write that needs it (in that write's catalog transaction, like any eviction).
So the room the mover makes below the low watermark is not left empty, and a foreground write
still finds its victims chosen and ordered. Like the host tier's inactive pages
(:mod:`dss.tiers.host`), this list is this process's memory: it stores what the mover tells it,
in order, and forgets a segment when the tier deletes its file; nothing about it is durable (a
reopened store's mover chooses again).

Each entry remembers the pages of its segment and the policy's access count (``tick``) when it
was demoted, so the policy can tell which were read since (those are active again: see
:meth:`dss.placement.policy.Placement.disk_reclaim`). Not thread-safe; the store locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from dss.core.types import PageId


class InactiveSegment(NamedTuple):
    """A segment the mover demoted: its file, its bytes, its pages, and the policy's access
    tick when it was demoted (a page accessed after that makes it active again)."""

    name: str
    size: int
    page_ids: tuple[PageId, ...]
    tick: int


class InactiveSegments:
    """The disk tier's inactive segments, first demoted first (see the module docstring)."""

    def __init__(self) -> None:
        self._segments: dict[str, InactiveSegment] = {}
        self.bytes = 0
        """Bytes of the inactive segments (what the disk's watermarks do not count)."""

    def __contains__(self, name: object) -> bool:
        return name in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[InactiveSegment]:
        """The inactive segments, first demoted first (do not change the list while iterating)."""
        return iter(self._segments.values())

    def demote(self, segments: Iterable[InactiveSegment]) -> int:
        """Make these segments inactive, in this order after those before; one already
        inactive keeps its place. Returns the bytes that became inactive."""
        moved = 0
        for segment in segments:
            if segment.name not in self._segments:
                self._segments[segment.name] = segment
                moved += segment.size
        self.bytes += moved
        return moved

    def discard(self, names: Iterable[str]) -> int:
        """These segments are active again, or gone (absent names are ignored); returns the
        bytes that stopped being inactive."""
        freed = 0
        for name in names:
            segment = self._segments.pop(name, None)
            if segment is not None:
                freed += segment.size
        self.bytes -= freed
        return freed

    def names(self) -> list[str]:
        """The inactive segments' names, first demoted first."""
        return list(self._segments)
