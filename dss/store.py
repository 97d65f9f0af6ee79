"""The embedded store: sessions, versions, resume, pages across host and disk.

:class:`Store` is the public API, a thin facade: it validates arguments, asks
:mod:`dss.versions` for the :class:`~dss.catalog.change.Change` a write makes, applies it
(:meth:`Store._apply`: segment files, one catalog transaction, this process's caches), and
answers reads from the mirror (:mod:`dss.mirror`) and the matcher (:mod:`dss.matcher`).
Every method is thread-safe (one lock per store) and several processes may open the same
store folder: each catches up with the others' writes before it answers.

Contracts that hold for every method:

* An argument that is wrong raises a :class:`dss.core.errors.DssError` subclass and changes
  nothing.
* A method that returns after a write has committed it durably (catalog transaction and
  fsynced page files); a process killed at any instant loses no returned commit and
  leaves no half-visible version.
* ``resume`` never counts a page unless some tier holds its bytes under this session's
  namespace and layout; bytes that fail their checksum on read are a miss and are
  quarantined, never returned. The remote tier (Redis, a cache shared by the nodes of a
  fleet) is the one exception to "holds": a page the catalog has on another node's disk
  is counted as ``remote`` without asking Redis, which may have evicted it; reading it then
  returns ``None`` (a miss), never other bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dss import integrity, policy, versions
from dss.compaction import Compaction, Compactor
from dss.catalog import erasures, pages, sessions
from dss.catalog.change import Applied, Change
from dss.catalog.database import catalog_errors, now, open_catalog
from dss.core.config import StoreConfig
from dss.core.crypto import read_master_key
from dss.core.epoch import Epoch
from dss.core.errors import (ConfigError, DssError, ErasureInProgress, ErasureIncomplete, InternalError, InvalidInput,
                             InvalidTokens)
from dss.core.tokens import TOKEN_BYTES, TokenInput, pack, unpack, view
from dss.core.types import Layout, PageId, PageRef, Session, SqlResult, Version
from dss.core.validate import (
    check_callback,
    check_flag,
    check_label,
    check_layout,
    check_name,
    check_page_ids,
    check_pages,
)
from dss.erase import Eraser
from dss.erasure import AuditEntry, Plan, Receipt, stored
from dss.folder import adopt_folder, folder_lock
from dss.keys import DataKeys, adopt_master_key
from dss.matcher import SHARED_USER, Matcher, shared_session_id
from dss.lsh import LshIndex, Settings
from dss.mirror import Mirror
from dss.mover import Mover
from dss.nearest import Decode, Explanation, Nearest
from dss.pageindex import PageIndex
from dss.pages import PageStore
from dss.policy import Placement
from dss.residency import for_catalog as device_tier
from dss.resume import Candidate, Rates, ResumeResult
from dss.state import SessionState, session_of
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.remote import RemoteTier
from dss.writer import Guard, Writer

log = logging.getLogger("dss.store")

CACHE_PREFIX = "~cache-"
"""Session ids of the sessions holding pages saved without a session (one per namespace and layout)."""


class Store:
    """A dialogue state store opened in this process (see the module docstring)."""

    def __init__(self, config: StoreConfig) -> None:
        """Open the store; a refused open (``DssError``) releases what it opened, and leaves
        no master key file it made."""
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
        self.remote = None if config.remote_url is None else RemoteTier(  # a bad URL is refused before anything is made
            config.remote_url.get_secret_value(), prefix=config.remote_prefix, timeout_s=config.remote_timeout_s,
            max_pending_bytes=config.remote_pending_bytes)
        with folder_lock(home):
            hex_key = config.master_key.get_secret_value() if config.master_key else None
            master = read_master_key(config.master_key_file, home, hex_key)
            sql_url = config.sql_url.get_secret_value() if config.sql_url else None
            self.catalog = open_catalog(config.url, fsync=config.fsync, sql_timeout_s=config.sql_timeout_s,
                                        sql_url=sql_url)
            self.catalog.ensure_schema()
            self._master = adopt_master_key(self.catalog, master, config.master_key_file)
            self.node = adopt_folder(self.catalog, home, config.node_id)
            self._epoch = Epoch(home / "epoch")
        self.listener = None
        if not self.catalog.is_sqlite:  # (imported here: psycopg is there only with a PostgreSQL catalog)
            from dss.catalog.listen import FeedListener

            self.listener = FeedListener(self.catalog.engine.url, self._epoch, poll_s=config.feed_poll_s)
        self.disk = DiskTier(home, fsync=config.fsync)
        self.placement = Placement(policy_settings(config), config.clock or time.monotonic)
        self.host = HostTier(config.host_bytes, choose=self.placement.host_room)
        self.device = device_tier(_catalog_key(config), config.residency_ttl_s)
        self.index = PageIndex(self.host, has_remote=self.remote is not None, resident=self.device.held)
        self.keys = DataKeys(self.catalog, self._master, encrypt=config.encrypt)
        self.mirror = Mirror(self.catalog, self._epoch, self.index, self.keys, self.node.ref)
        self.pages = PageStore(self.catalog, self.disk, self.host, self.index, self.keys, node_ref=self.node.ref,
                               disk_bytes=config.disk_bytes, segment_bytes=config.segment_bytes,
                               placement=self.placement, tenant_of=self.mirror.tenant_of, remote=self.remote)
        speeds = {"host": config.host_read_gbps * 1e9, "disk": config.disk_read_gbps * 1e9}
        if self.remote is not None:
            speeds["remote"] = config.remote_read_gbps * 1e9
        self.rates = Rates(speeds, config.recompute_tokens_per_s)
        self.matcher = Matcher(self.mirror, self.index, self.rates, self.device)
        self._near: Nearest | None = None
        if config.approximate or config.lsh_redis_url is not None:
            self._nearest_index()  # now: a missing datasketch is a ConfigError at open; Redis is kept current
        self.eraser = Eraser(self.catalog, self.mirror, self.pages)
        self.guard = Guard(self.mirror, self.pages)
        self.writer = Writer(self.catalog, self.mirror, self.pages, self.keys, self.index, self.guard, self._master,
                             group_commit=config.group_commit)
        self.mover = Mover(self.guard, self.pages, self.writer, self.catalog, self.placement,
                           disk_bytes=config.disk_bytes, interval_s=config.mover_interval_s,
                           batch=config.move_batch_pages)
        self.pages.filled = self.mover.wake
        self.compactor = Compactor(self.catalog, self.disk, self.writer.apply, node_ref=self.node.ref,
                                   dead_share=config.compact_dead_share, segment_bytes=config.segment_bytes)
        self._compacting = threading.Lock()
        if config.compact_auto:
            self.pages.before_full = self._before_full
        with self.catalog.read() as conn:
            removed = self.disk.recover(set(pages.all_segments(conn, "disk", self.node.ref)))
        if removed:
            log.info("removed %d page files left behind by dead writers", len(removed))
        try:
            finished = self.eraser.resume_all()
        except ErasureIncomplete as exc:  # e.g. the remote tier is down: the next open (or forget_user) finishes it
            log.warning("an erasure a crash had interrupted is still unfinished: %s", exc)
        else:
            if finished:
                log.info("finished %d erasures a crash had interrupted", len(finished))
        if config.approximate:
            built = self._nearest_index().build_all()
            log.info("LSH index: %d namespaces and layouts indexed at open", built)
        self.mover.record()
        if config.mover:
            self.mover.start()

    def close(self) -> None:
        """Release files and connections. Idempotent; the store is unusable afterwards."""
        mover = getattr(self, "mover", None)
        if mover is not None:
            mover.close()  # outside the lock: its batch in progress takes it
            if not self.guard.is_closed:
                try:
                    mover.record()  # best effort: closing never fails for the statistics table
                except Exception as exc:  # noqa: BLE001
                    log.warning("could not record the tier statistics at close: %s", exc)
        with self.guard.lock:
            if not self.guard.is_closed:
                self.guard.is_closed = True
                self._release()

    def _release(self) -> None:
        """Close the files and connections opened so far (all of them once open)."""
        remote = getattr(self, "remote", None)
        if remote is not None:
            if not remote.flush(timeout_s=4 * self.config.remote_timeout_s):
                log.warning("closing with %d bytes not yet written to the remote tier", remote.pending_bytes)
            remote.close()
        for part in (getattr(self, "listener", None), getattr(self, "disk", None), getattr(self, "_epoch", None),
                     getattr(self, "catalog", None)):
            if part is not None:
                part.close()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.guard.is_closed

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
        return self._create(session_id, user_id, tenant_id, layout).info()

    def session(self, session_id: str, *, tenant_id: str | None = None) -> Session:
        """The session's owner, layout and head. Raises ``UnknownSession``."""
        with self._reading():
            return self.mirror.state(session_id, tenant_id).info()

    def sessions(self, *, tenant_id: str | None = None, user_id: str | None = None) -> list[Session]:
        """Every session (optionally of one tenant or user), oldest first."""
        check_name("tenant_id", tenant_id, optional=True)
        check_name("user_id", user_id, optional=True)
        with self._reading(), self.catalog.read() as conn:
            out = []
            for rec, count in sessions.list_sessions(conn, tenant_id, user_id):
                try:
                    out.append(session_of(self.mirror.opened(rec, conn), count))
                except ErasureInProgress:  # the owner's key is gone: the erasure deletes the row next
                    continue
            return out

    def count_sessions(self) -> int:
        """How many sessions the store holds (every tenant)."""
        with self._reading(), self.catalog.read() as conn:
            return sessions.count_sessions(conn)

    def delete_session(self, session_id: str, *, tenant_id: str | None = None) -> int:
        """Delete a session and its versions; release the pages no other session references.

        Returns the number of pages released (gone from every tier).
        """
        applied = self.writer.write(session_id, tenant_id, versions.delete)
        if applied.thinned:
            self._auto_compact(applied.thinned)
        return len(applied.dropped)

    # -- versions --------------------------------------------------------------------------

    def commit(self, session_id: str, tokens: TokenInput, pages: Mapping[int, bytes] | None = None, *,
               label: str | None = None, tenant_id: str | None = None) -> Version:
        """Record ``tokens`` as a new version of the session, child of the head, and make it the head.

        ``pages[i]`` is the KV of ``tokens[i*page_tokens:(i+1)*page_tokens]``, exactly
        ``layout.page_bytes`` bytes; only full pages may be given. Pages already stored in
        the namespace are not written again. Returns the new version.
        """
        buf = pack(tokens)
        check_label(label)
        applied = self.writer.write(session_id, tenant_id, versions.commit, buf, pages, label)
        version = self._version(applied)
        if applied.stored:
            state = self.writer.state_of(applied)
            self.placement.note_tokens([PageId(r.page_id) for r in applied.stored], state.record.layout.page_tokens)
        return version

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
        if session_id is None:
            tenant_id, user_id, layout = _sessionless(tenant_id, user_id, layout)
            if not check_pages(pages, len(buf) // TOKEN_BYTES, layout):  # before the page-cache session is made
                return 0
            state = self._cache_session(tenant_id, user_id, layout)
            session_id, tenant_id = state.session_id, state.record.tenant_id
        applied = self.writer.write(session_id, tenant_id, versions.save, buf, pages)
        return len(applied.stored)

    def rollback(self, session_id: str, version_id: int, *, tenant_id: str | None = None) -> Version:
        """Move the session's head to ``version_id``; the next commit's parent is that version.

        Copies nothing and deletes nothing: later versions stay and still resume.
        """
        applied = self.writer.write(session_id, tenant_id, versions.rollback, version_id)
        return self._version(applied, version_id)

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
        return self.writer.branch(session_id, tenant_id, version_id, new_session_id, label).info()

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
        applied = self.writer.write(session_id, tenant_id, versions.pin, version_id, pinned)
        return self._version(applied, version_id)

    # -- resume and pages ------------------------------------------------------------------

    def resume(self, session_id: str, tokens: TokenInput, *, tenant_id: str | None = None,
               approximate: bool | None = None) -> ResumeResult:
        """How many leading tokens of ``tokens`` have stored, readable KV, and where.

        Walks the session's trie (every version, not only the head), fills pages it lacks
        from the tenant's registered shared prefixes, then — past the trie's match — looks
        further pages up by their chain hash in the session's namespace. With
        ``approximate=True`` (default: the ``approximate`` setting), when that matched less
        than ``lsh_min_share`` of the prompt, versions of the namespace and layout that
        MinHash-LSH proposes are compared token by token and the longest exact common prefix
        with stored pages wins (``source="lsh"``); the result names the nearest one and how
        many were tried. Only exact prefixes are ever reported. Side-effect free: changes
        nothing (but counts a divergence position), so engines may ask repeatedly. Pages
        another node stored count as ``tiers["remote"]`` (see the module docstring).
        """
        buf = view(tokens)
        approximate = self._approximate(approximate)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            record = state.record
            result = self.matcher.match(buf, record.layout, record.tenant_id, record.user_ref, state)
            if approximate:
                result = self._nearest_index().improve(result, buf, record.layout, record.user_ref, state,
                                                       record.tenant_id)
            return result

    def lookup(self, tokens: TokenInput, *, layout: Layout, user_id: str = "anonymous",
               tenant_id: str = "default", approximate: bool | None = None) -> ResumeResult:
        """Like :meth:`resume` for a request with no session: the tenant's shared prefixes, then
        an exact chain-hash lookup in the namespace ``(tenant_id, user_id)``, then (``approximate``)
        verified LSH candidates of the namespace. Side-effect free."""
        buf = view(tokens)
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_layout(layout)
        approximate = self._approximate(approximate)
        with self._reading():
            user_ref = self.mirror.user_ref(tenant_id, user_id)
            result = self.matcher.match(buf, layout, tenant_id, user_ref, None)
            if approximate:
                result = self._nearest_index().improve(result, buf, layout, user_ref, None, tenant_id)
            return result

    def nearest(self, tokens: TokenInput, *, session_id: str | None = None, tenant_id: str | None = None,
                user_id: str | None = None, layout: Layout | None = None, k: int = 5) -> list[Candidate]:
        """The ``k`` stored versions nearest ``tokens`` (exact Jaccard of token shingles, highest
        first), each verified token by token: estimated and exact Jaccard, exact common prefix,
        first divergence, reusable tokens.

        The search covers the namespace and layout of ``session_id`` (its own versions always
        compared), or, without a session, the namespace ``(tenant_id or "default", user_id or
        "anonymous")`` and ``layout``; never any other. Needs datasketch (``ConfigError``).
        Side-effect free.
        """
        buf = view(tokens)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 100:
            raise InvalidInput(f"k must be an int from 1 to 100, got {k!r}")
        with self._reading():
            near = self._nearest_index()
            layout, tenant, user_ref, state = self._scope(session_id, tenant_id, user_id, layout)
            if user_ref is None:
                return []
            return near.candidates(buf, layout, user_ref, k=k, extra=state)[0]

    def explain(self, session_id: str | None, tokens: TokenInput, *, tenant_id: str | None = None,
                user_id: str | None = None, layout: Layout | None = None, decode: Decode | None = None,
                context: int = 8) -> Explanation:
        """Why exact reuse of ``tokens`` stops where it does: what resume reuses now, the nearest
        stored version (the session's own or any of its namespace and layout), the first
        position where the prompt diverges from it, ``context`` tokens on both sides (decoded
        with ``decode(list[int]) -> str`` when given), where the two run together again, how
        many tokens would have been reused without the divergence, and the tenant's recurring
        divergence positions. Scope as :meth:`nearest`. Counts the divergence; changes no data.
        """
        buf = view(tokens)
        if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= 4096:
            raise InvalidInput(f"context must be an int from 0 to 4096, got {context!r}")
        check_callback("decode", decode)
        with self._reading():
            near = self._nearest_index()
            layout, tenant, user_ref, state = self._scope(session_id, tenant_id, user_id, layout)
            result = self.matcher.match(buf, layout, tenant, user_ref, state)
            return near.explain(result, buf, layout, user_ref, state, tenant, decode=decode, context=context)

    def prefetch_candidates(self, tokens: TokenInput, *, session_id: str | None = None, tenant_id: str | None = None,
                            user_id: str | None = None, layout: Layout | None = None, promote: bool = True) -> list[bytes]:
        """Ids of the pages the nearest near-duplicates let ``tokens`` reuse (their exact common
        prefix with stored pages), longest first; with ``promote`` they are read now, which
        brings disk pages into the host tier ahead of the request. Scope as :meth:`nearest`."""
        check_flag("promote", promote)
        buf = view(tokens)
        with self._reading():
            near = self._nearest_index()
            layout, tenant, user_ref, state = self._scope(session_id, tenant_id, user_id, layout)
            if user_ref is None:
                return []
            found, _ = near.candidates(buf, layout, user_ref, k=5, extra=state)
            if not found:
                return []
            best = max(found, key=lambda c: c.matched_tokens)
            owner = self.mirror.state(best.session_id, tenant)
            ids = [bytes(p) for p in owner.page_ids(best.version_id)[: best.matched_tokens // layout.page_tokens]]
        if promote and ids:
            self.read_pages(ids)
        return ids

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
        check_pages(pages, len(buf) // TOKEN_BYTES, layout)  # all checked before the tenant's shared session is made
        session_id = shared_session_id(layout)
        self._create(session_id, SHARED_USER, tenant_id, layout)
        version = self.commit(session_id, tokens, pages, label=label, tenant_id=tenant_id)
        return self.pin(session_id, version.version_id, tenant_id=tenant_id)

    def shared_prefixes(self, *, tenant_id: str = "default") -> list[Version]:
        """The registered shared prefixes of a tenant (every layout), oldest first."""
        check_name("tenant_id", tenant_id)
        out: list[Version] = []
        for info in self.sessions(tenant_id=tenant_id, user_id=SHARED_USER):
            out.extend(self.versions(info.session_id, tenant_id=tenant_id))
        return out

    def read_pages(self, pages: Sequence[PageRef | bytes], *, tenant_id: str | None = None,
                   load: bool = True) -> list[bytes | None]:
        """The payloads of pages (``PageRef`` or page id), in order, checksums verified.

        ``None`` for a page no tier holds any more or whose bytes fail verification (that
        page is quarantined: removed from the catalog, recorded in ``quarantine``), and,
        with ``tenant_id``, for a page of another tenant. Reads from disk are batched. With
        ``load=True`` (an engine waits for these pages) they are promoted to host; with
        ``load=False`` (inspection, export) only as the policy allows: after repeated access
        within ``promote_interval_s``, never during a demoted page's cool-down.
        """
        ids = check_page_ids(pages)
        check_name("tenant_id", tenant_id, optional=True)
        check_flag("load", load)
        with self._reading():
            if tenant_id is not None:
                owners = self.pages.owners(ids)
                allowed = [o is not None and self.mirror.tenant_of(o) == tenant_id for o in owners]
                ids = [i for i, ok in zip(ids, allowed) if ok]
            read = self.pages.read(ids, load=load)
        if read.bad:
            applied = self.writer.apply(Change(quarantine=tuple(read.bad)))
            if applied.thinned:
                self._auto_compact(applied.thinned)
        if tenant_id is None:
            return read.payloads
        found = iter(read.payloads)
        return [next(found) if ok else None for ok in allowed]

    def page_sizes(self, page_ids: Sequence[bytes], *, tenant_id: str | None = None) -> dict[bytes, int]:
        """``page_id -> size`` of the pages the catalog holds (of ``tenant_id`` only, if given)."""
        ids = check_page_ids(page_ids)
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading(), self.catalog.read() as conn:
            owners = pages.page_owners(conn, ids)
        return {p: size for p, (tenant, size) in owners.items() if tenant_id is None or tenant == tenant_id}

    # -- erasure ---------------------------------------------------------------------------

    def forget_user(self, user_id: str, *, tenant_id: str = "default", dry_run: bool = False,
                    progress: Callable[[str], None] | None = None) -> Receipt | Plan:
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
                return self.eraser.plan(tenant_id, user_id)
            return self.eraser.forget(tenant_id, user_id, progress)

    def audit(self, *, tenant_id: str | None = None) -> list[AuditEntry]:
        """Receipts of erasures (and other audited operations), oldest first."""
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading(), self.catalog.read() as conn:
            rows = erasures.audit_rows(conn, tenant_id)
        return [AuditEntry(audit_id=r.id, kind=r.kind, tenant_id=r.tenant_id, user_id=r.user_id,
                           created_at=r.created_at.isoformat(), receipt=stored(Receipt, r.receipt))
                for r in rows]

    # -- engines: the device tier -----------------------------------------------------------

    def mark_resident(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """Engine instance ``engine_id`` holds these pages in its own KV memory (the ``device``
        tier): ``resume`` reports them there (those host or disk holds too), and
        :meth:`residency` counts them for it. Kept in this process's memory, shared by the
        stores of this process on the same catalog; each call renews the engine's lease
        (``residency_ttl_s``; an empty list only renews it)."""
        check_name("engine_id", engine_id)
        ids = check_page_ids(page_ids)
        self._check_open()
        self.device.mark(engine_id, ids)

    def evicted(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """Engine instance ``engine_id`` no longer holds these pages (it reused their memory)."""
        check_name("engine_id", engine_id)
        ids = check_page_ids(page_ids)
        self._check_open()
        self.device.evict(engine_id, ids)

    def forget_engine(self, engine_id: str) -> int:
        """Engine instance ``engine_id`` went away: forget the pages it held; returns how many."""
        check_name("engine_id", engine_id)
        self._check_open()
        return self.device.forget(engine_id)

    def residency(self, session_id: str, *, tenant_id: str | None = None) -> dict[str, int]:
        """``{engine_id: pages}``: how many pages of the session's head version each live engine
        holds (engines holding none are left out), for a router to send the session's next
        request where its KV already is."""
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            if state.head_id is None:
                return {}
            record = state.record
            match = self.matcher.match(state.tokens(state.head_id), record.layout, record.tenant_id, record.user_ref,
                                       state)
            return self.device.holders(PageId(p.page_id) for p in match.pages)

    # -- compaction ------------------------------------------------------------------------

    def compact(self, *, dry_run: bool = False) -> Compaction:
        """Rewrite the disk tier's sparse segment files (dead bytes at least
        ``compact_dead_share`` of their size): live pages are copied into new files, the
        catalog points at the copies in one transaction per new file, and the old files are
        deleted after it committed, so dead bytes stop counting against ``disk_bytes``.
        ``dry_run=True`` says what it would do and changes nothing. Safe against a kill at
        any instant and against other processes writing, reading or compacting meanwhile.
        Runs by itself (``compact_auto``) after writes that drop pages and before a full
        disk evicts live pages."""
        check_flag("dry_run", dry_run)
        with self._reading():
            pass
        with self._compacting, catalog_errors():
            try:
                return self.compactor.run(dry_run=dry_run)
            except OSError as exc:
                raise InternalError(f"compaction could not write a page file ({exc.strerror or exc}); the files "
                                    "compacted before stay compacted, the others as they were") from None

    def _auto_compact(self, thinned: Sequence[int] | None = None) -> None:
        """Compact if some segment (of ``thinned``: those a write just thinned out) is sparse;
        never fails the write that asked (``compact_auto``)."""
        if not self.config.compact_auto or not self._compacting.acquire(blocking=False):
            return
        try:
            with catalog_errors():
                if self.compactor.has_sparse(thinned):
                    self.compactor.run()
        except (DssError, OSError) as exc:
            log.warning("compaction failed (the store is unchanged by it): %s", exc)
        finally:
            self._compacting.release()

    def _before_full(self, need: int) -> None:
        """Before ``need`` bytes of page files are written: if they would not fit the disk tier,
        compact first, so dead bytes go before live pages are evicted."""
        with self.catalog.read() as conn:
            used = pages.tier_bytes(conn, "disk", self.node.ref)
        if used + need > self.config.disk_bytes:
            self._auto_compact()

    # -- inspection ------------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only SQL statement on the catalog; any write is refused (``ReadOnlyViolation``)."""
        self._check_open()
        return self.catalog.sql(query, params, max_rows)

    def check(self) -> list[str]:
        """Every broken invariant, as a sentence each; ``[]`` when the store is sound. Read-only."""
        with self._reading():
            problems = integrity.check(self.catalog, self.mirror, self.disk, self.host, self.config.disk_bytes)
            if self._near is not None:
                problems += self._near.problems()
            return problems

    def stats(self) -> dict[str, Any]:
        """Tiers as this process sees them: per tier its pages, bytes, capacity, watermarks
        (bytes) and what the policy did (``hits``, ``misses``, ``promotions`` into it,
        ``demotions`` out of it, ``evictions`` from it with no copy left below, ``moved_bytes``,
        ``inline_evictions`` made by a foreground write rather than the mover); ``prefetch``:
        pages ``issued`` (moved up), ``hits`` (then read from host), ``wasted`` (left host
        unread); ``policy``: its name and mover passes; ``erasures``: the erasures not finished
        yet (``open``, and ``oldest_open_s``, seconds since the oldest of them started, 0 when
        none); ``lsh``: this process's MinHash-LSH index (indexes, entries, capacity, indexes
        dropped to stay within it, bands and rows, storage ``"memory"``, ``"redis"`` or
        ``"none"`` before approximate matching was first used)."""
        with self._reading(), self.catalog.read() as conn:
            disk_used = pages.tier_bytes(conn, "disk", self.node.ref)
            disk_pages = pages.count_located(conn, "disk", self.node.ref)
            open_jobs = erasures.open_jobs(conn)
            lsh = self._near.lsh.stats() if self._near is not None else {
                "indexes": 0, "entries": 0, "capacity": self.config.lsh_max_entries, "storage": "none"}
        oldest = min((job.started_at for job in open_jobs), default=None)
        settings = self.placement.settings
        out: dict[str, Any] = {
            "host": {"pages": len(self.host), "bytes": self.host.used_bytes, "capacity": self.host.capacity_bytes},
            "disk": {"pages": disk_pages, "bytes": disk_used, "capacity": self.config.disk_bytes},
            "erasures": {"open": len(open_jobs),
                         "oldest_open_s": (now() - oldest).total_seconds() if oldest else 0.0},
            "lsh": lsh,
        }
        for tier in policy.TIERS:
            high, low = policy.watermarks(settings, tier, out[tier]["capacity"])
            out[tier].update({"high_watermark": high, "low_watermark": low})
            counts = self.placement.counts[tier]
            out[tier].update({name: int(counts[name]) for name in policy.COUNTERS})
        out["prefetch"] = {name: int(n) for name, n in self.placement.prefetch.items()}
        out["policy"] = {"name": settings.policy, "mover_passes": self.mover.passes}
        return out

    def run_mover(self) -> dict[str, int]:
        """Run one pass of the mover now, in this thread: demote host and evict disk down to
        their low marks where they passed their high marks, then record this process's tiers in
        the ``tier_policy`` table. Returns the pages moved per tier."""
        self._check_open()
        moved = self.mover.run()
        self.mover.record()
        return moved

    def prefetch(self, session_id: str, *, tenant_id: str | None = None, wait: bool = False) -> int:
        """Move the pages of the session's head that only disk holds up to host, in the
        background (a chat backend calls this when the user starts typing), and return at once
        with how many pages will move (``wait=True``: after they moved). A prefetched page read
        from host later counts as a prefetch hit; one that leaves host unread, as wasted."""
        check_flag("wait", wait)
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            if state.head_id is None:
                return 0
            record = state.record
            buf = state.tokens(state.head_id)
            result = self.matcher.match(buf, record.layout, record.tenant_id, record.user_ref, state)
            ids = [ref.page_id for ref in result.pages if ref.tier == "disk"]
        if not ids:
            return 0
        batch = self.config.move_batch_pages

        def move() -> None:
            for start in range(0, len(ids), batch):
                with self._reading():
                    read = self.pages.read(ids[start:start + batch], prefetch=True)
                if read.bad:
                    self.writer.apply(Change(quarantine=tuple(read.bad)))

        if wait or not self.mover.submit(move):
            move()
        return len(ids)

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        self.guard.check_open()

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.reading()

    def _approximate(self, approximate: bool | None) -> bool:
        if approximate is None:
            return self.config.approximate
        check_flag("approximate", approximate)
        return approximate

    def _nearest_index(self) -> Nearest:
        """The near-duplicate search, its index made on first use (``ConfigError`` without datasketch)."""
        if self._near is None:
            config = self.config
            settings = Settings(config.lsh_threshold, config.lsh_permutations, config.lsh_shingle_tokens,
                                config.lsh_window_tokens, config.lsh_max_entries)
            secret = config.lsh_redis_url or getattr(config, "remote_url", None)  # the remote tier's Redis, if any
            url = secret.get_secret_value() if secret is not None else None
            store_tag = hashlib.blake2b(self._master, digest_size=6, person=b"dss-lsh-store").hexdigest()
            lsh = LshIndex(settings, redis_url=url, redis_prefix=f"{config.lsh_redis_prefix}:{store_tag}")
            self.mirror.lsh = lsh
            self._near = Nearest(self.mirror, self.index, lsh, self.rates, config.lsh_min_share)
        return self._near

    def _scope(self, session_id: str | None, tenant_id: str | None, user_id: str | None,
               layout: Layout | None) -> tuple[Layout, str, int | None, SessionState | None]:
        """Layout, tenant, namespace and session a near-duplicate search covers (checked)."""
        if session_id is not None:
            if user_id is not None or layout is not None:
                raise InvalidInput("give a session_id, or user_id and layout, not both")
            state = self.mirror.state(session_id, tenant_id)
            return state.layout, state.record.tenant_id, state.user_ref, state
        if layout is None:
            raise InvalidInput("without a session_id, a layout is needed")
        check_layout(layout)
        tenant = tenant_id if tenant_id is not None else "default"
        user = user_id if user_id is not None else "anonymous"
        check_name("tenant_id", tenant)
        check_name("user_id", user)
        return layout, tenant, self.mirror.user_ref(tenant, user), None

    def _version(self, applied: Applied, version_id: int | None = None) -> Version:
        state = self.writer.state_of(applied)
        with self._reading():
            return state.version(version_id if version_id is not None else applied.version_id)

    def _create(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> SessionState:
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_layout(layout)
        return self.writer.create(session_id, user_id, tenant_id, layout)

    def _cache_session(self, tenant_id: str, user_id: str, layout: Layout) -> SessionState:
        """The session holding pages saved without a session, one per namespace and layout
        (made on first use; the arguments were checked by :func:`_sessionless`)."""
        session_id = f"{CACHE_PREFIX}{layout.digest.hex()[:16]}-{_short(user_id)}"
        state = self._create(session_id, user_id, tenant_id, layout)
        return state


# -- helpers ---------------------------------------------------------------------------------


def policy_settings(config: StoreConfig) -> policy.Settings:
    """The placement policy's settings from a store's configuration."""
    return policy.Settings(
        policy=config.policy, weights=config.policy_weights, frequency_half_life_s=config.frequency_half_life_s,
        recency_half_life_s=config.recency_half_life_s, promote_after=config.promote_after,
        promote_interval_s=config.promote_interval_s, cooldown_s=config.cooldown_s,
        host_high=config.host_high_watermark, host_low=config.host_low_watermark,
        disk_high=config.disk_high_watermark, disk_low=config.disk_low_watermark,
        host_user_quota=config.host_user_quota, host_tenant_quota=config.host_tenant_quota,
        disk_user_quota=config.disk_user_quota, disk_tenant_quota=config.disk_tenant_quota,
        move_batch_pages=config.move_batch_pages, disk_bytes_per_s=config.disk_read_gbps * 1e9,
        recompute_tokens_per_s=config.recompute_tokens_per_s)


def _catalog_key(config: StoreConfig) -> str:
    """What names a catalog in this process (the residency of engines is shared per catalog)."""
    return config.catalog_url or f"sqlite:///{(config.home / 'catalog.db').resolve()}"


def _sessionless(tenant_id: Any, user_id: Any, layout: Any) -> tuple[str, str, Layout]:
    """The namespace and layout of a save without a session, checked."""
    if tenant_id is None or user_id is None or layout is None:
        raise InvalidInput("save_pages without a session needs tenant_id, user_id and layout")
    check_name("user_id", user_id)
    check_name("tenant_id", tenant_id)
    return tenant_id, user_id, check_layout(layout)


def _short(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
