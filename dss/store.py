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
  quarantined, never returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dss import integrity, versions
from dss.catalog import erasures, pages, sessions
from dss.catalog.change import Applied, Change
from dss.catalog.database import catalog_errors, open_catalog
from dss.core.config import StoreConfig
from dss.core.crypto import read_master_key
from dss.core.epoch import Epoch
from dss.core.errors import ConfigError, ErasureInProgress, InvalidInput, InvalidTokens
from dss.core.tokens import TOKEN_BYTES, TokenInput, pack, unpack, view
from dss.core.types import Layout, PageRef, Session, SqlResult, Version
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
from dss.mirror import Mirror
from dss.pageindex import PageIndex
from dss.pages import PageStore
from dss.resume import Rates, ResumeResult
from dss.state import SessionState, session_of
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
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
        with folder_lock(home):
            hex_key = config.master_key.get_secret_value() if config.master_key else None
            master = read_master_key(config.master_key_file, home, hex_key)
            sql_url = config.sql_url.get_secret_value() if config.sql_url else None
            self.catalog = open_catalog(config.url, fsync=config.fsync, sql_timeout_s=config.sql_timeout_s,
                                        sql_url=sql_url)
            self.catalog.ensure_schema()
            self._master = adopt_master_key(self.catalog, master, config.master_key_file)
            adopt_folder(self.catalog, home)
            self._epoch = Epoch(home / "epoch")
        self.disk = DiskTier(home, fsync=config.fsync)
        self.host = HostTier(config.host_bytes)
        self.index = PageIndex(self.host)
        self.keys = DataKeys(self.catalog, self._master, encrypt=config.encrypt)
        self.mirror = Mirror(self.catalog, self._epoch, self.index, self.keys)
        self.pages = PageStore(self.catalog, self.disk, self.host, self.index, self.keys,
                               disk_bytes=config.disk_bytes, segment_bytes=config.segment_bytes)
        self.rates = Rates({"host": config.host_read_gbps * 1e9, "disk": config.disk_read_gbps * 1e9},
                           config.recompute_tokens_per_s)
        self.matcher = Matcher(self.mirror, self.index, self.rates)
        self.eraser = Eraser(self.catalog, self.mirror, self.disk, self.host)
        self.guard = Guard(self.mirror)
        self.writer = Writer(self.catalog, self.mirror, self.pages, self.keys, self.index, self.guard, self._master,
                             group_commit=config.group_commit)
        with self.catalog.read() as conn:
            removed = self.disk.recover(set(pages.all_segments(conn, "disk")))
        if removed:
            log.info("removed %d page files left behind by dead writers", len(removed))
        finished = self.eraser.resume_all()
        if finished:
            log.info("finished %d erasures a crash had interrupted", len(finished))

    def close(self) -> None:
        """Release files and connections. Idempotent; the store is unusable afterwards."""
        with self.guard.lock:
            if not self.guard.is_closed:
                self.guard.is_closed = True
                self._release()

    def _release(self) -> None:
        """Close the files and connections opened so far (all of them once open)."""
        for part in (getattr(self, "disk", None), getattr(self, "_epoch", None), getattr(self, "catalog", None)):
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
        return len(self.writer.write(session_id, tenant_id, versions.delete).dropped)

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
        return self._version(applied)

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
            if tenant_id is not None:
                owners = self.pages.owners(ids)
                allowed = [o is not None and self.mirror.tenant_of(o) == tenant_id for o in owners]
                ids = [i for i, ok in zip(ids, allowed) if ok]
            read = self.pages.read(ids)
        if read.bad:
            self.writer.apply(Change(quarantine=tuple(read.bad)))
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

    # -- inspection ------------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only SQL statement on the catalog; any write is refused (``ReadOnlyViolation``)."""
        self._check_open()
        return self.catalog.sql(query, params, max_rows)

    def check(self) -> list[str]:
        """Every broken invariant, as a sentence each; ``[]`` when the store is sound. Read-only."""
        with self._reading():
            return integrity.check(self.catalog, self.mirror, self.disk, self.host, self.config.disk_bytes)

    def stats(self) -> dict[str, Any]:
        """Sizes of the tiers as this process sees them."""
        with self._reading(), self.catalog.read() as conn:
            disk_used = pages.tier_bytes(conn, "disk")
            disk_pages = pages.count_located(conn, "disk")
        return {
            "host": {"pages": len(self.host), "bytes": self.host.used_bytes, "capacity": self.host.capacity_bytes},
            "disk": {"pages": disk_pages, "bytes": disk_used, "capacity": self.config.disk_bytes},
        }

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        self.guard.check_open()

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.reading()

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


def _sessionless(tenant_id: Any, user_id: Any, layout: Any) -> tuple[str, str, Layout]:
    """The namespace and layout of a save without a session, checked."""
    if tenant_id is None or user_id is None or layout is None:
        raise InvalidInput("save_pages without a session needs tenant_id, user_id and layout")
    check_name("user_id", user_id)
    check_name("tenant_id", tenant_id)
    return tenant_id, user_id, check_layout(layout)


def _short(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
