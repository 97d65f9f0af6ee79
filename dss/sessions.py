"""A session as this process holds it: catalog record, versions, trie and page references.

A :class:`SessionState` is a cache of catalog rows; the store rebuilds it whenever another
process changed the session (the change feed says so) and updates it in place after its
own writes have committed.
"""

from __future__ import annotations

from typing import Any

from dss.errors import UnknownVersion
from dss.hashing import chain_ids, chain_root
from dss.pageindex import Namespace
from dss.records import SessionRecord, VersionRecord
from dss.trie import Position, Trie
from dss.types import PageId, Version, VersionId
from dss.validate import check_version_id


class SessionState:
    """One session: its versions, the trie of their tokens, the pages it references."""

    __slots__ = ("record", "key", "ns", "trie", "versions", "positions", "head_id", "refs")

    def __init__(self, record: SessionRecord, key: bytes, ns: Namespace, versions: list[VersionRecord],
                 refs: dict[bytes, int]) -> None:
        self.record = record
        self.key = key
        self.ns = ns
        layout = record.layout
        page_tokens = layout.page_tokens

        def page_ids(prev: PageId, buf: bytes, first: int, count: int) -> list[PageId]:
            return chain_ids(key, prev, buf, first, count, page_tokens)

        self.trie = Trie(page_tokens, chain_root(key, layout.digest), page_ids)
        self.versions: dict[int, VersionRecord] = {}
        self.positions: dict[int, Position] = {}
        self.head_id: int | None = record.head_id
        self.refs: dict[bytes, int] = refs
        """Pages the session holds, each with the newest of its versions holding it (0: saved ahead)."""
        packed: dict[int, bytes] = {}
        for version in versions:
            base = packed.get(version.base_id, b"") if version.base_id is not None else b""
            buf = base[: 4 * version.base_len] + version.suffix
            packed[version.version_id] = buf
            self.add(version, buf)

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def ref(self) -> int:
        return self.record.ref

    @property
    def head(self) -> Position | None:
        return self.positions.get(self.head_id) if self.head_id is not None else None

    def add(self, version: VersionRecord, buf: bytes) -> Position:
        """Insert a committed version (its full packed tokens) into the trie."""
        position = self.trie.insert(buf, VersionId(version.version_id))
        self.versions[version.version_id] = version
        self.positions[version.version_id] = position
        return position

    def tokens(self, version_id: int) -> bytes:
        """The packed tokens of a version."""
        return self.trie.tokens_of(self.positions[version_id])

    def page_ids(self, version_id: int) -> list[PageId]:
        """Ids of every full page of a version, in order."""
        return self.trie.page_ids_of(self.positions[version_id])

    def prompt_page_ids(self, buf: bytes) -> list[PageId]:
        """Ids of every full page of a packed prompt, reusing the trie's ids for its known prefix."""
        trie = self.trie
        match = trie.walk(buf)
        page_tokens = trie.page_tokens
        ids: list[PageId] = []
        for node in match.path:
            known = min(node.depth, match.num_tokens) // page_tokens - node.start // page_tokens
            ids.extend(node.page_ids[: max(known, 0)])
        total = len(buf) // 4 // page_tokens
        if len(ids) < total:
            prev = ids[-1] if ids else trie.root_id
            ids.extend(trie.chain(prev, buf, len(ids), total - len(ids)))
        return ids

    def version_record(self, version_id: Any) -> VersionRecord:
        """The row of one of this session's versions; raises ``UnknownVersion`` (or
        ``InvalidInput`` for an id that is not an int)."""
        record = self.versions.get(check_version_id(version_id))
        if record is None:
            raise UnknownVersion(f"version {version_id} is not a version of session {self.session_id!r}")
        return record

    def version(self, version_id: int) -> Version:
        record = self.versions[version_id]
        return Version(
            VersionId(record.version_id), self.session_id,
            VersionId(record.parent_id) if record.parent_id is not None else None,
            record.num_tokens, record.created_at, record.label, record.version_id == self.head_id, record.pinned,
        )
