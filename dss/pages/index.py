"""What this process knows of every page: size, checksum, durable location, host presence.

Pages are grouped by namespace. Each namespace has a generation number that moves on
whenever one of its pages appears, moves between tiers or goes; trie nodes cache their
pages' tier codes per generation (see :meth:`dss.sessions.trie.Trie.available`), so a resume pays
per-page lookups only after something changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterable

from dss.catalog.pages import PageRecord
from dss.core.packing import encoding_of
from dss.core.precision import EXACT
from dss.core.types import TIER_CODE, PageId
from dss.tiers.base import Located
from dss.tiers.host import HostTier

DEVICE = TIER_CODE["device"]
HOST = TIER_CODE["host"]
DISK = TIER_CODE["disk"]
REMOTE = TIER_CODE["remote"]


_generations = itertools.count(1)


class NamespacePages:
    """The pages of one namespace (one user of one tenant) known to this process.

    ``gen`` values are unique across every namespace object ever made, so a cache keyed
    by a generation can never be mistaken for one of a reloaded namespace.
    """

    __slots__ = ("gen", "loaded", "tenant_id", "user_ref")

    def __init__(self, user_ref: int) -> None:
        self.user_ref = user_ref
        self.gen = next(_generations)
        self.loaded = False
        self.tenant_id: str | None = None
        """The namespace's tenant, once looked up (:meth:`dss.pages.host.HostPages.owner`)."""

    def bump(self) -> None:
        """Something about one of the namespace's pages changed."""
        self.gen = next(_generations)


class PageEntry:
    """One page: where its bytes are durable on this node (``disk``), whether the catalog
    holds it (``is_durable``: some node's disk does, so the remote tier may too), what its
    stored bytes must hash to, and the precision of that durable copy (``encoding``)."""

    __slots__ = ("checksum", "disk", "encoding", "is_durable", "namespace", "page_id", "page_index", "size")

    def __init__(
        self,
        page_id: PageId,
        namespace: NamespacePages,
        page_index: int,
        size: int,
        checksum: int,
        disk: Located | None,
        is_durable: bool = True,
        encoding: str = EXACT,
    ) -> None:
        self.page_id = page_id
        self.namespace = namespace
        self.page_index = page_index
        self.size = size
        self.checksum = checksum
        self.disk = disk
        self.is_durable = is_durable
        self.encoding = encoding


class PageIndex:
    """Every page entry of this process, keyed by page id (ids never collide across namespaces)."""

    def __init__(self, host: HostTier, *, has_remote: bool = False, resident: Container[PageId] = frozenset()) -> None:
        """``has_remote``: the store has a remote tier; ``resident``: the pages some engine holds
        in its own memory (the device tier)."""
        self.host = host
        self.has_remote = has_remote
        self.entries: dict[PageId, PageEntry] = {}
        self.namespaces: dict[int, NamespacePages] = {}
        self.code_of = self._make_code_of(resident)
        self.has_lossy = False
        """Whether some copy this process knows of is lossy (else no resume looks for one)."""

    def _make_code_of(self, resident: Container[PageId]) -> Callable[[PageId], int]:
        host, entries = self.host, self.entries
        if not self.has_remote:

            def local_code_of(page_id: PageId) -> int:
                """The fastest tier holding the page (0: none); ``device`` only for a page that
                host or disk holds too (no other engine could load it otherwise)."""
                if page_id in host:
                    return DEVICE if page_id in resident else HOST
                entry = entries.get(page_id)
                if entry is not None and entry.disk is not None:
                    return DEVICE if page_id in resident else DISK
                return 0

            return local_code_of

        def code_of(page_id: PageId) -> int:
            """As above; a page the catalog holds on another node's disk only is on the remote
            tier (a miss there is found when it is read)."""
            if page_id in host:
                return DEVICE if page_id in resident else HOST
            entry = entries.get(page_id)
            if entry is None:
                return 0
            if entry.disk is not None:
                return DEVICE if page_id in resident else DISK
            return REMOTE if entry.is_durable else 0

        return code_of

    def encodings(self, page_ids: Iterable[PageId], page_tokens: int) -> dict[str, int]:
        """Tokens per lossy encoding among these pages, as the copy a read would serve holds
        them (host's, else the durable one's); empty when every one is exact. Does not change
        the host tier's recency."""
        if not self.has_lossy:
            return {}
        out: dict[str, int] = {}
        entries, host = self.entries, self.host
        for page_id in page_ids:
            payload = host.peek(page_id)
            entry = entries.get(page_id) if payload is None else None
            encoding = encoding_of(payload) if payload is not None else entry.encoding if entry is not None else EXACT
            if encoding != EXACT:
                out[encoding] = out.get(encoding, 0) + page_tokens
        return out

    def bump_all(self) -> None:
        """Something about pages of every namespace changed (what engines hold)."""
        for namespace in self.namespaces.values():
            namespace.bump()

    def namespace(self, user_ref: int) -> NamespacePages:
        namespace = self.namespaces.get(user_ref)
        if namespace is None:
            namespace = self.namespaces[user_ref] = NamespacePages(user_ref)
        return namespace

    def apply(self, namespace: NamespacePages, records: Iterable[PageRecord]) -> None:
        """Install or replace entries from catalog rows of namespace ``namespace``."""
        for r in records:
            disk = Located(r.segment, r.offset, r.length) if r.segment else None
            self.entries[PageId(r.page_id)] = PageEntry(
                PageId(r.page_id), namespace, r.page_index, r.size, r.checksum, disk, encoding=r.encoding
            )
            if r.encoding != EXACT:
                self.has_lossy = True
        namespace.bump()

    def add(self, entry: PageEntry) -> None:
        self.entries[entry.page_id] = entry
        self.has_lossy = self.has_lossy or entry.encoding != EXACT
        entry.namespace.bump()

    def forget(self, page_ids: Iterable[PageId]) -> None:
        """Drop the entries (and host copies) of pages that are gone from every durable tier."""
        for page_id in page_ids:
            entry = self.entries.pop(page_id, None)
            if entry is not None:
                entry.namespace.bump()
        self.host.discard(page_ids)

    def lose_durable(self, page_ids: Iterable[PageId]) -> None:
        """These pages left the durable tiers; keep host copies (still readable here)."""
        for page_id in page_ids:
            entry = self.entries.get(page_id)
            if entry is None:
                continue
            if page_id in self.host:
                entry.disk = None
                entry.is_durable = False
                entry.namespace.bump()
            else:
                del self.entries[page_id]
                entry.namespace.bump()

    def left_host(self, page_ids: Iterable[PageId]) -> None:
        """These pages were evicted from host; entries of pages with no durable copy go."""
        for page_id in page_ids:
            entry = self.entries.get(page_id)
            if entry is None:
                continue
            entry.namespace.bump()
            if entry.disk is None and not (entry.is_durable and self.has_remote):
                del self.entries[page_id]

    def drop_namespace(self, user_ref: int) -> None:
        """Forget everything cached of a namespace (it will reload from the catalog)."""
        namespace = self.namespaces.pop(user_ref, None)
        if namespace is None:
            return
        namespace.bump()
        gone = [pid for pid, e in self.entries.items() if e.namespace is namespace]
        for page_id in gone:
            del self.entries[page_id]
        self.host.discard(gone)
