"""The disk tier's inactive segments: kept in the order demoted, taken off when active again or
when the tier deletes their file."""

from __future__ import annotations

from pathlib import Path

from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.tiers.disk import DiskTier
from dss.tiers.inactive import InactiveSegment, InactiveSegments


def segment(name: str, size: int, tick: int = 0) -> InactiveSegment:
    return InactiveSegment(name, size, (PageId(name.encode() * 16),), tick)


def test_segments_stay_in_the_order_demoted_and_a_second_demotion_keeps_the_first_place() -> None:
    inactive = InactiveSegments()
    a, b, c = segment("a", 10), segment("b", 20), segment("c", 30)
    assert inactive.demote([b, a]) == 30
    assert inactive.demote([c, segment("b", 20, tick=9)]) == 30  # b was inactive already: it keeps its place
    assert inactive.names() == ["b", "a", "c"] and list(inactive) == [b, a, c]
    assert (inactive.bytes, len(inactive), "a" in inactive, "z" in inactive) == (60, 3, True, False)
    assert inactive.discard(["a", "z"]) == 10  # an absent name is ignored
    assert list(inactive) == [b, c] and inactive.bytes == 50
    assert inactive.discard(["b", "c"]) == 50 and inactive.bytes == 0 and len(inactive) == 0


def test_a_segment_the_tier_deletes_leaves_the_list(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    pages = [(PageId(bytes([i]) * 16), checksum(bytes([i]) * 100), bytes([i]) * 100, 0) for i in range(2)]
    first, size, _ = disk.write(pages[:1])
    second, _, _ = disk.write(pages[1:])
    disk.inactive.demote([InactiveSegment(first, size, (pages[0][0],), 0), InactiveSegment(second, size, (), 0)])
    disk.remove([first])
    assert disk.inactive.names() == [second] and disk.inactive.bytes == size
    disk.close()
