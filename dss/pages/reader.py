"""Pages read back verified: from the host tier, then this node's disk, then — for the pages
the catalog holds on another node's disk only — the remote tier, in one round trip.

What comes back verified is promoted to host as the policy says (:mod:`dss.pages.host`).
Reads return ``None`` for a page no tier holds, and list the pages whose bytes fail
verification, for the store to quarantine. A sealed page whose key is gone is a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from dss.catalog import pages
from dss.catalog.change import Quarantined
from dss.catalog.database import Catalog
from dss.core.crypto import OVERHEAD, SealError
from dss.core.types import PageId
from dss.pages.copies import RemoteCopies
from dss.pages.host import HostPages
from dss.pages.index import PageIndex
from dss.pages.keys import DataKeys
from dss.placement.policy import Placement
from dss.tiers.base import ReadFailure, ReadRequest
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.segment import SEALED_FLAG

log = logging.getLogger("dss.pages.reader")


class Read(NamedTuple):
    """Payloads in request order (``None``: no tier holds valid bytes), and the pages whose
    bytes failed verification (to quarantine)."""

    payloads: list[bytes | None]
    bad: list[Quarantined]


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

    def read(self, ids: Sequence[PageId], *, load: bool = True, prefetch: bool = False) -> Read:
        """Payloads in order, verified; see ``Store.read_pages``. A sealed page whose key is
        gone is a miss; a page whose bytes fail verification is a miss and listed in ``bad``.
        Pages read from disk go to host when ``load`` (an engine waits for them), when
        ``prefetch`` (moved up ahead of a load), or when the policy says so."""
        placement = self.placement
        with placement.hold(ids):
            return self._read(ids, load, prefetch)

    def _read(self, ids: Sequence[PageId], load: bool, prefetch: bool) -> Read:
        placement = self.placement
        now = placement.now()
        out = self.host.get_many(ids)
        if not prefetch:
            placement.touch(ids, now)
            hits = [ids[i] for i, v in enumerate(out) if v is not None]
            placement.count("host", "hits", len(hits))
            placement.prefetch_used(hits)
        entries = self.index.entries
        unknown = [ids[i] for i, v in enumerate(out) if v is None and ids[i] not in entries]
        if unknown:
            self._learn(unknown)
        wanted = [
            (i, entries[ids[i]])
            for i, v in enumerate(out)
            if v is None and ids[i] in entries and entries[ids[i]].disk is not None
        ]
        requests = [ReadRequest.at(entry.disk, entry.page_id, entry.checksum) for _, entry in wanted if entry.disk]
        failures: list[ReadFailure] = []
        for chunk in self.disk.read_chunks(requests, sealed_verified_by_caller=True, transient=True):
            failures.extend(chunk.failures)
            for j, record in chunk.records:
                i, entry = wanted[j]
                sealed = bool(record.flags & SEALED_FLAG)
                if len(record.payload) != entry.size + (OVERHEAD if sealed else 0):  # a flipped flag, say
                    failures.append(
                        ReadFailure(
                            j,
                            f"record at {requests[j].segment}:{requests[j].offset} has the wrong length for its flags",
                        )
                    )
                    continue
                if sealed:
                    sealer = self.keys.sealer_of(entry.namespace.user_ref)
                    if sealer is None:
                        continue
                    try:
                        data = sealer.open(record.payload, entry.page_id)
                    except SealError:
                        failures.append(
                            ReadFailure(j, f"record at {requests[j].segment}:{requests[j].offset} fails authentication")
                        )
                        continue
                else:
                    data = bytes(record.payload)
                out[i] = data
                promote = prefetch or placement.should_promote(entry.page_id, load=load, now=now)
                if promote and self.hosted.put(entry.page_id, data, entry.namespace, compete=not prefetch):
                    placement.count("host", "promotions")
                    placement.count("host", "moved_bytes", len(data))
                    placement.count("disk", "moved_bytes", len(data))
                    if prefetch:
                        placement.prefetch_issued(entry.page_id, now)
                entry.namespace.bump()
        if not prefetch:
            served = sum(1 for i, _ in wanted if out[i] is not None)
            placement.count("host", "misses", len(ids) - len(hits))
            placement.count("disk", "hits", served)
            placement.count("disk", "misses", sum(v is None for v in out))
        if self.copies is not None:
            self._read_remote(ids, out)
        bad = []
        for failure in failures:
            entry = wanted[failure.index][1]
            assert entry.disk is not None
            log.error("quarantined a page: %s", failure.reason)  # no page id: logs outlive erasures
            bad.append(
                Quarantined(
                    entry.page_id, entry.namespace.user_ref, entry.disk.segment, entry.disk.offset, failure.reason
                )
            )
        return Read(out, bad)

    def _read_remote(self, ids: Sequence[PageId], out: list[bytes | None]) -> None:
        """Fill ``out`` from the remote tier (:meth:`dss.pages.copies.RemoteCopies.fetch`) and promote
        what came back to host."""
        assert self.copies is not None
        for i, entry, data in self.copies.fetch(ids, out):
            out[i] = data
            if self.hosted.put(entry.page_id, data, entry.namespace):
                self.placement.count("host", "promotions")
                self.placement.count("host", "moved_bytes", len(data))
            entry.namespace.bump()

    def owners(self, ids: Sequence[PageId]) -> list[int | None]:
        """For each page id, the namespace holding it as far as this process knows (``None``: unknown)."""
        entries = self.index.entries
        unknown = [page_id for page_id in ids if page_id not in entries]
        if unknown:
            self._learn(unknown)
        return [entries[page_id].namespace.user_ref if page_id in entries else None for page_id in ids]

    def _learn(self, page_ids: list[PageId]) -> None:
        """Load catalog rows of pages this process has not seen (another process wrote them)."""
        with self.catalog.read() as conn:
            found = pages.pages_by_id(conn, page_ids, self.node_ref)
        for record in found:
            self.index.apply(self.index.namespace(record.user_ref), [record])
