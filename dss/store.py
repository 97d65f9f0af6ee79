"""The embedded store: sessions, versions, resume, pages across host and disk.

:class:`Store` is the public API. Every method is thread-safe (one lock per store) and
several processes may open the same store folder: each catches up with the others'
commits (see :mod:`dss.mirror`) before it answers.

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

import hashlib
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from dss import integrity, records
from dss.catalog import Catalog, Tx, catalog_errors, open_catalog
from dss.config import StoreConfig
from dss.crypto import read_master_key
from dss.epoch import Epoch
from dss.erase import Eraser
from dss.errors import ConfigError, ErasureInProgress, InvalidInput, InvalidTokens, SessionExists, StoreClosed, UnknownSession
from dss.folder import adopt_folder, folder_lock
from dss.keys import adopt_master_key, ensure_key
from dss.matcher import SHARED_USER, Matcher, shared_session_id
from dss.mirror import Mirror
from dss.pageindex import PageIndex
from dss.pages import NewPage, PageStore, Placement
from dss.records import SessionRecord, VersionRecord
from dss.resume import Rates, ResumeResult
from dss.sessions import SessionState
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tokens import TokenInput, pack, unpack, view
from dss.types import Layout, PageId, PageRef, Session, SqlResult, Version, VersionId
from dss.validate import (
    check_callback,
    check_flag,
    check_label,
    check_layout,
    check_name,
    check_page_ids,
    check_pages,
)

log = logging.getLogger("dss.store")

CACHE_PREFIX = "~cache-"
"""Session ids of the sessions holding pages saved without a session (one per namespace and layout)."""


class Store:
    """A dialogue state store opened in this process (see the module docstring)."""

    def __init__(self, config: StoreConfig) -> None:
        """Open the store; a refused open (``DssError``) releases what it opened, and leaves
        no master key file it made."""
        self._closed = True
        try:
            with catalog_errors():
                self._open(config)
        except BaseException:
            self._release()
            raise

    def _open(self, config: StoreConfig) -> None:
        self.config = config
        home = config.home
        try:
            home.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make the store folder {home}: {exc.strerror or exc}") from None
        with folder_lock(home):
            hex_key = config.master_key.get_secret_value() if config.master_key else None
            master = read_master_key(config.master_key_file, home, hex_key)
            sql_url = config.sql_url.get_secret_value() if config.sql_url else None
            self.catalog = open_catalog(config.url, fsync=config.fsync, sql_timeout_s=config.sql_timeout_s,
                                        sql_url=sql_url)
            self.catalog.ensure_schema()
            self._master = adopt_master_key(self.catalog, master, config.master_key_file)
            adopt_folder(self.catalog, home)
            epoch = self._epoch = Epoch(home / "epoch")
        self.disk = DiskTier(home, fsync=config.fsync)
        self.host = HostTier(config.host_bytes)
        self.index = PageIndex(self.host)
        self.mirror = Mirror(self.catalog, epoch, self.index, self._master, encrypt=config.encrypt)
        self.pages = PageStore(self.catalog, self.disk, self.host, self.index, disk_bytes=config.disk_bytes,
                               segment_bytes=config.segment_bytes, pinned_pages=self._pinned_pages)
        self.rates = Rates({"host": config.host_read_gbps * 1e9, "disk": config.disk_read_gbps * 1e9},
                           config.recompute_tokens_per_s)
        self.matcher = Matcher(self.mirror, self.index, self.rates)
        self.eraser = Eraser(self.catalog, self.disk, self.host, write=self._write, forget_cached=self._forget_cached)
        self._lock = threading.RLock()
        self._closed = False
        with self.catalog.read() as conn:
            removed = self.disk.recover(set(records.all_segments(conn, "disk")))
        if removed:
            log.info("removed %d page files left behind by dead writers", len(removed))
        finished = self.eraser.resume_all()
        if finished:
            log.info("finished %d erasures a crash had interrupted", len(finished))

    def close(self) -> None:
        """Release files and connections. Idempotent; the store is unusable afterwards."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._release()

    def _release(self) -> None:
        """Close the files and connections opened so far (all of them once open)."""
        for part in (getattr(self, "disk", None), getattr(self, "_epoch", None), getattr(self, "catalog", None)):
            if part is not None:
                part.close()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

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
        Ids starting with ``~`` are reserved for dss.
        """
        check_name("session_id", session_id)
        if session_id.startswith("~"):
            raise InvalidInput("session ids starting with '~' are reserved for dss")
        return self._create(session_id, user_id, tenant_id, layout)

    def session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        """The session's owner, layout and head. Raises ``UnknownSession``."""
        with self._reading():
            return _session_info(self.mirror.state(session_id, tenant_id))

    def sessions(self, *, tenant_id: str | None = None, user_id: str | None = None) -> list[Session]:
        """Every session (optionally of one tenant or user), oldest first."""
        check_name("tenant_id", tenant_id, optional=True)
        check_name("user_id", user_id, optional=True)
        with self._reading():
            with self.catalog.read() as conn:
                rows = records.list_sessions(conn, tenant_id, user_id)
                out = []
                for rec, count in rows:
                    try:
                        out.append(_session_of(self.mirror.opened(rec, conn), count))
                    except ErasureInProgress:  # the owner's key is gone: the erasure deletes the row next
                        continue
            return out

    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> int:
        """Delete a session and its versions; release the pages no other session references.

        Returns the number of pages released (gone from every tier).
        """
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            with self._write() as tx:
                released = [PageId(p) for p in records.delete_session(tx.conn, state.ref)]
                emptied = records.drop_pages(tx.conn, released, tx.seq)
                self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)
                self.catalog.note(tx, "drop", user_ref=state.record.user_ref, page_ids=released)
            self.disk.remove(emptied)
            self.index.forget(released)
            self.mirror.drop(state.ref)
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
        check_label(label)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            payloads = check_pages(pages, len(buf) // 4, state.record.layout)
            ids = state.prompt_page_ids(buf)
            fresh = self.pages.fresh(ids, payloads, self.mirror.keys(state.record.user_ref).sealer)

        def record(tx: Tx, state: SessionState, held: set[bytes]) -> VersionRecord:
            version = self._record_version(tx, state, buf, label)
            records.add_refs(tx.conn, state.ref, [p for p in held if p not in state.refs], version.version_id)
            self._retag(tx, state, [p for p in held if p in state.refs], version.version_id)
            return version

        def applied(state: SessionState, version: VersionRecord) -> Version:
            state.add(version, buf)
            state.head_id = version.version_id
            return state.version(version.version_id)

        return self._store_pages(state, ids, payloads, fresh, ids, record, applied)

    def save_pages(self, session_id: str | None, tokens: TokenInput, pages: Mapping[int, bytes], *,
                   tenant_id: str | None = None, user_id: str | None = None, layout: Layout | None = None) -> int:
        """Store pages of ``tokens`` ahead of the commit that will contain them.

        Engines save KV as they compute it and commit the version when the request ends;
        the session holds the saved pages from now on (they resume at once, and are
        released with the session). With ``session_id=None`` the pages are held for the
        namespace ``(tenant_id, user_id)`` and ``layout``, for requests that carry no
        session (they resume through :meth:`lookup`). Returns how many pages were new.
        """
        buf = pack(tokens)
        with self._reading():
            if session_id is None:  # checked before the page-cache session is made
                namespace = _sessionless(tenant_id, user_id, layout)
                payloads = check_pages(pages, len(buf) // 4, namespace[2])
                if not payloads:
                    return 0
                state = self._cache_session(*namespace)
            else:
                state = self.mirror.state(session_id, tenant_id)
                payloads = check_pages(pages, len(buf) // 4, state.record.layout)
                if not payloads:
                    return 0
            ids = state.prompt_page_ids(buf)
            fresh = self.pages.fresh(ids, payloads, self.mirror.keys(state.record.user_ref).sealer)

        def record(tx: Tx, state: SessionState, held: set[bytes]) -> None:
            records.add_refs(tx.conn, state.ref, [p for p in held if p not in state.refs], 0)
            records.update_session(tx.conn, state.ref, tx.seq)
            self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)

        def applied(state: SessionState, placement: Placement) -> int:
            return len(placement.inserted)

        return self._store_pages(state, ids, payloads, fresh, [ids[i] for i in payloads], record, applied)

    def rollback(self, session_id: str, version_id: int, *, tenant_id: str | None = None) -> Version:
        """Move the session's head to ``version_id``; the next commit's parent is that version.

        Copies nothing and deletes nothing: later versions stay and still resume.
        """
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            state.version_record(version_id)
            with self._write() as tx:
                state = self.mirror.fresh(tx, state)
                state.version_record(version_id)
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
        check_name("new_session_id", new_session_id)
        if new_session_id.startswith("~"):
            raise InvalidInput("session ids starting with '~' are reserved for dss")
        check_label(label)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            state.version_record(version_id)
            with self._write() as tx:
                state = self.mirror.fresh(tx, state)
                source = state.version_record(version_id)
                rec = state.record
                key = self.mirror.session_key(new_session_id)
                if records.find_sessions(tx.conn, key, rec.tenant_id):
                    raise SessionExists(f"session {new_session_id!r} already exists in tenant {rec.tenant_id!r}")
                ref = records.insert_session(tx.conn, key, self.mirror.seal_name(tx, rec.user_ref, key, new_session_id),
                                             rec.tenant_ref, rec.user_ref, rec.layout_ref, tx.seq)
                buf = state.tokens(version_id)
                stored, sealed = self.mirror.seal_tokens(tx, rec.user_ref, ref, buf)
                vid = records.insert_version(tx.conn, ref, source.version_id, None, 0, len(buf) // 4, stored,
                                             self.mirror.seal_label(tx, rec.user_ref, ref, label), sealed)
                records.update_session(tx.conn, ref, tx.seq, head_id=vid)
                held = records.existing_pages(tx.conn, state.page_ids(version_id))
                records.add_refs(tx.conn, ref, held, vid)
                held_tags = dict.fromkeys(held, vid)
                self.catalog.note(tx, "session", session_ref=ref, user_ref=rec.user_ref)
                new_record = records.session_by_ref(tx.conn, ref)
                assert new_record is not None
                branched = self.mirror.build(new_record, records.session_versions(tx.conn, ref), held_tags, tx.conn)
            return _session_info(branched)

    def versions(self, session_id: str, *, tenant_id: str | None = None) -> list[Version]:
        """Every version of the session, oldest first."""
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            return [state.version(v) for v in state.versions]

    def tokens(self, session_id: str, version_id: int | None = None, *, tenant_id: str | None = None) -> list[int]:
        """The token history of a version (default: the head; empty if the session has none)."""
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            if version_id is None:
                if state.head_id is None:
                    return []
                version_id = state.head_id
            state.version_record(version_id)
            return unpack(state.tokens(version_id))

    def pin(self, session_id: str, version_id: int, *, pinned: bool = True, tenant_id: str | None = None) -> Version:
        """Pin (or unpin) a version: disk eviction never drops pages a pinned version holds."""
        check_flag("pinned", pinned)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            state.version_record(version_id)
            with self._write() as tx:
                state = self.mirror.fresh(tx, state)
                state.version_record(version_id)
                records.set_pinned(tx.conn, version_id, pinned)
                records.update_session(tx.conn, state.ref, tx.seq)
                self.catalog.note(tx, "session", session_ref=state.ref, user_ref=state.record.user_ref)
            state.versions[version_id] = state.versions[version_id]._replace(pinned=pinned)
            state.record = state.record._replace(seq=tx.seq)
            return state.version(version_id)

    # -- resume and pages ------------------------------------------------------------------

    def resume(self, session_id: str, tokens: TokenInput, *, tenant_id: str | None = None) -> ResumeResult:
        """How many leading tokens of ``tokens`` have stored, readable KV, and where.

        Walks the session's trie (every version, not only the head), fills pages it lacks
        from the tenant's registered shared prefixes, then — past the trie's match — looks
        further pages up by their chain hash in the session's namespace. Side-effect free:
        changes nothing, so engines may ask repeatedly.
        """
        buf = view(tokens)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            record = state.record
            return self.matcher.match(buf, record.layout, record.tenant_id, record.user_ref, state)

    def lookup(self, tokens: TokenInput, *, layout: Layout, user_id: str = "anonymous",
               tenant_id: str = "default") -> ResumeResult:
        """Like :meth:`resume` for a request with no session: the tenant's shared prefixes, then
        an exact chain-hash lookup in the namespace ``(tenant_id, user_id)``. Side-effect free."""
        buf = view(tokens)
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_layout(layout)
        with self._reading():
            return self.matcher.match(buf, layout, tenant_id, self.mirror.user_ref(tenant_id, user_id), None)

    def register_prefix(self, tokens: TokenInput, pages: Mapping[int, bytes], *, layout: Layout,
                        tenant_id: str = "default", label: str | None = None) -> Version:
        """Share a prefix (a system prompt, tool definitions) with every user of the tenant.

        Its pages belong to the tenant, not to any user: every session of the tenant with
        the same layout resumes them, erasing a user leaves them, and they are pinned.
        """
        check_layout(layout)
        check_name("tenant_id", tenant_id)
        check_label(label)
        buf = pack(tokens)
        if not buf:
            raise InvalidTokens("a shared prefix needs at least one token")
        check_pages(pages, len(buf) // 4, layout)  # all checked before the tenant's shared session is made
        with self._reading():
            session_id = shared_session_id(layout)
            self._create(session_id, SHARED_USER, tenant_id, layout)
            version = self.commit(session_id, tokens, pages, label=label, tenant_id=tenant_id)
            return self.pin(session_id, version.version_id, tenant_id=tenant_id)

    def shared_prefixes(self, *, tenant_id: str = "default") -> list[Version]:
        """The registered shared prefixes of a tenant (every layout), oldest first."""
        check_name("tenant_id", tenant_id)
        with self._reading():
            out: list[Version] = []
            for info in self.sessions(tenant_id=tenant_id, user_id=SHARED_USER):
                out.extend(self.versions(info.session_id, tenant_id=tenant_id))
            return out

    def read_pages(self, pages: Sequence[PageRef | bytes], *, tenant_id: str | None = None) -> list[bytes | None]:
        """The payloads of pages (``PageRef`` or page id), in order, checksums verified.

        ``None`` for a page no tier holds any more or whose bytes fail verification (that
        page is quarantined: removed from the catalog, recorded in ``quarantine``), and,
        with ``tenant_id``, for a page of another tenant. Reads from disk are batched and
        promote the pages to host.
        """
        ids = check_page_ids(pages)
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading():
            if tenant_id is None:
                return self.pages.read(ids, self._write, self.mirror.sealer_of)
            allowed = self.pages.owned_by(ids, lambda user_ref: self.mirror.tenant_of(user_ref) == tenant_id)
            found = iter(self.pages.read([i for i, ok in zip(ids, allowed) if ok], self._write,
                                         self.mirror.sealer_of))
            return [next(found) if ok else None for ok in allowed]

    # -- erasure ---------------------------------------------------------------------------

    def forget_user(self, user_id: str, *, tenant_id: str = "default", dry_run: bool = False,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Erase everything of one user (GDPR Art. 17) and return the receipt.

        Destroys the user's data key first (crypto-shredding), then deletes every session,
        version, token history and page of theirs on every tier, scrubs the catalog's free
        space, verifies that nothing is left and records the receipt in the audit table.
        Resumes an erasure a crash interrupted. ``dry_run=True`` returns the plan (counts
        and bytes per tier) and changes nothing. Pages of the tenant's shared prefixes stay.
        Raises ``ErasureIncomplete`` when verification finds anything left.
        """
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_flag("dry_run", dry_run)
        check_callback("progress", progress)
        with self._reading():
            if dry_run:
                plan = self.eraser.plan(tenant_id, user_id)
                user_ref = self.mirror.user_ref(tenant_id, user_id)
                plan["tiers"]["host"] = dict(zip(("pages", "bytes"), self._host_usage(user_ref)))
                return plan
            return self.eraser.forget(tenant_id, user_id, progress)

    def audit(self, *, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Receipts of erasures (and other audited operations), oldest first."""
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading():
            with self.catalog.read() as conn:
                rows = records.audit_rows(conn, tenant_id)
            return [{"audit_id": r[0], "kind": r[1], "tenant_id": r[2], "user_id": r[3],
                     "created_at": r[4].isoformat(), "receipt": json.loads(r[5])} for r in rows]

    # -- inspection ------------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only SQL statement on the catalog; any write is refused (``ReadOnlyViolation``)."""
        self._check_open()
        return self.catalog.sql(query, params, max_rows)

    def check(self) -> list[str]:
        """Every broken invariant, as a sentence each; ``[]`` when the store is sound. Read-only."""
        with self._reading():
            return integrity.check(self)

    def stats(self) -> dict[str, Any]:
        """Sizes of the tiers as this process sees them."""
        with self._reading():
            with self.catalog.read() as conn:
                disk_used = records.tier_bytes(conn, "disk")
            return {
                "host": {"pages": len(self.host), "bytes": self.host.used_bytes, "capacity": self.host.capacity_bytes},
                "disk": {"bytes": disk_used, "capacity": self.config.disk_bytes},
            }

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this store is closed")

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Hold the store lock, caught up with other processes; catalog failures surface as
        ``CatalogUnavailable`` or ``CatalogCorrupt``."""
        with self._lock:
            self._check_open()
            with catalog_errors():
                self.mirror.sync()
                yield

    @contextmanager
    def _write(self) -> Iterator[Tx]:
        """A catalog write transaction whose changes this process applies itself."""
        self._check_open()
        with self.catalog.write() as tx:
            yield tx
        self.mirror.wrote(tx.seq)

    def _create(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> Session:
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_layout(layout)
        with self._reading():
            with self._write() as tx:
                key = self.mirror.session_key(session_id)
                found = records.find_sessions(tx.conn, key, tenant_id)
                if found:
                    rec = found[0]
                    if rec.user_id != user_id or rec.layout != layout:
                        raise SessionExists(
                            f"session {session_id!r} exists in tenant {tenant_id!r} with another owner or layout")
                    state = self.mirror.loaded(rec.ref, tx.conn)
                    assert state is not None
                    return _session_info(state)
                tenant_ref = records.ensure_tenant(tx.conn, tenant_id)
                user_ref = records.ensure_user(tx.conn, tenant_ref, user_id)
                ensure_key(tx, user_ref, self._master)
                layout_ref = records.ensure_layout(tx.conn, layout)
                ref = records.insert_session(tx.conn, key, self.mirror.seal_name(tx, user_ref, key, session_id),
                                             tenant_ref, user_ref, layout_ref, tx.seq)
                self.catalog.note(tx, "session", session_ref=ref, user_ref=user_ref)
                record = records.session_by_ref(tx.conn, ref)
                assert record is not None
                state = self.mirror.build(record, [], {}, tx.conn)
            return _session_info(state)

    def _store_pages(self, state: SessionState, ids: list[PageId], payloads: dict[int, bytes], fresh: list[NewPage],
                     wanted: Sequence[PageId], record: Callable[[Tx, SessionState, set[bytes]], Any],
                     applied: Callable[[SessionState, Any], Any]) -> Any:
        """Write the new pages' files (outside the store lock), then record them and run
        ``record(tx, state, held)`` in one catalog transaction, then settle.

        ``held`` is every page of ``wanted`` the session holds once the transaction commits
        (only pages new to the session are looked up in the catalog). Returns what
        ``applied(state, result)`` returns — ``result`` being ``record``'s, or the placement
        when ``record`` returns ``None`` — run under the lock right after the commit.
        """
        placement = Placement()
        committed = False
        try:
            written = self.pages.write(placement, fresh)
            with self._reading():
                with self._write() as tx:
                    state = self.mirror.fresh(tx, state)
                    rec = state.record
                    self.pages.place(tx, placement, user_ref=rec.user_ref, layout_ref=rec.layout_ref,
                                     written=written, wanted=[p for p in wanted if p not in state.refs])
                    evicted = set(placement.evicted)  # this transaction may evict pages the session held
                    held = placement.held | {p for p in wanted if p in state.refs and p not in evicted}
                    result = record(tx, state, held)
                committed = True
                for page_id in evicted:
                    state.refs.pop(page_id, None)
                if isinstance(result, VersionRecord):
                    state.record = state.record._replace(head_id=result.version_id, seq=tx.seq)
                    state.refs.update(dict.fromkeys(held, result.version_id))
                else:
                    state.record = state.record._replace(seq=tx.seq)
                    state.refs.update((p, 0) for p in held if p not in state.refs)
                self.pages.settle(placement, state.ns, ids, payloads)
                return applied(state, result if result is not None else placement)
        except BaseException:
            if not committed:
                self.pages.abort(placement)
            raise

    def _retag(self, tx: Tx, state: SessionState, pages: list[bytes], version_id: int) -> None:
        """Mark ``version_id`` as the newest version holding these pages of the session: one
        statement for each group of pages that carries the same tag and is held whole."""
        groups: dict[int, list[bytes]] = {}
        for page_id in pages:
            groups.setdefault(state.refs[page_id], []).append(page_id)
        sizes = Counter(state.refs.values())
        for tag, group in groups.items():
            if tag == version_id:
                continue
            if len(group) == sizes[tag]:
                records.retag_refs(tx.conn, state.ref, tag, version_id)
            else:
                records.touch_refs(tx.conn, state.ref, group, version_id)

    def _record_version(self, tx: Tx, state: SessionState, buf: bytes, label: str | None) -> VersionRecord:
        """Insert a version of ``buf`` under the head, stored as a delta from the version it
        shares the longest prefix with, and make it the head."""
        rec = state.record
        match = state.trie.walk(buf)
        base_id = state.trie.version_along(match.path[-1], match.num_tokens, state.head) if match.num_tokens else None
        suffix = buf[4 * match.num_tokens:]
        stored, sealed = self.mirror.seal_tokens(tx, rec.user_ref, rec.ref, suffix)
        vid = records.insert_version(tx.conn, rec.ref, state.head_id, base_id, match.num_tokens, len(buf) // 4,
                                     stored, self.mirror.seal_label(tx, rec.user_ref, rec.ref, label), sealed)
        records.update_session(tx.conn, rec.ref, tx.seq, head_id=vid)
        self.catalog.note(tx, "session", session_ref=rec.ref, user_ref=rec.user_ref)
        return VersionRecord(vid, rec.ref, state.head_id, base_id, match.num_tokens, len(buf) // 4, suffix, label,
                             False, records.now())


    def _pinned_pages(self, tx: Tx) -> list[bytes]:
        """Every page of every pinned version (disk eviction never drops them)."""
        pinned: list[bytes] = []
        for session_ref, version_id in records.pinned_versions(tx.conn):
            state = self.mirror.loaded(session_ref, tx.conn)
            if state is not None and version_id in state.positions:
                pinned.extend(state.page_ids(version_id))
        return pinned

    def _host_usage(self, user_ref: int | None) -> tuple[int, int]:
        """Pages and bytes of a namespace in this process's host tier."""
        if user_ref is None:
            return 0, 0
        held = [e.page_id for e in self.index.entries.values() if e.ns.user_ref == user_ref and e.page_id in self.host]
        return len(held), sum(len(p) for p in self.host.get_many(held) if p is not None)

    def _forget_cached(self, user_ref: int) -> tuple[int, int]:
        """Drop every cached trace of a namespace in this process; return the host pages and bytes dropped."""
        usage = self._host_usage(user_ref)
        self.mirror.forget_user(user_ref)
        return usage

    def _cache_session(self, tenant_id: str, user_id: str, layout: Layout) -> SessionState:
        """The session holding pages saved without a session, one per namespace and layout
        (made on first use; the arguments were checked by :func:`_sessionless`)."""
        session_id = f"{CACHE_PREFIX}{layout.digest.hex()[:16]}-{_short(user_id)}"
        try:
            state = self.mirror.state(session_id, tenant_id)
        except UnknownSession:
            self._create(session_id, user_id, tenant_id, layout)
            state = self.mirror.state(session_id, tenant_id)
        if state.record.user_id != user_id or state.record.layout != layout:
            raise SessionExists(f"the page cache {session_id!r} of tenant {tenant_id!r} belongs to another user")
        return state


# -- helpers ---------------------------------------------------------------------------------


def _sessionless(tenant_id: Any, user_id: Any, layout: Any) -> tuple[str, str, Layout]:
    """The namespace and layout of a save without a session, checked."""
    if tenant_id is None or user_id is None or layout is None:
        raise InvalidInput("save_pages without a session needs tenant_id, user_id and layout")
    check_name("user_id", user_id)
    check_name("tenant_id", tenant_id)
    return tenant_id, user_id, check_layout(layout)


def _short(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=8).hexdigest()


def _session_info(state: SessionState) -> Session:
    rec = state.record
    return Session(rec.session_id, rec.tenant_id, rec.user_id, rec.layout,
                   VersionId(state.head_id) if state.head_id is not None else None, len(state.versions),
                   rec.created_at, rec.last_access)


def _session_of(rec: SessionRecord, num_versions: int) -> Session:
    return Session(rec.session_id, rec.tenant_id, rec.user_id, rec.layout,
                   VersionId(rec.head_id) if rec.head_id is not None else None, num_versions, rec.created_at,
                   rec.last_access)
