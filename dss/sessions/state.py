"""A session as this process holds it: its catalog record, versions, trie and held pages.

A :class:`SessionState` is a cache of catalog rows. :class:`dss.sessions.mirror.Mirror` builds it from
the catalog, updates it in place with this process's own writes, and drops it when another
process changed the session (the feed says so). It does no I/O.

A writer may build a change from a state without the store's lock (an *optimistic* build,
:meth:`dss.writes.writer.Writer.write`): :attr:`SessionState.generation` is odd while the mirror
changes the state in place and moves on by two each time, so a reader that sees the same even
generation before and after reading it read no half-made change.
"""

from __future__ import annotations

from typing import Any

from dss.catalog.sessions import SessionRecord, VersionRecord
from dss.core.errors import UnknownVersion
from dss.core.hashing import chain_ids, chain_root
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import Layout, PageId, Session, Version, VersionId
from dss.core.validate import check_version_id
from dss.pages.index import NamespacePages
from dss.sessions.trie import Match, Position, Trie


class SessionState:
    """One session: its versions, the trie of their tokens, the pages it holds."""

    __slots__ = ("generation", "held", "key", "namespace", "positions", "record", "trie", "versions")

    def __init__(
        self,
        record: SessionRecord,
        key: bytes,
        namespace: NamespacePages,
        versions: list[VersionRecord],
        held: dict[bytes, int],
    ) -> None:
        self.record = record
        self.generation = 0
        """Even while the state is unchanging; odd while the mirror changes it in place."""
        self.key = key
        """The namespace's page-id hashing key."""
        self.namespace = namespace
        layout = record.layout
        page_tokens = layout.page_tokens

        def page_ids(prev: PageId, buf: bytes, first: int, count: int) -> list[PageId]:
            return chain_ids(key, prev, buf, first, count, page_tokens)

        self.trie = Trie(page_tokens, chain_root(key, layout.digest), page_ids)
        self.versions: dict[int, VersionRecord] = {}
        self.positions: dict[int, Position] = {}
        self.held: dict[bytes, int] = held
        """Pages the session holds, each with the newest of its versions holding it (0: saved ahead)."""
        packed: dict[int, bytes] = {}
        for version in versions:
            base = packed.get(version.base_id, b"") if version.base_id is not None else b""
            buf = base[: TOKEN_BYTES * version.base_len] + version.suffix
            packed[version.version_id] = buf
            self.add(version, buf)

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def ref(self) -> int:
        return self.record.ref

    @property
    def user_ref(self) -> int:
        return self.record.user_ref

    @property
    def layout(self) -> Layout:
        return self.record.layout

    @property
    def head_id(self) -> int | None:
        return self.record.head_id

    @property
    def head(self) -> Position | None:
        return self.positions.get(self.head_id) if self.head_id is not None else None

    def add(self, version: VersionRecord, buf: bytes, walk: Match | None = None) -> Position:
        """Insert a committed version (its full packed tokens) into the trie; ``walk`` is where a
        walk of ``buf`` on this trie, unchanged since, ended (the insert then starts there)."""
        position = self.trie.insert(buf, VersionId(version.version_id), walk)
        self.versions[version.version_id] = version
        self.positions[version.version_id] = position
        return position

    def tokens(self, version_id: int) -> bytes:
        """The packed tokens of a version."""
        return self.trie.tokens_of(self.positions[version_id])

    def page_ids(self, version_id: int) -> list[PageId]:
        """Ids of every full page of a version, in order."""
        return self.trie.page_ids_of(self.positions[version_id])

    def prompt_page_ids(self, buf: bytes, walk: Match) -> list[PageId]:
        """Ids of every full page of a packed prompt, given the trie's ``walk`` of it: the trie's
        ids for the prefix it holds, chain hashes for the rest."""
        trie = self.trie
        page_tokens = trie.page_tokens
        ids: list[PageId] = []
        for node in walk.path:
            known = min(node.depth, walk.num_tokens) // page_tokens - node.start // page_tokens
            ids.extend(node.page_ids[: max(known, 0)])
        total = len(buf) // TOKEN_BYTES // page_tokens
        if len(ids) < total:
            prev = ids[-1] if ids else trie.root_id
            ids.extend(trie.chain(prev, buf, len(ids), total - len(ids)))
        return ids

    def pinned_pages(self) -> set[bytes]:
        """Every page a pinned version of the session contains."""
        return {p for vid, v in self.versions.items() if v.pinned for p in self.page_ids(vid)}

    def version_record(self, version_id: Any) -> VersionRecord:
        """The row of one of this session's versions; raises ``UnknownVersion`` (or
        ``InvalidInput`` for an id that is not an int)."""
        record = self.versions.get(check_version_id(version_id))
        if record is None:
            raise UnknownVersion(f"version {version_id} is not a version of session {self.session_id!r}")
        return record

    def info(self) -> Session:
        """The public view of the session."""
        return session_of(self.record, len(self.versions))

    def version(self, version_id: int) -> Version:
        record = self.versions[version_id]
        return Version(
            VersionId(record.version_id),
            self.session_id,
            VersionId(record.parent_id) if record.parent_id is not None else None,
            record.num_tokens,
            record.created_at,
            record.label,
            record.version_id == self.head_id,
            record.pinned,
        )


def session_of(record: SessionRecord, num_versions: int) -> Session:
    """The public view of a session row (whose id was opened)."""
    return Session(
        record.session_id,
        record.tenant_id,
        record.user_id,
        record.layout,
        VersionId(record.head_id) if record.head_id is not None else None,
        num_versions,
        record.created_at,
        record.last_access,
    )
