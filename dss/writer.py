"""How a write reaches the store: the guard every call holds, and the writer that applies changes.

:class:`Guard` is the store's lock and open state: every method of the store holds it while it
reads or changes this process's caches, caught up with other processes first.

:class:`Writer` applies a :class:`~dss.catalog.change.Change` in three steps: its page files
are written outside the lock (:meth:`dss.pages.PageStore.write`); one catalog transaction,
under the lock, makes room by the policy and applies it (:func:`dss.catalog.change.apply`);
then this process's caches take its events (:meth:`dss.mirror.Mirror.apply`) and its pages
(:meth:`dss.pages.PageStore.settle`). A change built on a session that another writer moved
on meanwhile is built again from a fresh state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dss import versions
from dss.catalog import change as changes
from dss.catalog.change import Applied, Change, Room, Stale, WrittenSegment
from dss.catalog.database import Catalog, catalog_errors
from dss.core.errors import Conflict, SessionExists, StoreClosed, UnknownSession
from dss.core.types import Layout
from dss.keys import DataKeys, ensure_namespace
from dss.mirror import Mirror
from dss.pageindex import PageIndex
from dss.pages import SEALED, PageStore
from dss.state import SessionState

ATTEMPTS = 16
"""How many times a write is built again when other writers keep moving its session on."""


class Guard:
    """The store's lock and open state (see the module docstring)."""

    def __init__(self, mirror: Mirror, pages: PageStore) -> None:
        self.lock = threading.RLock()
        self.is_closed = False
        self._mirror = mirror
        self._pages = pages
        self._forgotten = mirror.forgotten

    def check_open(self) -> None:
        if self.is_closed:
            raise StoreClosed("this store is closed")

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the lock, caught up with other processes and nodes (after another node's
        erasure, this node's files of the erased namespace are deleted first); catalog
        failures surface as ``CatalogUnavailable`` or ``CatalogCorrupt``."""
        with self.lock:
            self.check_open()
            with catalog_errors():
                self._mirror.sync()
                if self._mirror.forgotten != self._forgotten:  # an erasure elsewhere: drop this node's files of it
                    self._forgotten = self._mirror.forgotten
                    self._pages.sweep()
                yield


class Writer:
    """Applies changes for one store (see the module docstring)."""

    def __init__(self, catalog: Catalog, mirror: Mirror, pages: PageStore, keys: DataKeys, index: PageIndex,
                 guard: Guard, master: bytes) -> None:
        self.catalog = catalog
        self.mirror = mirror
        self.pages = pages
        self.keys = keys
        self.index = index
        self.guard = guard
        self._master = master

    def apply(self, change: Change, files: Sequence[str] = ()) -> Applied:
        """Write a change's segment files (outside the lock), apply it in one catalog
        transaction with the policy's room, then bring this process's caches up to date.
        Raises ``Stale`` (nothing written) when its session moved on meanwhile. ``files``:
        segment files the caller wrote for the change (compaction's), deleted with the
        change's own when its transaction does not commit."""
        sealer = None
        if change.user_ref is not None and any(p.flags & SEALED and p.stored is not None for p in change.pages):
            with self.guard.lock:
                sealer = self.keys.of(change.user_ref).sealer
        written = self.pages.write(change.pages, sealer)
        committed = False
        try:
            with self.guard.lock:
                self.guard.check_open()
                with catalog_errors(), self.catalog.write() as tx:
                    applied = changes.apply(tx, change, written, self.pages.room(tx, written, change.user_ref))
                committed = True
                self.pages.disk.settled(w.name for w in written)
                return self._taken(change, applied, written)
        except BaseException:
            if not committed:
                self.pages.abort(written)
                self.pages.disk.remove(files)
            raise

    def evict(self, victims: Sequence[int]) -> Applied:
        """Drop these disk segments and their pages in one catalog transaction (the mover
        making room), then bring this process's caches up to date."""
        change = Change()
        with self.guard.lock:
            self.guard.check_open()
            with catalog_errors(), self.catalog.write() as tx:
                applied = changes.apply(tx, change, (), Room(tuple(victims), True))
            return self._taken(change, applied)

    def _taken(self, change: Change, applied: Applied, written: Sequence[WrittenSegment] = ()) -> Applied:
        """After a change committed: tell other processes, update this one's caches (and the
        remote tier, with ``written``)."""
        self.mirror.wrote(applied.seq)
        self.mirror.apply(applied.events)
        namespace = self.index.namespaces.get(change.user_ref) if change.user_ref is not None else None
        self.pages.settle(applied, change.pages, namespace, written)
        return applied

    def write(self, session_id: str, tenant_id: str | None, build: Callable[..., Change], *args: Any) -> Applied:
        """Build a session's change with ``build(state, context, *args)`` (a :mod:`dss.versions`
        function) and apply it. The first attempt writes its page files outside the lock; when
        another writer moved the session on meanwhile, the change is built again from a fresh
        state and applied under the lock (only another process can then move it on)."""
        for attempt in range(ATTEMPTS):
            with self.guard.lock if attempt else _nothing():
                with self.guard.reading():
                    state = self.mirror.state(session_id, tenant_id)
                    change = build(state, self.context(state), *args)
                try:
                    return self.apply(change)
                except Stale:
                    continue
        raise Conflict(f"session {session_id!r} keeps being changed by other writers; try again")

    def branch(self, session_id: str, tenant_id: str | None, version_id: int, new_session_id: str,
               label: str | None) -> SessionState:
        """Start ``new_session_id`` at a version of a session; ``SessionExists`` if the id is taken."""
        for _ in range(ATTEMPTS):
            with self.guard.reading():
                state = self.mirror.state(session_id, tenant_id)
                tenant = state.record.tenant_id
                if self._exists(new_session_id, tenant):
                    raise SessionExists(f"session {new_session_id!r} already exists in tenant {tenant!r}")
                change = versions.branch(state, self.context(state), version_id, new_session_id,
                                         self.keys.session_key(new_session_id), label)
            try:
                return self.state_of(self.apply(change))
            except Stale:
                continue  # made meanwhile: the check above says so next
        raise Conflict(f"session id {new_session_id!r} keeps being created and deleted by other writers")

    def _exists(self, session_id: str, tenant_id: str) -> bool:
        try:
            self.mirror.state(session_id, tenant_id)
        except UnknownSession:
            return False
        return True

    def context(self, state: SessionState) -> versions.Context:
        """What a builder needs besides the session's state."""
        return versions.Context(self.keys.of(state.user_ref), self.index)

    def create(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> SessionState:
        """The session, made if absent (idempotent for the same owner and layout), in one
        transaction with its namespace and data key when those are new too."""
        for _ in range(ATTEMPTS):
            with self.guard.reading():
                try:
                    state = self.mirror.state(session_id, tenant_id)
                except UnknownSession:
                    pass
                else:
                    if state.record.user_id != user_id or state.layout != layout:
                        raise SessionExists(
                            f"session {session_id!r} exists in tenant {tenant_id!r} with another owner or layout")
                    return state
                made = committed = False
                try:
                    with catalog_errors(), self.catalog.write() as tx:
                        tenant_ref, user_ref, made = ensure_namespace(tx.conn, tenant_id, user_id, self._master)
                        change = versions.create(session_id, self.keys.session_key(session_id),
                                                 self.keys.of(user_ref, tx.conn), tenant_id=tenant_id,
                                                 tenant_ref=tenant_ref, user_id=user_id, user_ref=user_ref,
                                                 layout=layout)
                        applied = changes.apply(tx, change)
                    committed = True
                except Stale:
                    continue
                finally:
                    if made and not committed:
                        self.keys.forget(user_ref)  # its transaction rolled back: that key never existed
                self._taken(change, applied)
                state = self.mirror.sessions.get(applied.session_ref)  # type: ignore[arg-type]
                return state if state is not None else self.state_of(applied)
        raise Conflict(f"session {session_id!r} keeps being created and deleted by other writers; try again")

    def state_of(self, applied: Applied) -> SessionState:
        """The state of the session a change wrote (loaded again if another writer moved it on)."""
        assert applied.session_ref is not None
        with self.guard.reading():
            state = self.mirror.sessions.get(applied.session_ref)
            if state is not None:
                return state
            with self.catalog.read() as conn:
                state = self.mirror.loaded(applied.session_ref, conn)
        if state is None:
            raise UnknownSession("the session was deleted by another writer")
        return state


@contextmanager
def _nothing() -> Iterator[None]:
    yield
