"""What every tier offers.

A tier holds page payloads as opaque bytes. Tiers know nothing of sessions, namespaces or
the catalog: the store decides what goes where (placement) and records durable locations
in the catalog. Two kinds exist:

* a **cache tier** (``host``, later ``device``) holds payloads by page id in this
  process's memory; it is bounded in bytes and evicts by itself;
* a **durable tier** (``disk``, later ``remote``) writes batches of pages as one unit
  (a segment) and returns where each page landed; the store records those locations
  in the same catalog transaction as the commit that made them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from dss.core.types import PageId


class Located(NamedTuple):
    """Where a durable tier put one page: segment, byte offset and length of its record."""

    segment: str
    offset: int
    length: int


class ReadRequest(NamedTuple):
    """One page to read from a durable tier, with what its record must contain."""

    segment: str
    offset: int
    length: int
    page_id: PageId
    checksum: int

    @classmethod
    def at(cls, where: Located, page_id: PageId, checksum: int) -> ReadRequest:
        """The request for page ``page_id``, stored ``where``."""
        return cls(where.segment, where.offset, where.length, page_id, checksum)


class StoredPage(NamedTuple):
    """A page read back from a durable tier: its stored payload and its record's flags."""

    payload: memoryview
    flags: int


class ReadFailure(NamedTuple):
    """A page a durable tier could not return: its position in the request and why."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index
    reason: str


class CacheTier(ABC):
    """A tier holding payloads by page id in this process's memory, bounded in bytes; it
    evicts by itself. Reads and writes change only the tier (and its recency order)."""

    name: str
    capacity_bytes: int
    used_bytes: int

    @abstractmethod
    def get_many(self, page_ids: Sequence[PageId]) -> list[bytes | None]:
        """Payloads in order, ``None`` where absent; marks the found ones recently used."""
        ...

    @abstractmethod
    def put(self, page_id: PageId, payload: bytes) -> list[PageId] | None:
        """Store a payload; return the ids evicted to make room, or ``None`` if it cannot fit."""
        ...

    @abstractmethod
    def discard(self, page_ids: Iterable[PageId]) -> int:
        """Drop these pages if present; return the bytes freed. Never raises for absent ids."""
        ...

    @abstractmethod
    def __contains__(self, page_id: object) -> bool: ...


class DurableTier(ABC):
    """A tier that writes batches of pages as one unit (a segment) and says where each page
    landed; the store records those locations in the catalog transaction that uses them."""

    name: str

    @abstractmethod
    def write(self, pages: Iterable[tuple[PageId, int, bytes, int]]) -> tuple[str, int, list[Located]]:
        """Publish ``(page_id, checksum, payload, flags)`` records atomically as one new segment
        (``pages`` may be produced lazily, as the tier asks for them).

        Returns ``(segment, size, locations)``. When it returns, the segment is durable;
        when it raises, nothing is visible.
        """
        ...

    @abstractmethod
    def read(self, requests: Sequence[ReadRequest]) -> tuple[list[StoredPage | None], list[ReadFailure]]:
        """Records in request order, verified against id and checksum; ``None`` plus a
        failure for each record that is missing, torn or corrupt. Batches its I/O."""
        ...

    @abstractmethod
    def remove(self, segments: Iterable[str]) -> None:
        """Delete segments; absent ones are ignored."""
        ...
