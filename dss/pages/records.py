"""How a write's new pages become records of segment files: their sizes, their split into
files of at most ``segment_bytes``, and their sealing, page by page as
:meth:`dss.tiers.disk.DiskTier.write` asks for the next record, into reused buffers."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from dss.catalog.change import NewPage
from dss.core.crypto import OVERHEAD, Sealer
from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.tiers.segment import HEADER_BYTES, IO_PAGES, RECORD, SEALED_FLAG


def segment_size(fresh: Sequence[NewPage]) -> int:
    """Bytes of one segment file holding these pages."""
    return HEADER_BYTES + sum(record_size(p) for p in fresh)


def record_size(page: NewPage) -> int:
    """Bytes a page's record takes in a segment (sealed ones grow by the nonce and tag)."""
    assert page.stored is not None
    return RECORD.size + len(page.stored) + (OVERHEAD if page.flags & SEALED_FLAG else 0)


def batches(fresh: Sequence[NewPage], segment_bytes: int) -> list[list[NewPage]]:
    """Split pages into batches whose segment stays within ``segment_bytes``."""
    out: list[list[NewPage]] = [[]]
    size = HEADER_BYTES
    for page in fresh:
        grow = record_size(page)
        if out[-1] and size + grow > segment_bytes:
            out.append([])
            size = HEADER_BYTES
        out[-1].append(page)
        size += grow
    return [b for b in out if b]


class SealRing:
    """Buffers pages are sealed into on their way to disk, reused round-robin so their memory
    is not faulted in afresh for every page. :meth:`DiskTier.write` has at most two batches of
    :data:`IO_PAGES` records in hand (one being written, one being filled), so a ring of twice
    that many never hands out a buffer still in use. One write at a time holds the ring."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buffers: list[bytearray | None] = [None] * (2 * IO_PAGES)
        self._next = 0

    def seal(self, sealer: Sealer, payload: bytes, aad: bytes) -> bytearray:
        k = self._next
        self._next = (k + 1) % len(self._buffers)
        blob = self._buffers[k] = sealer.seal_into(payload, aad, self._buffers[k])
        return blob


def records(
    batch: Sequence[NewPage], sealer: Sealer | None, ring: SealRing | None, done: list[NewPage], keep: bool = False
) -> Iterator[tuple[PageId, int, Any, int]]:
    """The records of ``batch`` for :meth:`DiskTier.write`, sealed one by one as the tier asks
    for them (into ``ring``'s buffers if given); each page, with its checksum, is appended to
    ``done`` (its sealed bytes are on disk once the write returned: ``stored`` is emptied,
    unless ``keep``, when it is a copy of them — for the remote tier's write-through)."""
    for page in batch:
        stored: bytes | bytearray | memoryview | None = page.stored
        assert stored is not None
        if page.flags & SEALED_FLAG:
            assert sealer is not None
            stored = (
                ring.seal(sealer, page.payload, page.page_id)
                if ring is not None
                else sealer.seal_into(page.payload, page.page_id)
            )
            page = page._replace(stored=bytes(stored) if keep else b"", checksum=checksum(stored))
        done.append(page)
        yield page.page_id, page.checksum, stored, page.flags
