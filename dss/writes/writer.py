"""How a write reaches the store: the writer that applies changes.

A session's change is built from the state this process holds without the store's lock
(:meth:`Writer.write`; a change built from a state that moved on is refused by its transaction
and built again), so a commit takes the lock once. :class:`Writer` applies a
:class:`~dss.catalog.change.Change` in three steps: its page files are written outside the
lock (:meth:`dss.pages.store.PageStore.write`); one catalog transaction, under the lock and
caught up with other processes, makes room by the policy and applies it
(:func:`dss.catalog.transaction.apply`); then this process's caches take its events
(:meth:`dss.sessions.mirror.Mirror.apply`) and its pages (:meth:`dss.pages.store.PageStore.settle`).

**Compaction** (:mod:`dss.writes.compaction`) runs between writes, never inside one: after a
write that thinned segments out, and — when a change's new pages would not fit the disk tier
(:meth:`~dss.pages.store.PageStore.disk_need`) — before that change's files are written, so dead
bytes go before live pages are evicted. Each compacted group is a change of its own.

**Group commit** (``group_commit``, on by default): concurrent writers of this process share
one catalog transaction and one round of fsyncs. Each writer writes and fsyncs its segment
files (concurrently with the others: the file system joins concurrent fsyncs into one journal
commit) and renames them into place without the folder's fsync, then joins a queue; the
first writer to find no leader leads the queue as it stands: it fsyncs the folder once for
all of them, opens one transaction,
applies each member's change — a member whose check fails (``Stale``, a deleted
session) writes nothing and gets its error; one that fails part-way gets its error and
the group's transaction is rolled back and applied again without it; the others go on —
commits, and updates this process's caches in member order. Writers that arrive
meanwhile form the next group. No member returns before the transaction that holds its
change committed; when the transaction fails, every member gets the error and its files are
deleted, as a lone write's would be. Making a session joins too once this process knows its
namespace (the first session of a namespace is made with the namespace and its data key in a
transaction of its own).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dss.approx.upkeep import Upkeep
from dss.catalog import erasures, transaction
from dss.catalog.change import Applied, Change, Stale, WrittenSegment
from dss.catalog.database import Catalog, DuplicateRow, Tx, catalog_errors
from dss.core.crypto import Sealer
from dss.core.errors import Conflict, DssError, UnknownSession
from dss.core.types import CACHE_PREFIX, PageId
from dss.core.validate import check_name
from dss.pages.index import PageIndex
from dss.pages.keys import DataKeys, Keys
from dss.pages.store import PageStore
from dss.sessions import versions
from dss.sessions.mirror import Mirror
from dss.sessions.state import SessionState
from dss.tiers.segment import SEALED_FLAG
from dss.writes.compaction import Compaction, Compactor
from dss.writes.group import CommitQueue, Member, Restart
from dss.writes.guard import Guard

log = logging.getLogger("dss.writes.writer")

ATTEMPTS = 16
"""How many times a write is built again when other writers keep moving its session on."""


class Writer:
    """Applies changes for one store (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        mirror: Mirror,
        upkeep: Upkeep,
        pages: PageStore,
        keys: DataKeys,
        index: PageIndex,
        guard: Guard,
        master: bytes,
        compactor: Compactor,
        *,
        group_commit: bool = True,
        compact_auto: bool = True,
    ) -> None:
        self.group_commit = group_commit
        self.compactor = compactor
        self.compact_auto = compact_auto
        self._compacting = threading.Lock()
        self.queue = CommitQueue()
        self.catalog = catalog
        self.mirror = mirror
        self.upkeep = upkeep
        self.pages = pages
        self.keys = keys
        self.index = index
        self.guard = guard
        self.master = master

    def apply(self, change: Change, *, alone: bool = False, sealer: Sealer | None = None) -> Applied:
        """Apply a change (:meth:`_apply`), compacting the disk tier first when its new pages
        would not fit it (see the module docstring). ``sealer``: the namespace's, when the
        caller holds it already."""
        if self.compact_auto and self.pages.disk_need(change.pages):
            self.compact_sparse()
        return self._apply(change, alone=alone, sealer=sealer)

    def compact_sparse(self, thinned: Sequence[int] | None = None) -> None:
        """Compact if some segment (of ``thinned``: those a write just thinned out) is sparse,
        unless compaction is running already; never fails the caller (``compact_auto``)."""
        if not self.compact_auto or not self._compacting.acquire(blocking=False):
            return
        try:
            with catalog_errors():
                if self.compactor.has_sparse(thinned):
                    self.compactor.run(self._apply_compaction)
        except (DssError, OSError) as exc:
            log.warning("compaction failed (the store is unchanged by it): %s", exc)
        finally:
            self._compacting.release()

    def compact(self, *, dry_run: bool = False) -> Compaction:
        """Compact every sparse segment now, after a compaction in progress (``store.compact``)."""
        with self._compacting, catalog_errors():
            return self.compactor.run(self._apply_compaction, dry_run=dry_run)

    def _apply_compaction(self, change: Change, files: Sequence[str]) -> Applied:
        return self._apply(change, files, alone=True)

    def _apply(
        self, change: Change, files: Sequence[str] = (), *, alone: bool = False, sealer: Sealer | None = None
    ) -> Applied:
        """Write a change's segment files (outside the lock), apply it in one catalog
        transaction with the policy's room, then bring this process's caches up to date.
        Raises ``Stale`` (nothing written) when its session moved on meanwhile. ``files``:
        segment files the caller wrote for the change (compaction's), deleted with the
        change's own when its transaction does not commit.

        With group commit the transaction is shared with concurrent writers (module
        docstring); ``alone`` applies it in a transaction of its own (a caller that holds
        the lock must: a leader needs it; so does a change with ``files``)."""
        sealed = any(p.flags & SEALED_FLAG and p.stored is not None for p in change.pages)
        if sealer is None and sealed and change.user_ref is not None:
            with self.guard.lock:
                sealer = self.keys.of(change.user_ref).sealer
        if self.group_commit and not alone and not files and not self.guard.lock._is_owned():  # type: ignore[attr-defined]
            return self._apply_grouped(change, sealer)  # (a caller holding the lock would wait for a leader needing it)
        written = self.pages.write(change.pages, sealer)
        committed = False
        try:
            with self.guard.reading():
                with catalog_errors(), self.catalog.write() as tx:
                    _check_fence(tx, change)
                    applied = transaction.apply(tx, change, written, self.pages.room(tx, written, change.user_ref))
                committed = True
                self.pages.disk.settled([w.name for w in written])
                return self.taken(change, applied, written)
        except BaseException:
            if not committed:
                self.pages.abort(written)
                self.pages.disk.remove(files)
            raise

    def _apply_grouped(self, change: Change, sealer: Sealer | None) -> Applied:
        member = Member(change, self.pages.write(change.pages, sealer, publish=False))
        group = self.queue.join(member)
        if group is not None:
            try:
                self._commit_group(group)
            finally:
                self.queue.finish(group)
        if member.error is not None:
            raise member.error
        assert member.applied is not None
        return member.applied

    def _commit_group(self, group: list[Member]) -> None:
        """Apply a group's changes in one transaction (see the module docstring). Every member
        ends with ``applied`` or ``error`` (or both: committed, but this process's caches
        failed to take it); the files of members without ``applied`` are deleted."""
        is_committed = False
        try:
            self.pages.publish([w for member in group for w in member.written])  # outside the lock: reads go on
            with self.guard.reading():
                while not is_committed:
                    try:
                        with catalog_errors(), self.catalog.write() as tx:
                            is_committed = self._apply_group(tx, group)
                    except Restart:
                        continue
                self._settle_group(group, tx.seq)
        except BaseException as exc:
            for member in group:
                if not is_committed:  # nothing committed: every member hears why
                    member.applied = None
                if member.applied is None or member.error is None:
                    member.error = member.error or exc
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and the like stop the leader's own thread too
        finally:
            for member in group:
                if member.applied is None:
                    self.pages.abort(member.written)

    def _apply_group(self, tx: Tx, group: list[Member]) -> bool:
        """Apply in ``tx`` each member that :func:`~dss.catalog.transaction.check` accepts (the others
        keep their error; a refused check writes nothing) and return ``True``. A member whose
        change fails part-way gets the error, and ``Restart`` rolls ``tx`` back: the caller
        applies the group again without it in a new transaction."""
        for member in group:
            member.applied = None
        for member in group:
            if member.error is not None:
                continue
            try:
                _check_fence(tx, member.change)
                transaction.check(tx, member.change)
            except (Stale, DssError) as exc:  # refused before writing: this member alone
                member.error = exc
                continue
            try:
                room = self.pages.room(tx, member.written, member.change.user_ref)
                member.applied = transaction.apply(tx, member.change, member.written, room, is_checked=True)
            except (DssError, DuplicateRow) as exc:  # part written: roll back, go again without it
                member.error = exc
                raise Restart() from exc
        return True

    def _settle_group(self, group: list[Member], seq: int) -> None:
        """After a group's transaction committed: this process's caches take its changes, in order."""
        committed = [member for member in group if member.applied is not None]
        self.pages.disk.settled([w.name for member in committed for w in member.written])
        if committed:
            self.mirror.wrote(seq)
        for member in committed:
            member.applied = self._settle(member.change, member.applied, member.written)  # type: ignore[arg-type]

    def taken(self, change: Change, applied: Applied, written: Sequence[WrittenSegment] = ()) -> Applied:
        """After a change committed: tell other processes, update this one's caches (and the
        remote tier, with ``written``)."""
        self.mirror.wrote(applied.seq)
        return self._settle(change, applied, written)

    def _settle(self, change: Change, applied: Applied, written: Sequence[WrittenSegment] = ()) -> Applied:
        """This process's caches take a committed change's events and pages (and the remote
        tier its ``written`` pages); returns ``applied`` with the version it is about (see
        :attr:`~dss.catalog.change.Applied.version`), read while the lock is still held."""
        self.mirror.apply(applied.events)
        self.upkeep.apply(applied.events)
        namespace = self.index.namespaces.get(change.user_ref) if change.user_ref is not None else None
        version = change.version
        self.pages.settle(
            applied,
            change.pages,
            namespace,
            written,
            user=change.user_ref,
            turn=version is not None,
            started=version is not None and version.parent_id is None,
            sessionless=bool(change.session_id) and change.session_id.startswith(CACHE_PREFIX),
        )
        state = self.mirror.sessions.get(applied.session_ref) if applied.session_ref is not None else None
        if state is None:
            return applied
        if version is not None and applied.stored:
            self.pages.placement.note_tokens([PageId(r.page_id) for r in applied.stored], state.layout.page_tokens)
        subject = (
            applied.version_id if version is not None else change.pin[0] if change.pin is not None else change.head
        )
        if subject is None or subject not in state.versions:
            return applied
        return applied._replace(version=state.version(subject))

    def write(self, session_id: str, tenant_id: str | None, build: Callable[..., Change], *args: Any) -> Applied:
        """Build a session's change with ``build(state, context, *args)`` (a :mod:`dss.sessions.versions`
        function) and apply it, taking the store's lock once (:meth:`_built_unlocked`).

        The change is built without the lock from the state this process holds, and its
        page files are written outside the lock; its transaction checks that the session did
        not move on since. When it did (another writer, here or in another process), the
        change is built again and applied within one entry of the lock, caught up with other
        processes first (only another process can then move the session on)."""
        built = self._built_unlocked(session_id, tenant_id, build, args)
        if built is not None:
            try:
                return self.apply(built[0], sealer=built[1])
            except Stale:
                pass
        for _ in range(ATTEMPTS):
            with self.guard.lock:
                with self.guard.reading():
                    state = self.mirror.state(session_id, tenant_id)
                    context = self.context(state)
                    change = build(state, context, *args)
                try:
                    return self.apply(change, alone=True, sealer=context.keys.sealer)
                except Stale:
                    continue
        raise Conflict(f"session {session_id!r} keeps being changed by other writers; try again")

    def _built_unlocked(
        self, session_id: str, tenant_id: str | None, build: Callable[..., Change], args: tuple[Any, ...]
    ) -> tuple[Change, Sealer | None] | None:
        """The change ``build`` makes from the session's state as this process holds it, built
        without the lock, with its namespace's sealer; ``None`` when another thread changed the
        state while it was read (see :mod:`dss.sessions.state`). A session this process does
        not hold yet is loaded first, under the lock."""
        check_name("session_id", session_id)
        check_name("tenant_id", tenant_id, optional=True)
        self.guard.check_open()
        state = self.mirror.cached(session_id, tenant_id)
        keys = self.keys.cached(state.user_ref) if state is not None else None
        if state is None or keys is None:
            with self.guard.reading():
                state = self.mirror.state(session_id, tenant_id)
                keys = self.keys.of(state.user_ref)
        generation = state.generation
        if generation % 2:
            return None
        try:
            change = build(state, self.context(state, keys), *args)
        except Exception:
            if state.generation != generation:  # read while it changed: build it again under the lock
                return None
            raise
        return (change, keys.sealer) if state.generation == generation else None

    def context(self, state: SessionState, keys: Keys | None = None) -> versions.Context:
        """What a builder needs besides the session's state (``keys``: its namespace's, when
        the caller holds them)."""
        keys = keys if keys is not None else self.keys.of(state.user_ref)
        return versions.Context(keys, self.index, self.pages.precision)

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


def _check_fence(tx: Tx, change: Change) -> None:
    """A write of a session (not the store's own compaction or eviction) raises
    ``ErasureInProgress`` once an erasure of its namespace has begun, whichever process or
    node runs the erasure."""
    if change.user_ref is not None and change.session_id:
        erasures.check_fence(tx.conn, change.user_ref)
