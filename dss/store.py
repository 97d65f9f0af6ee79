"""The embedded store: sessions, versions, resume, pages across host and disk.

:class:`Store` is the public API. Every method is thread-safe (one lock per store) and
several processes may open the same store folder: each catches up with the others'
commits through the epoch file and the catalog's change feed before it answers.

Contracts that hold for every method:

* An argument that is wrong raises a :class:`dss.errors.DssError` subclass and changes
  nothing.
* A method that returns after a write has committed it durably (catalog transaction and
  fsynced page files); a process killed at any instant loses no returned commit and
  leaves no half-visible version.
* ``resume`` never counts a page unless some tier holds its bytes under this session's
  namespace and layout; bytes that fail their checksum on read are a miss and are
  quarantined, never returned.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from sqlalchemy import select

from dss import integrity, records
from dss.catalog import Catalog, Tx
from dss.config import StoreConfig
from dss.epoch import Epoch
from dss.errors import (
    AmbiguousSession,
    InvalidInput,
    InvalidPage,
    InvalidTokens,
    SessionExists,
    StoreClosed,
    UnknownSession,
    UnknownVersion,
)
from dss.hashing import checksum, namespace_key
from dss.pageindex import PageEntry, PageIndex
from dss.placement import pick_segments, room_needed
from dss.records import SessionRecord, VersionRecord
from dss.resume import Rates, ResumeResult
from dss.sessions import SessionState
from dss.tiers.base import Located, ReadRequest
from dss.tiers.disk import HEADER_BYTES, RECORD, DiskTier
from dss.tiers.host import HostTier
from dss.tokens import TokenInput, pack, unpack
from dss.trie import Span
from dss.types import Layout, PageId, PageRef, Session, SqlResult, Version, VersionId

log = logging.getLogger("dss.store")

class NewPage(NamedTuple):
    """A page a commit writes: its id, checksum, payload and index in the prompt."""

    page_id: PageId
    checksum: int
    payload: bytes
    index: int


class Written(NamedTuple):
    """A segment a commit wrote, and where each of its pages lies in it."""

    segment: str
    size: int
    pages: list[tuple[NewPage, Located]]


class Store:
    """A dialogue state store opened in this process (see the module docstring)."""

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        home = config.home
        home.mkdir(parents=True, exist_ok=True)
        with _folder_lock(home):
            self._secret = _load_secret(config.secret_path)
            self.catalog = Catalog(config.url, fsync=config.fsync, sql_timeout_s=config.sql_timeout_s)
            self.catalog.ensure_schema()
            self.epoch = Epoch(home / "epoch")
        self.disk = DiskTier(home, fsync=config.fsync)
        self.host = HostTier(config.host_bytes)
        self.index = PageIndex(self.host)
        self.rates = Rates({"host": config.host_read_gbps * 1e9, "disk": config.disk_read_gbps * 1e9},
                           config.recompute_tokens_per_s)
        self._lock = threading.RLock()
        self._sessions: dict[int, SessionState] = {}
        self._names: dict[tuple[str, str | None], int] = {}
        self._keys: dict[int, bytes] = {}
        self._own: set[int] = set()
        self._closed = False
        self._seq = self.catalog.latest_seq()
        self._epoch_seen = self.epoch.read()
        with self.catalog.read() as conn:
            recorded = set(records.all_segments(conn, "disk"))
        removed = self.disk.recover(recorded)
        if removed:
            log.info("removed %d orphaned page files of dead writers", len(removed))

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Release files and connections. Idempotent; the store is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.disk.close()
            self.epoch.close()
            self.catalog.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions --------------------------------------------------------------------------

    def create_session(self, session_id: str, *, user_id: str = "anonymous", tenant_id: str = "default",
                       layout: Layout) -> Session:
        """Create a session owned by ``(tenant_id, user_id)`` whose pages have ``layout``.

        Idempotent for the same owner and layout (returns the existing session); raises
        ``SessionExists`` when the id is taken in this tenant by another owner or layout.
        """
        _check_name("session_id", session_id)
        _check_name("user_id", user_id)
        _check_name("tenant_id", tenant_id)
        if not isinstance(layout, Layout):
            raise InvalidInput(f"layout must be a dss.Layout, not {type(layout).__name__}")
        with self._lock:
            self._sync()
            with self._write() as tx:
                found = records.find_sessions(tx.conn, session_id, tenant_id)
                if found:
                    rec = found[0]
                    if rec.user_id != user_id or rec.layout != layout:
                        raise SessionExists(
                            f"session {session_id!r} exists in tenant {tenant_id!r} with another owner or layout")
                    return self._session_info(self._loaded(rec.ref, tx.conn))
                tenant_ref = records.ensure_tenant(tx.conn, tenant_id)
                user_ref = records.ensure_user(tx.conn, tenant_ref, user_id)
                layout_ref = records.ensure_layout(tx.conn, layout)
                ref = records.insert_session(tx.conn, session_id, tenant_ref, user_ref, layout_ref, tx.seq)
                self.catalog.note(tx, "session", session_ref=ref, user_ref=user_ref)
                record = records.session_by_ref(tx.conn, ref)
                assert record is not None
            state = self._build(record, [], set())
            return self._session_info(state)

    def session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        """The session's owner, layout and head. Raises ``UnknownSession``."""
        with self._lock:
            self._sync()
            return self._session_info(self._state(session_id, tenant_id))

    def sessions(self, *, tenant_id: str | None = None, user_id: str | None = None) -> list[Session]:
        """Every session (optionally of one tenant or user), oldest first. Read-only."""
        with self._lock:
            self._check_open()
            with self.catalog.read() as conn:
                rows = records.list_sessions(conn, tenant_id, user_id)
            return [_session_of(rec, count) for rec, count in rows]

    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> int:
        """Delete a session and its versions; release pages no other session references.

        Returns the number of pages released (gone from every tier).
        """
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            with self._write() as tx:
                released = [PageId(p) for p in records.delete_session(tx.conn, state.ref)]
                emptied = records.drop_pages(tx.conn, released)
                self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)
                self.catalog.note(tx, "drop", user_ref=state.record.user_ref, page_ids=released)
            self.disk.remove(emptied)
            self.index.forget(released)
            self._sessions.pop(state.ref, None)
            self._names = {k: v for k, v in self._names.items() if v != state.ref}
            return len(released)

    # -- versions --------------------------------------------------------------------------

    def commit(self, session_id: str, tokens: TokenInput, pages: Mapping[int, bytes] | None = None, *,
               label: str | None = None, tenant_id: str | None = None) -> Version:
        """Record ``tokens`` as a new version of the session, child of the head, and make it the head.

        ``pages[i]`` is the KV of ``tokens[i*page_tokens:(i+1)*page_tokens]``, exactly
        ``layout.page_bytes`` bytes; only full pages may be given. Pages already stored in
        the namespace are not written again. Returns the new version.
        """
        buf = pack(tokens)
        if not buf:
            raise InvalidTokens("commit needs at least one token")
        _check_label(label)
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            payloads = _check_pages(pages, len(buf) // 4, state.record.layout)
            ids = state.prompt_page_ids(buf)
            known = self.index.entries
            fresh = [NewPage(ids[i], checksum(p), p, i) for i, p in payloads.items()
                     if not (ids[i] in known and known[ids[i]].disk is not None)]
            written: list[Written] = []
            try:
                with self._write() as tx:
                    state = self._fresh(tx, state)
                    evicted, emptied = self._make_room(tx, fresh)
                    if fresh and self._fits(tx, fresh):
                        written = self._write_segments(fresh)
                    version, inserted, held, unused = self._record_commit(tx, state, buf, ids, written, label)
            except BaseException:
                self.disk.remove(w.segment for w in written)
                raise
            self.disk.remove([*emptied, *unused])
            self.index.lose_durable(evicted)
            self._apply_commit(state, tx.seq, version, buf, inserted, held, payloads, ids)
            return state.version(version.version_id)

    def rollback(self, session_id: str, version_id: int, *, tenant_id: str | None = None) -> Version:
        """Move the session's head to ``version_id``; the next commit's parent is that version.

        Copies nothing and deletes nothing: later versions stay and still resume.
        """
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            _version_of(state, version_id)
            with self._write() as tx:
                state = self._fresh(tx, state)
                _version_of(state, version_id)
                records.update_session(tx.conn, state.ref, tx.seq, head_id=version_id)
                self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)
            state.head_id = version_id
            state.record = state.record._replace(head_id=version_id, seq=tx.seq)
            return state.version(version_id)

    def branch(self, session_id: str, version_id: int, new_session_id: str, *, tenant_id: str | None = None,
               label: str | None = None) -> Session:
        """Start session ``new_session_id`` at ``version_id`` of this one (same owner and layout).

        The new session's first version has that version's tokens and shares its pages;
        no page is copied. Raises ``SessionExists`` if the new id is taken in the tenant.
        """
        _check_name("new_session_id", new_session_id)
        _check_label(label)
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            _version_of(state, version_id)
            with self._write() as tx:
                state = self._fresh(tx, state)
                source = _version_of(state, version_id)
                rec = state.record
                if records.find_sessions(tx.conn, new_session_id, rec.tenant_id):
                    raise SessionExists(f"session {new_session_id!r} already exists in tenant {rec.tenant_id!r}")
                layout_ref = records.ensure_layout(tx.conn, rec.layout)
                ref = records.insert_session(tx.conn, new_session_id, rec.tenant_ref, rec.user_ref, layout_ref, tx.seq)
                buf = state.tokens(version_id)
                vid = records.insert_version(tx.conn, ref, source.version_id, None, 0, len(buf) // 4, buf, label)
                records.update_session(tx.conn, ref, tx.seq, head_id=vid)
                held = records.existing_pages(tx.conn, state.page_ids(version_id))
                records.add_refs(tx.conn, ref, held, vid)
                self.catalog.note(tx, "session", session_ref=ref, user_ref=rec.user_ref)
                new_record = records.session_by_ref(tx.conn, ref)
                versions = records.session_versions(tx.conn, ref)
            assert new_record is not None
            return self._session_info(self._build(new_record, versions, held))

    def versions(self, session_id: str, *, tenant_id: str | None = None) -> list[Version]:
        """Every version of the session, oldest first."""
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            return [state.version(v) for v in state.versions]

    def tokens(self, session_id: str, version_id: int | None = None, *, tenant_id: str | None = None) -> list[int]:
        """The token history of a version (default: the head; empty if the session has none)."""
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            if version_id is None:
                if state.head_id is None:
                    return []
                version_id = state.head_id
            _version_of(state, version_id)
            return unpack(state.tokens(version_id))

    def pin(self, session_id: str, version_id: int, *, pinned: bool = True, tenant_id: str | None = None) -> Version:
        """Pin (or unpin) a version: disk eviction never drops pages a pinned version holds."""
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            _version_of(state, version_id)
            with self._write() as tx:
                state = self._fresh(tx, state)
                _version_of(state, version_id)
                records.set_pinned(tx.conn, version_id, bool(pinned))
                records.update_session(tx.conn, state.ref, tx.seq)
                self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)
            state.versions[version_id] = state.versions[version_id]._replace(pinned=bool(pinned))
            state.record = state.record._replace(seq=tx.seq)
            return state.version(version_id)

    # -- resume and pages ------------------------------------------------------------------

    def resume(self, session_id: str, tokens: TokenInput, *, tenant_id: str | None = None) -> ResumeResult:
        """How many leading tokens of ``tokens`` have stored, readable KV, and where.

        Walks the session's trie (every version, not only the head), then — past the
        trie's match — looks the next pages up by their chain hash in the session's
        namespace. Side-effect free: changes nothing, so engines may ask repeatedly.
        """
        buf = pack(tokens)
        with self._lock:
            self._sync()
            state = self._state(session_id, tenant_id)
            trie = state.trie
            match = trie.walk(buf)
            spans = trie.available(match, state.ns.gen, self.index.code_of)
            num_pages = sum(span.count for span in spans)
            page_tokens = trie.page_tokens
            version_id = None
            if num_pages:
                depth = num_pages * page_tokens
                node = next(n for n in match.path if n.start < depth <= n.depth)
                version_id = trie.version_along(node, depth, state.head)
            if match.num_tokens < (num_pages + 1) * page_tokens <= len(buf) // 4:
                extra = self._chain_lookup(state, buf, spans, num_pages)
                if extra is not None:
                    spans = [*spans, extra]
                    num_pages += extra.count
            layout = state.record.layout
            return ResumeResult(state.session_id, VersionId(version_id) if version_id is not None else None,
                                num_pages * page_tokens, len(buf) // 4, match.num_tokens, page_tokens,
                                layout.page_bytes, spans=spans, rates=self.rates)

    def read_pages(self, pages: Sequence[PageRef | bytes]) -> list[bytes | None]:
        """The payloads of pages (``PageRef`` or page id), in order, checksums verified.

        ``None`` for a page no tier holds any more or whose bytes fail verification (that
        page is quarantined: removed from the catalog, recorded in ``quarantine``).
        Reads from disk are batched and promote the pages to host.
        """
        ids = [PageId(p.page_id if isinstance(p, PageRef) else bytes(p)) for p in pages]
        with self._lock:
            self._sync()
            out = self.host.get_many(ids)
            entries = self.index.entries
            unknown = [ids[i] for i, v in enumerate(out) if v is None and ids[i] not in entries]
            if unknown:
                self._learn_pages(unknown)
            wanted = [(i, entries[ids[i]]) for i, v in enumerate(out)
                      if v is None and ids[i] in entries and entries[ids[i]].disk is not None]
            requests = [ReadRequest(*entry.disk, entry.page_id, entry.checksum)  # type: ignore[misc]
                        for _, entry in wanted]
            payloads, failures = self.disk.read(requests)
            for (i, entry), payload in zip(wanted, payloads):
                if payload is None:
                    continue
                data = out[i] = bytes(payload)
                evicted = self.host.put(entry.page_id, data)
                if evicted:
                    self.index.left_host(evicted)
                entry.ns.bump()
            if failures:
                self._quarantine([(wanted[f.index][1], f.reason) for f in failures])
            return out

    # -- inspection ------------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only SQL statement on the catalog; any write is refused (``ReadOnlyViolation``)."""
        self._check_open()
        return self.catalog.sql(query, params, max_rows)

    def check(self) -> list[str]:
        """Every broken invariant, as a sentence each; ``[]`` when the store is sound. Read-only."""
        with self._lock:
            self._sync()
            return integrity.check(self)

    def stats(self) -> dict[str, Any]:
        """Sizes of the tiers as this process sees them."""
        with self._lock:
            self._check_open()
            with self.catalog.read() as conn:
                disk_used = records.tier_bytes(conn, "disk")
            return {
                "host": {"pages": len(self.host), "bytes": self.host.used_bytes, "capacity": self.host.capacity_bytes},
                "disk": {"bytes": disk_used, "capacity": self.config.disk_bytes},
            }

    # -- internals: state ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this store is closed")

    @contextmanager
    def _write(self) -> Iterator[Tx]:
        self._check_open()
        with self.catalog.write() as tx:
            yield tx
        self._own.add(tx.seq)
        self.epoch.publish(tx.seq)

    def _sync(self) -> None:
        """Catch up with what other processes committed (cheap when nothing changed)."""
        self._check_open()
        seen = self.epoch.read()
        if seen == self._epoch_seen:
            return
        self._epoch_seen = seen
        latest, rows = self.catalog.changes_since(self._seq)
        if rows is None:
            self._sessions.clear()
            self._names.clear()
            for user_ref in list(self.index.namespaces):
                self.index.drop_namespace(user_ref)
        else:
            reload: dict[int, int] = {}
            for seq, kind, session_ref, user_ref, page_id in rows:
                if seq in self._own:
                    continue
                if kind == "session":
                    self._sessions.pop(session_ref, None)
                    self._names = {k: v for k, v in self._names.items() if k[1] is not None}
                elif kind == "pages":
                    reload[user_ref] = min(seq, reload.get(user_ref, seq))
                elif kind == "drop":
                    self.index.forget([PageId(bytes(page_id))])
                elif kind == "evict":
                    self.index.lose_durable([PageId(bytes(page_id))])
            for user_ref, since in reload.items():
                ns = self.index.namespaces.get(user_ref)
                if ns is not None and ns.loaded:
                    with self.catalog.read() as conn:
                        self.index.apply(ns, records.namespace_pages(conn, user_ref, since))
        self._own = {s for s in self._own if s > latest}
        self._seq = latest

    def _state(self, session_id: str, tenant_id: str | None) -> SessionState:
        ref = self._names.get((session_id, tenant_id))
        if ref is not None:
            state = self._sessions.get(ref)
            if state is not None:
                return state
            with self.catalog.read() as conn:
                loaded = self._loaded(ref, conn)
            if loaded is not None:
                return loaded
            del self._names[(session_id, tenant_id)]
        _check_name("session_id", session_id)
        if tenant_id is not None:
            _check_name("tenant_id", tenant_id)
        with self.catalog.read() as conn:
            found = records.find_sessions(conn, session_id, tenant_id)
            if not found:
                where = f" in tenant {tenant_id!r}" if tenant_id is not None else ""
                raise UnknownSession(f"no session {session_id!r}{where}")
            if len(found) > 1:
                raise AmbiguousSession(f"session id {session_id!r} exists in {len(found)} tenants: pass tenant_id")
            state = self._loaded(found[0].ref, conn)
        assert state is not None
        self._names[(session_id, tenant_id)] = state.ref
        return state

    def _loaded(self, ref: int, conn: Any) -> SessionState | None:
        """The cached state of session ``ref``, loading it on ``conn`` if needed."""
        state = self._sessions.get(ref)
        if state is not None:
            return state
        record = records.session_by_ref(conn, ref)
        if record is None:
            return None
        return self._build(record, records.session_versions(conn, ref), records.session_refs(conn, ref), conn)

    def _build(self, record: SessionRecord, versions: list[VersionRecord], refs: set[bytes],
               conn: Any = None) -> SessionState:
        ns = self.index.namespace(record.user_ref)
        if not ns.loaded:
            if conn is None:
                with self.catalog.read() as own:
                    self.index.apply(ns, records.namespace_pages(own, record.user_ref))
            else:
                self.index.apply(ns, records.namespace_pages(conn, record.user_ref))
            ns.loaded = True
        key = self._keys.get(record.user_ref)
        if key is None:
            key = self._keys[record.user_ref] = namespace_key(self._secret, record.tenant_id, record.user_id)
        state = SessionState(record, key, ns, versions, refs)
        self._sessions[record.ref] = state
        return state

    def _fresh(self, tx: Tx, state: SessionState) -> SessionState:
        """``state`` as of this write transaction, reloaded if another process changed it."""
        row = tx.conn.execute(select(records.sessions.c.seq).where(records.sessions.c.id == state.ref)).first()
        if row is None:
            self._sessions.pop(state.ref, None)
            raise UnknownSession(f"session {state.session_id!r} was deleted")
        if row[0] == state.record.seq:
            return state
        self._sessions.pop(state.ref, None)
        fresh = self._loaded(state.ref, tx.conn)
        assert fresh is not None
        return fresh

    def _session_info(self, state: SessionState) -> Session:
        rec = state.record
        return Session(rec.session_id, rec.tenant_id, rec.user_id, rec.layout,
                       VersionId(state.head_id) if state.head_id is not None else None, len(state.versions),
                       rec.created_at, rec.last_access)

    # -- internals: commit -----------------------------------------------------------------

    def _make_room(self, tx: Tx, fresh: list[NewPage]) -> tuple[list[PageId], list[str]]:
        """Drop disk segments so ``fresh`` fits; return ``(evicted page ids, emptied segments)``."""
        if not fresh:
            return [], []
        capacity = self.config.disk_bytes
        need = _segment_size(fresh)
        to_free = room_needed(records.tier_bytes(tx.conn, "disk"), need, capacity)
        if to_free <= 0 or need > capacity:
            return [], []
        protected = self._pinned_segments(tx)
        order = records.eviction_order(tx.conn, "disk")
        victims = pick_segments(order, to_free, protected.__contains__)
        if not victims:
            return [], []
        pages = [PageId(p) for ids in records.segment_pages(tx.conn, [v[0] for v in victims]).values() for p in ids]
        emptied = records.drop_pages(tx.conn, pages)
        emptied.extend(records.drop_empty_segments(tx.conn, [v[0] for v in victims]))
        self.catalog.note(tx, "evict", page_ids=pages)
        log.info("disk full: dropped %d pages in %d segments", len(pages), len(victims))
        return pages, emptied

    def _pinned_segments(self, tx: Tx) -> set[int]:
        pinned: list[bytes] = []
        for session_ref, version_id in records.pinned_versions(tx.conn):
            state = self._loaded(session_ref, tx.conn)
            if state is not None and version_id in state.positions:
                pinned.extend(state.page_ids(version_id))
        segments: set[int] = set()
        for part in records.chunks(pinned):
            segments.update(r[0] for r in tx.conn.execute(
                select(records.locations.c.segment_ref).where(records.locations.c.page_id.in_(part))))
        return segments

    def _fits(self, tx: Tx, fresh: list[NewPage]) -> bool:
        used = records.tier_bytes(tx.conn, "disk")
        if used + _segment_size(fresh) <= self.config.disk_bytes:
            return True
        log.warning("disk tier full (%d of %d bytes, all pinned or too large): %d pages stay in host only",
                    used, self.config.disk_bytes, len(fresh))
        return False

    def _write_segments(self, fresh: list[NewPage]) -> list[Written]:
        """Write new pages to disk as segments of at most ``segment_bytes`` each."""
        batches: list[list[NewPage]] = [[]]
        size = HEADER_BYTES
        for page in fresh:
            grow = RECORD.size + len(page.payload)
            if batches[-1] and size + grow > self.config.segment_bytes:
                batches.append([])
                size = HEADER_BYTES
            batches[-1].append(page)
            size += grow
        out: list[Written] = []
        for batch in batches:
            segment, seg_size, located = self.disk.write([(p.page_id, p.checksum, p.payload) for p in batch])
            out.append(Written(segment, seg_size, list(zip(batch, located))))
        return out

    def _record_commit(self, tx: Tx, state: SessionState, buf: bytes, ids: list[PageId], written: list[Written],
                       label: str | None) -> tuple[VersionRecord, dict[PageId, tuple[NewPage, Located]], set[bytes], list[str]]:
        """Insert the version, the pages new to the catalog and the session's references.

        Returns the version, the pages inserted (with where they lie), every page of the
        version the catalog holds, and the segments that turned out to hold no new page
        (another process stored those pages first; their files go after the commit).
        """
        rec = state.record
        match = state.trie.walk(buf)
        base_id = None
        if match.num_tokens:
            base_id = state.trie.version_along(match.path[-1], match.num_tokens, state.head)
        suffix = buf[4 * match.num_tokens:]
        vid = records.insert_version(tx.conn, rec.ref, state.head_id, base_id, match.num_tokens, len(buf) // 4,
                                     suffix, label)
        records.update_session(tx.conn, rec.ref, tx.seq, head_id=vid)
        existing = records.existing_pages(tx.conn, ids)
        inserted: dict[PageId, tuple[NewPage, Located]] = {}
        unused: list[str] = []
        stamp = records.now()
        for segment in written:
            placed = [(page, where) for page, where in segment.pages
                      if page.page_id not in existing and page.page_id not in inserted]
            if not placed:
                unused.append(segment.segment)
                continue
            segment_ref = records.insert_segment(tx.conn, segment.segment, "disk", rec.user_ref, segment.size)
            records.insert_pages(
                tx.conn,
                [{"page_id": page.page_id, "user_ref": rec.user_ref, "layout_ref": rec.layout_ref,
                  "page_index": page.index, "size": len(page.payload), "checksum": page.checksum,
                  "created_at": stamp, "seq": tx.seq} for page, _ in placed],
                [{"page_id": page.page_id, "tier": "disk", "segment_ref": segment_ref, "offset": where.offset,
                  "length": where.length} for page, where in placed])
            inserted.update((page.page_id, (page, where)) for page, where in placed)
        held = existing | set(inserted)
        records.add_refs(tx.conn, rec.ref, [p for p in held if p not in state.refs], vid)
        records.touch_refs(tx.conn, rec.ref, [p for p in held if p in state.refs], vid)
        self.catalog.note(tx, "session", session_ref=rec.ref, user_ref=rec.user_ref)
        if inserted:
            self.catalog.note(tx, "pages", user_ref=rec.user_ref)
        version = VersionRecord(vid, rec.ref, state.head_id, base_id, match.num_tokens, len(buf) // 4, suffix, label,
                                False, stamp)
        return version, inserted, held, unused

    def _apply_commit(self, state: SessionState, seq: int, version: VersionRecord, buf: bytes,
                      inserted: dict[PageId, tuple[NewPage, Located]], held: set[bytes],
                      payloads: dict[int, bytes], ids: list[PageId]) -> None:
        """Bring this process's caches in line with a commit that has just become durable."""
        state.add(version, buf)
        state.head_id = version.version_id
        state.record = state.record._replace(head_id=version.version_id, seq=seq)
        state.refs |= held
        entries = self.index.entries
        for page_id, (page, where) in inserted.items():
            self.index.add(PageEntry(page_id, state.ns, page.index, len(page.payload), page.checksum, where))
        for index, payload in payloads.items():
            page_id = ids[index]
            if page_id not in entries:  # not durable: the disk tier had no room
                self.index.add(PageEntry(page_id, state.ns, index, len(payload), checksum(payload), None))
            evicted = self.host.put(page_id, payload)
            if evicted is None:
                if entries[page_id].disk is None:
                    self.index.forget([page_id])
            elif evicted:
                self.index.left_host(evicted)
        state.ns.bump()

    def _chain_lookup(self, state: SessionState, buf: bytes, spans: list[Span], first: int) -> Span | None:
        """Pages ``first, first+1, ...`` of the prompt found by chain hash in the namespace."""
        page_tokens = state.trie.page_tokens
        prev = spans[-1].page_ids[spans[-1].count - 1] if spans else state.trie.root_id
        code_of = self.index.code_of
        ids: list[PageId] = []
        codes = bytearray()
        for k in range(first, len(buf) // 4 // page_tokens):
            page_id = state.trie.chain(prev, buf, k, 1)[0]
            code = code_of(page_id)
            if not code:
                break
            ids.append(page_id)
            codes.append(code)
            prev = page_id
        return Span(first, tuple(ids), codes, len(ids)) if ids else None

    def _learn_pages(self, page_ids: list[PageId]) -> None:
        """Load catalog rows of pages this process has not seen (e.g. another process's namespace)."""
        with self.catalog.read() as conn:
            found = records.pages_by_id(conn, page_ids)
        for record in found:
            self.index.apply(self.index.namespace(record.user_ref), [record])

    def _quarantine(self, bad: list[tuple[PageEntry, str]]) -> None:
        with self._write() as tx:
            for entry, reason in bad:
                assert entry.disk is not None
                records.add_quarantine(tx.conn, entry.page_id, entry.ns.user_ref, "disk", entry.disk.segment,
                                       entry.disk.offset, reason)
                log.error("quarantined page %s: %s", entry.page_id.hex(), reason)
            ids = [e.page_id for e, _ in bad]
            emptied = records.drop_pages(tx.conn, ids)
            self.catalog.note(tx, "drop", page_ids=ids)
        self.disk.remove(emptied)
        self.index.forget(ids)


# -- helpers ---------------------------------------------------------------------------------


def _segment_size(fresh: Sequence[NewPage]) -> int:
    return HEADER_BYTES + sum(RECORD.size + len(p.payload) for p in fresh)


def _version_of(state: SessionState, version_id: Any) -> VersionRecord:
    if type(version_id) is not int:
        raise InvalidInput(f"version_id must be an int, not {type(version_id).__name__}")
    version = state.versions.get(version_id)
    if version is None:
        raise UnknownVersion(f"version {version_id} is not a version of session {state.session_id!r}")
    return version


def _check_name(label: str, value: Any) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= 256 or not value.isprintable():
        raise InvalidInput(f"{label} must be a printable string of 1 to 256 characters, got {value!r}")


def _check_label(label: Any) -> None:
    if label is not None and (not isinstance(label, str) or len(label) > 256):
        raise InvalidInput(f"label must be a string of at most 256 characters, got {label!r}")


def _check_pages(pages: Mapping[int, bytes] | None, num_tokens: int, layout: Layout) -> dict[int, bytes]:
    if pages is None:
        return {}
    if not isinstance(pages, Mapping):
        raise InvalidPage(f"pages must be a mapping of page index to bytes, not {type(pages).__name__}")
    full = num_tokens // layout.page_tokens
    out: dict[int, bytes] = {}
    for index, payload in pages.items():
        if type(index) is not int or not 0 <= index < full:
            raise InvalidPage(f"page index {index!r} is out of range: {num_tokens} tokens hold {full} full pages "
                              f"of {layout.page_tokens} tokens")
        try:
            size = memoryview(payload).nbytes
        except TypeError:
            raise InvalidPage(f"page {index} must be bytes-like, not {type(payload).__name__}") from None
        if size != layout.page_bytes:
            raise InvalidPage(f"page {index} has {size} bytes; layout {layout.name!r} pages have {layout.page_bytes}")
        out[index] = payload if type(payload) is bytes else memoryview(payload).tobytes()
    return dict(sorted(out.items()))


def _session_of(rec: SessionRecord, num_versions: int) -> Session:
    return Session(rec.session_id, rec.tenant_id, rec.user_id, rec.layout,
                   VersionId(rec.head_id) if rec.head_id is not None else None, num_versions, rec.created_at,
                   rec.last_access)


@contextmanager
def _folder_lock(home: os.PathLike[str]) -> Iterator[None]:
    """Serialise store initialisation (schema creation, secret) between processes."""
    fd = os.open(os.path.join(home, ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_secret(path: os.PathLike[str]) -> bytes:
    """The store's 32-byte hashing secret, created (mode 0600, fsynced) on first open."""
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except FileNotFoundError:
        secret = secrets.token_bytes(32)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
    if len(secret) != 32:
        raise InvalidInput(f"{path} must hold exactly 32 bytes (the store secret)")
    return secret
