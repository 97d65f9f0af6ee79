"""Pages read back verified: from the host tier, then this node's disk, then — for the pages
the catalog holds on another node's disk only — the remote tier, in one round trip.

What comes back verified is promoted to host as the policy says (:mod:`dss.pages.host`).
Reads return ``None`` for a page no tier holds, and list the pages whose bytes fail
verification, for the store to quarantine. A sealed page whose key is gone is a miss.

With ``into`` (one writable buffer per page, each exactly the page's size) a read puts each
payload in its buffer — a sealed page decrypted straight into it, a host copy copied once —
and returns the buffers, so a caller that stages pages (an engine's load) gets no
intermediate ``bytes`` per page. With ``ready`` as well, the caller hears which buffers are
filled, verified, as they are (the host's hits first, then each disk read's, then the remote
tier's), so it can start moving them while the rest are read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from dss.catalog import pages
from dss.catalog.change import Quarantined
from dss.catalog.database import Catalog
from dss.core.crypto import OVERHEAD, SealError
from dss.core.errors import InvalidInput
from dss.core.types import PageId
from dss.pages.copies import RemoteCopies
from dss.pages.host import HostPages
from dss.pages.index import PageEntry, PageIndex
from dss.pages.keys import DataKeys
from dss.placement.policy import Placement
from dss.tiers.base import ReadFailure, ReadRequest, StoredPage
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.segment import SEALED_FLAG

log = logging.getLogger("dss.pages.reader")


class Read(NamedTuple):
    """Payloads in request order (``None``: no tier holds valid bytes), and the pages whose
    bytes failed verification (to quarantine)."""

    payloads: list[bytes | memoryview | None]
    """With ``into``: ``into[i]`` for each page read."""
    bad: list[Quarantined]


Ready = Callable[[list[int]], object]
"""Told the indexes (in request order) of pages whose ``into`` buffers now hold their verified
payloads; each page that is read is told once, in the reading thread, before the read returns."""


class PageReader:
    """Reads pages across the tiers for one store. Not thread-safe; the store locks."""

    def __init__(
        self,
        catalog: Catalog,
        disk: DiskTier,
        hosted: HostPages,
        keys: DataKeys,
        *,
        node_ref: int,
        copies: RemoteCopies | None = None,
    ) -> None:
        self.catalog = catalog
        self.disk = disk
        self.hosted = hosted
        self.host: HostTier = hosted.host
        self.placement: Placement = hosted.placement
        self.index: PageIndex = hosted.index
        self.keys = keys
        self.node_ref = node_ref
        self.copies = copies

    def read(
        self,
        ids: Sequence[PageId],
        *,
        load: bool = True,
        prefetch: bool = False,
        into: Sequence[memoryview] | None = None,
        ready: Ready | None = None,
    ) -> Read:
        """Payloads in order, verified; see ``Store.read_pages``. A sealed page whose key is
        gone is a miss; a page whose bytes fail verification is a miss and listed in ``bad``.
        Pages read from disk go to host when ``load`` (an engine waits for them), when
        ``prefetch`` (moved up ahead of a load), or when the policy says so. ``into`` and
        ``ready`` (only with ``into``): see the module docstring; ``InvalidInput`` (nothing
        read) when a buffer's size is not its page's."""
        placement = self.placement
        tell = ready if into is not None and ready is not None else _told_nothing
        with placement.hold(ids):
            return self._read(ids, load, prefetch, into, tell)

    def _read(
        self, ids: Sequence[PageId], load: bool, prefetch: bool, into: Sequence[memoryview] | None, tell: Ready
    ) -> Read:
        placement = self.placement
        now = placement.now()
        out: list[bytes | memoryview | None] = list(self.host.get_many(ids))
        entries = self.index.entries
        unknown = [ids[i] for i, v in enumerate(out) if v is None and ids[i] not in entries]
        if unknown:
            self._learn(unknown)
        if into is not None:
            _check_into(ids, out, into, entries)
            for i, v in enumerate(out):
                if v is not None:
                    into[i][:] = v
                    out[i] = into[i]
        hits = [ids[i] for i, v in enumerate(out) if v is not None]
        if hits:
            tell([i for i, v in enumerate(out) if v is not None])
        if not prefetch:
            placement.touch(ids, now)
            placement.count("host", "hits", len(hits))
            placement.prefetch_used(hits)
        wanted = [
            (i, entries[ids[i]])
            for i, v in enumerate(out)
            if v is None and ids[i] in entries and entries[ids[i]].disk is not None
        ]
        failures = self._read_disk(wanted, out, into, tell, load=load, prefetch=prefetch, now=now)
        if not prefetch:
            placement.count("host", "misses", len(ids) - len(hits))
            placement.count("disk", "hits", sum(1 for i, _ in wanted if out[i] is not None))
            placement.count("disk", "misses", sum(v is None for v in out))
        if self.copies is not None:
            self._read_remote(ids, out, into, tell)
        return Read(out, [_quarantined(wanted[f.index][1], f.reason) for f in failures])

    def _read_disk(
        self,
        wanted: list[tuple[int, PageEntry]],
        out: list[bytes | memoryview | None],
        into: Sequence[memoryview] | None,
        tell: Ready,
        *,
        load: bool,
        prefetch: bool,
        now: float,
    ) -> list[ReadFailure]:
        """Fill ``out[i]`` (``into[i]`` if given) for each ``(i, entry)`` of ``wanted`` from this
        node's disk, verified, promoting what the policy says, telling each read's pages;
        returns the records that failed verification."""
        requests = [ReadRequest.at(entry.disk, entry.page_id, entry.checksum) for _, entry in wanted if entry.disk]
        failures: list[ReadFailure] = []
        for chunk in self.disk.read_chunks(requests, sealed_verified_by_caller=True, transient=True):
            failures.extend(chunk.failures)
            filled = []
            for j, record in chunk.records:
                i, entry = wanted[j]
                data = self._opened(entry, record, requests[j], None if into is None else into[i])
                if isinstance(data, str):
                    failures.append(ReadFailure(j, data))
                elif data is not None:
                    out[i] = data
                    filled.append(i)
                    self._promoted(entry, data, load=load, prefetch=prefetch, now=now)
                    entry.namespace.bump()
            if filled:
                tell(filled)
        return failures

    def _opened(
        self, entry: PageEntry, record: StoredPage, request: ReadRequest, target: memoryview | None
    ) -> bytes | memoryview | str | None:
        """The payload of a record read back — its bytes, or ``target`` holding them — why it
        fails verification, or ``None`` when it is sealed under a key that is gone (a miss)."""
        sealed = bool(record.flags & SEALED_FLAG)
        where = f"record at {request.segment}:{request.offset}"
        if len(record.payload) != entry.size + (OVERHEAD if sealed else 0):  # a flipped flag, say
            return f"{where} has the wrong length for its flags"
        if not sealed:
            if target is None:
                return bytes(record.payload)
            target[:] = record.payload
            return target
        sealer = self.keys.sealer_of(entry.namespace.user_ref)
        if sealer is None:
            return None
        try:
            if target is None:
                return sealer.open(record.payload, entry.page_id)
            return sealer.open_into(record.payload, entry.page_id, target)
        except SealError:
            return f"{where} fails authentication"

    def _promoted(self, entry: PageEntry, data: bytes | memoryview, *, load: bool, prefetch: bool, now: float) -> None:
        """Put a page read from disk in host when it is prefetched or the policy says so (a
        copy of it, when it lies in the caller's buffer; none when it cannot fit)."""
        placement = self.placement
        if len(data) > self.host.capacity_bytes:
            return
        promote = prefetch or placement.should_promote(entry.page_id, load=load, now=now)
        if promote and self.hosted.put(entry.page_id, bytes(data), entry.namespace, compete=not prefetch):
            placement.count("host", "promotions")
            placement.count("host", "moved_bytes", len(data))
            placement.count("disk", "moved_bytes", len(data))
            if prefetch:
                placement.prefetch_issued(entry.page_id, now)

    def _read_remote(
        self,
        ids: Sequence[PageId],
        out: list[bytes | memoryview | None],
        into: Sequence[memoryview] | None,
        tell: Ready,
    ) -> None:
        """Fill ``out`` (``into`` if given) from the remote tier
        (:meth:`dss.pages.copies.RemoteCopies.fetch`), telling the pages filled, and promote
        what came back to host."""
        assert self.copies is not None
        filled = []
        for i, entry, data in self.copies.fetch(ids, out):
            if into is not None and len(into[i]) == len(data):
                into[i][:] = data
                out[i] = into[i]
                filled.append(i)
            elif into is None:
                out[i] = data
            else:
                continue  # the catalog's size was checked; a record of another size is a miss
            if self.hosted.put(entry.page_id, data, entry.namespace):
                self.placement.count("host", "promotions")
                self.placement.count("host", "moved_bytes", len(data))
            entry.namespace.bump()
        if filled:
            tell(filled)

    def tenants(self, ids: Sequence[PageId]) -> list[str | None]:
        """For each page id, the tenant of the namespace holding it as far as this process
        knows (``None``: an unknown page)."""
        entries = self.index.entries
        unknown = [page_id for page_id in ids if page_id not in entries]
        if unknown:
            self._learn(unknown)
        owner = self.hosted.owner
        return [owner(entries[page_id].namespace)[0] if page_id in entries else None for page_id in ids]

    def _learn(self, page_ids: list[PageId]) -> None:
        """Load catalog rows of pages this process has not seen (another process wrote them)."""
        with self.catalog.read() as conn:
            found = pages.pages_by_id(conn, page_ids, self.node_ref)
        for record in found:
            self.index.apply(self.index.namespace(record.user_ref), [record])


def _told_nothing(indexes: list[int]) -> object:
    """The :data:`Ready` of a read that tells no one."""


def _check_into(
    ids: Sequence[PageId],
    out: Sequence[bytes | memoryview | None],
    into: Sequence[memoryview],
    entries: dict[PageId, PageEntry],
) -> None:
    """``InvalidInput`` unless ``into`` has one buffer per page, each of the page's size (where
    this process knows it: from host or the catalog)."""
    if len(into) != len(ids):
        raise InvalidInput(f"into has {len(into)} buffers for {len(ids)} pages")
    for i, page_id in enumerate(ids):
        known = out[i]
        size = len(known) if known is not None else entries[page_id].size if page_id in entries else None
        if size is not None and len(into[i]) != size:
            raise InvalidInput(f"buffer {i} has {len(into[i])} bytes; its page has {size}")


def _quarantined(entry: PageEntry, reason: str) -> Quarantined:
    """A page whose bytes on disk failed verification, to quarantine (logged without its id:
    logs outlive erasures)."""
    assert entry.disk is not None
    log.error("quarantined a page: %s", reason)
    return Quarantined(entry.page_id, entry.namespace.user_ref, entry.disk.segment, entry.disk.offset, reason)
