"""The remote tier's copies of pages (:mod:`dss.tiers.remote`, a Redis the fleet shares), as
the page store writes, drops and reads them.

* **Write-through.** After a transaction committed, the pages it recorded are queued for the
  remote tier sealed exactly as on disk (the written segments' pages carry their stored bytes),
  under keys made from the namespace's tag: they reach Redis asynchronously, after they are
  durable here.
* **Drops.** The keys of pages a transaction removed from every tier (a deleted session's,
  quarantined ones) are queued for deletion. Pages a full disk evicted keep their keys, for
  Redis's own eviction to take.
* **Reads.** The pages the catalog holds on another node's disk only are fetched in one round
  trip; each value is verified (format, checksum, authentication under the owner's key), and
  anything else is a miss. The caller promotes what comes back.

A namespace whose data key is destroyed has no tag: nothing of it is written, dropped or read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dss.catalog.change import Applied, WrittenSegment
from dss.catalog.feed import Event, PagesDropped
from dss.core.crypto import SealError
from dss.core.errors import ErasureInProgress
from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.pages.index import PageEntry, PageIndex
from dss.pages.keys import DataKeys, remote_tag
from dss.tiers.remote import RemoteTier, key_of, pack_value, unpack_value
from dss.tiers.segment import SEALED_FLAG

log = logging.getLogger("dss.pages.copies")


class RemoteCopies:
    """The remote tier's copies of this store's pages (see the module docstring)."""

    def __init__(self, remote: RemoteTier, keys: DataKeys, index: PageIndex) -> None:
        self.remote = remote
        self.keys = keys
        self.index = index

    def write_through(self, applied: Applied, written: Sequence[WrittenSegment]) -> None:
        """Queue the pages the transaction recorded (``applied.stored``) of its segment files
        ``written`` for the remote tier, sealed as on disk."""
        owner = {r.page_id: r.user_ref for r in applied.stored}
        tags = {user_ref: self.tag(user_ref) for user_ref in set(owner.values())}
        items = []
        for page in (p for segment in written for p, _, _ in segment.pages):
            tag = tags.get(owner.get(page.page_id, -1))
            if tag is not None and page.stored:
                items.append(
                    (key_of(self.remote.prefix, tag, page.page_id), pack_value(page.checksum, page.flags, page.stored))
                )
        self.remote.put(items)

    def drop(self, events: Sequence[Event]) -> None:
        """Queue the deletion of the remote keys of the pages ``events`` say are gone from every tier."""
        keys = []
        for event in events:
            if isinstance(event, PagesDropped) and (tag := self.tag(event.user_ref)) is not None:
                keys += [key_of(self.remote.prefix, tag, page_id) for page_id in event.page_ids]
        self.remote.drop(keys)

    def tag(self, user_ref: int) -> bytes | None:
        """The remote tier's tag of a namespace (``None`` once its key is destroyed)."""
        try:
            return remote_tag(self.keys.of(user_ref).hash_key)
        except ErasureInProgress:
            return None

    def fetch(
        self, ids: Sequence[PageId], out: Sequence[bytes | memoryview | None]
    ) -> list[tuple[int, PageEntry, bytes]]:
        """``(i, entry, payload)`` of the pages ``ids[i]`` that ``out`` misses and the catalog
        holds on another node's disk only, as the remote tier has them, verified: one round trip."""
        entries = self.index.entries
        wanted = []
        for i, value in enumerate(out):
            entry = entries.get(ids[i]) if value is None else None
            if entry is not None and entry.disk is None and entry.is_durable:
                tag = self.tag(entry.namespace.user_ref)
                if tag is not None:
                    wanted.append((i, entry, key_of(self.remote.prefix, tag, entry.page_id)))
        if not wanted:
            return []
        found = []
        for (i, entry, _), raw in zip(wanted, self.remote.get([key for _, _, key in wanted])):
            if raw is None:
                continue
            data = self._opened(entry, raw)
            if data is None:
                self.remote.count_error("verify")
                log.warning("a remote-tier record failed verification: treated as a miss")
                continue
            found.append((i, entry, data))
        return found

    def _opened(self, entry: PageEntry, raw: bytes) -> bytes | None:
        """The payload of a remote record if it is the page's (format, checksum, authentication)."""
        parts = unpack_value(raw)
        if parts is None:
            return None
        stored_sum, flags, stored = parts
        if stored_sum != entry.checksum or checksum(stored) != stored_sum:
            return None
        if not flags & SEALED_FLAG:
            return stored if len(stored) == entry.size else None
        sealer = self.keys.sealer_of(entry.namespace.user_ref)
        if sealer is None:
            return None
        try:
            data = sealer.open(stored, entry.page_id)
        except SealError:
            return None
        return data if len(data) == entry.size else None
