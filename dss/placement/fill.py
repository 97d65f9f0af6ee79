"""How full a tier may get: its watermarks, the room a write needs, and the segments that
leave to make it. Pure functions of plain values (settings, bytes, segment rows)."""

from __future__ import annotations

from collections.abc import Iterable

from dss.catalog.segments import SegmentRow
from dss.placement.stats import Settings

SLACK = 0.05
"""Fraction of a durable tier's capacity freed beyond what a write needs (inline eviction)."""


def watermarks(settings: Settings, tier: str, capacity: int) -> tuple[int, int]:
    """``(high, low)`` marks of a tier in bytes."""
    if tier == "host":
        return round(capacity * settings.host_high), round(capacity * settings.host_low)
    return round(capacity * settings.disk_high), round(capacity * settings.disk_low)


def room_needed(used: int, need: int, capacity: int) -> int:
    """Bytes to free so ``need`` more fit (0 when they fit already)."""
    if used + need <= capacity:
        return 0
    return used + need - int(capacity * (1 - SLACK))


def victims(segments: Iterable[SegmentRow], to_free: int) -> list[SegmentRow]:
    """Segments to drop, in the order given, skipping pinned ones, until ``to_free`` bytes are
    freed. Returns fewer than needed when the others do not suffice."""
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
