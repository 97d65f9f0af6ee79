"""This process's mirror of the catalog: session states and the page index, kept current.

Several processes may share one store. Each keeps a :class:`Mirror` of what it read from the
catalog (sessions with their tries, the pages of each namespace) and applies every write's
events (:mod:`dss.catalog.feed`) with one function, :meth:`Mirror.apply`: its own writes'
events right after they commit, carrying what was written in detail (applied in place),
and other processes' events read back from the feed when the epoch file says the catalog
moved on (:meth:`Mirror.sync`; without the detail, they drop or reload what changed).

:meth:`Mirror.sync` returns the events it applied, so that what else is kept from the same
events (the MinHash-LSH index, :mod:`dss.approx.upkeep`) is brought up to date by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dss.catalog import feed, holds, namespaces, pages, sessions
from dss.catalog.change import SessionWrite
from dss.catalog.database import Catalog
from dss.catalog.feed import Event, NamespaceForgotten, PagesDropped, PagesEvicted, PagesStored, SessionChanged
from dss.catalog.sessions import SessionRecord, VersionRecord
from dss.core.crypto import SealError
from dss.core.epoch import Epoch
from dss.core.errors import AmbiguousSession, CatalogCorrupt, UnknownSession
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import Layout, PageId
from dss.core.validate import check_name
from dss.pages.index import NamespacePages, PageIndex
from dss.pages.keys import DataKeys, label_aad, name_aad, tokens_aad
from dss.sessions.state import SessionState


class Mirror:
    """Session states and namespaces of one process. Not thread-safe; the store locks (only
    :meth:`cached` may be called without the lock)."""

    def __init__(self, catalog: Catalog, epoch: Epoch, index: PageIndex, keys: DataKeys, node_ref: int) -> None:
        self.catalog = catalog
        self.node_ref = node_ref
        self.forgotten = 0
        """How many namespaces this process saw forgotten (erased) since it opened."""
        self.epoch = epoch
        self.index = index
        self.keys = keys
        self.sessions: dict[int, SessionState] = {}
        self._names: dict[tuple[str, str | None], int] = {}
        self._no_shared: set[tuple[str, bytes]] = set()
        self._users: dict[tuple[str, str], int] = {}
        self._own: set[int] = set()
        with catalog.read() as conn:
            self._seq = feed.latest_seq(conn)
        self._epoch_seen = epoch.read()

    # -- applying writes -------------------------------------------------------------------

    def apply(self, events: Iterable[Event]) -> None:
        """Bring the caches up to date with a write's events (this process's or another's)."""
        for event in events:
            match event:
                case SessionChanged(own=SessionWrite() as own):
                    self._apply_own(event.session_ref, own)
                case SessionChanged():
                    self.drop_session(event.session_ref)
                case PagesStored(records=None):
                    namespace = self.index.namespaces.get(event.user_ref)
                    if namespace is not None and namespace.loaded:
                        with self.catalog.read() as conn:
                            self.index.apply(
                                namespace, pages.namespace_pages(conn, event.user_ref, self.node_ref, event.seq)
                            )
                case PagesStored(records=stored) if stored is not None:
                    self.index.apply(self.namespace(event.user_ref), stored)
                case PagesDropped():
                    self.index.forget([PageId(p) for p in event.page_ids])
                case PagesEvicted():
                    self.index.lose_durable([PageId(p) for p in event.page_ids])
                case NamespaceForgotten():
                    self.drop_namespace(event.user_ref)
                    self.forgotten += 1

    def _apply_own(self, ref: int, write: SessionWrite) -> None:
        """Apply this process's own write to the session's cached state, in place when the
        state is the one the write was built on (else drop it: it reloads when next used).
        While it changes, the state's generation is odd (see :mod:`dss.sessions.state`); a
        change that fails half-way drops the state."""
        change = write.change
        if change.delete:
            self.drop_session(ref)
            return
        if change.create is not None:
            state = self._new_state(ref, write)
        else:
            known = self.sessions.get(ref)
            if known is None or known.record.seq != change.base_seq:
                self.drop_session(ref)
                return
            state = known
        state.generation += 1
        try:
            _change_in_place(state, write)
        except BaseException:
            self.drop_session(ref)
            raise
        state.generation += 1

    def _new_state(self, ref: int, write: SessionWrite) -> SessionState:
        """The state of a session this process made; its id found without a tenant is looked
        up again (it may now be in two tenants)."""
        new = write.change.create
        assert new is not None and write.change.user_ref is not None
        self._names.pop((new.session_id, None), None)
        record = SessionRecord(
            ref,
            new.session_id,
            new.tenant_id,
            new.user_id,
            new.tenant_ref,
            write.change.user_ref,
            write.layout_ref,
            new.layout,
            None,
            write.stamp,
            write.stamp,
            write.seq,
            new.session_key,
            new.sealed_name,
        )
        return self.build(record, [], {})

    # -- catching up -----------------------------------------------------------------------

    def wrote(self, seq: int) -> None:
        """This process committed transaction ``seq`` and applied it itself; tell the others.

        When ``seq`` directly follows the last one this process saw, nobody else wrote in
        between, so this process is still current and needs no catch-up read.
        """
        stored = self.epoch.publish(seq)
        if seq == self._seq + 1:
            self._seq = seq
            if stored == seq:
                self._epoch_seen = seq
        else:
            self._own.add(seq)

    def sync(self) -> list[Event] | None:
        """Catch up with what other processes committed (a memory load when nothing changed).
        Returns the events applied, or ``None`` when this process fell behind the pruned feed
        and forgot everything cached."""
        seen = self.epoch.read()
        if seen == self._epoch_seen:
            return []
        self._epoch_seen = seen
        with self.catalog.read() as conn:
            latest, events = feed.read_since(conn, self._seq)
        applied: list[Event] | None = None
        if events is None:
            self._reset()
        else:
            applied = [event for seq, event in events if seq not in self._own]
            self.apply(applied)
        self._own = {s for s in self._own if s > latest}
        self._seq = latest
        return applied

    def _reset(self) -> None:
        """Forget everything cached (this process fell behind the pruned feed)."""
        self.sessions.clear()
        self._names.clear()
        self.keys.clear()
        self._users.clear()
        self._no_shared.clear()
        for user_ref in list(self.index.namespaces):
            self.index.drop_namespace(user_ref)

    # -- sessions --------------------------------------------------------------------------

    def state(self, session_id: str, tenant_id: str | None) -> SessionState:
        """The state of a session by id; raises ``UnknownSession`` or ``AmbiguousSession``
        (``InvalidInput`` for ids that cannot be ids)."""
        check_name("session_id", session_id)
        check_name("tenant_id", tenant_id, optional=True)
        ref = self._names.get((session_id, tenant_id))
        if ref is not None:
            state = self.sessions.get(ref)
            if state is not None:
                return state
            with self.catalog.read() as conn:
                loaded = self.loaded(ref, conn)
            if loaded is not None:
                return loaded
            del self._names[(session_id, tenant_id)]
        with self.catalog.read() as conn:
            found = sessions.find_sessions(conn, self.keys.session_key(session_id), tenant_id)
            if not found:
                where = f" in tenant {tenant_id!r}" if tenant_id is not None else ""
                raise UnknownSession(f"no session {session_id!r}{where}")
            if len(found) > 1:
                raise AmbiguousSession(f"session id {session_id!r} exists in {len(found)} tenants: pass tenant_id")
            state = self.loaded(found[0].ref, conn)
        assert state is not None
        self._names[(session_id, tenant_id)] = state.ref
        return state

    def cached(self, session_id: str, tenant_id: str | None) -> SessionState | None:
        """The session's state if this process holds it, else ``None``; no I/O and no lock
        needed (what it returns may be changing: see :mod:`dss.sessions.state`)."""
        ref = self._names.get((session_id, tenant_id))
        return self.sessions.get(ref) if ref is not None else None

    def shared(self, tenant_id: str, layout: Layout, session_id: str) -> SessionState | None:
        """The tenant's shared-prefix session for a layout, or ``None`` (remembered until a
        session changes somewhere)."""
        if (tenant_id, layout.digest) in self._no_shared:
            return None
        try:
            return self.state(session_id, tenant_id)
        except UnknownSession:
            self._no_shared.add((tenant_id, layout.digest))
            return None

    def loaded(self, ref: int, conn: Any) -> SessionState | None:
        """The state of session ``ref``, loaded on ``conn`` if not cached; ``None`` if deleted."""
        state = self.sessions.get(ref)
        if state is not None:
            return state
        record = sessions.session_by_ref(conn, ref)
        if record is None:
            return None
        record = self.opened(record, conn)
        versions = self.unsealed(record, sessions.session_versions(conn, ref), conn)
        return self.build(record, versions, holds.held_pages(conn, ref), conn)

    def build(
        self, record: SessionRecord, versions: list[VersionRecord], held: dict[bytes, int], conn: Any = None
    ) -> SessionState:
        """Make and cache the state of a session from its (opened) catalog rows."""
        self._no_shared.discard((record.tenant_id, record.layout.digest))
        keys = self.keys.of(record.user_ref, conn)
        state = SessionState(record, keys.hash_key, self.namespace(record.user_ref, conn), versions, held)
        self.sessions[record.ref] = state
        return state

    def opened(self, record: SessionRecord, conn: Any = None) -> SessionRecord:
        """``record`` with its session id unsealed. Raises ``ErasureInProgress`` when the
        owner's key is destroyed, ``CatalogCorrupt`` when the sealed id does not authenticate."""
        if record.session_id:
            return record
        sealer = self.keys.of(record.user_ref, conn).names
        try:
            name = sealer.open(record.sealed_name, name_aad(record.session_key))
            return record._replace(session_id=name.decode())
        except (SealError, UnicodeDecodeError):
            raise CatalogCorrupt(
                f"the sealed id of session {record.session_key.hex()} (tenant {record.tenant_id!r}) "
                "does not authenticate: the catalog row is damaged"
            ) from None

    def unsealed(self, record: SessionRecord, versions: list[VersionRecord], conn: Any = None) -> list[VersionRecord]:
        """The version rows with their token histories and labels in clear."""
        if not any(v.sealed or v.sealed_label is not None for v in versions):
            return versions
        keys = self.keys.of(record.user_ref, conn)
        tokens = keys.sealer or keys.names
        aad, labels = tokens_aad(record.session_key), label_aad(record.session_key)
        try:  # only the sealed blobs, not the key above: a damaged key says so itself
            return [
                v._replace(
                    suffix=tokens.open(v.suffix, aad) if v.sealed else v.suffix,
                    sealed=False,
                    label=keys.names.open(v.sealed_label, labels).decode() if v.sealed_label is not None else None,
                    sealed_label=None,
                )
                for v in versions
            ]
        except (SealError, UnicodeDecodeError):
            raise CatalogCorrupt(
                f"a token history or label of session {record.session_id!r} (tenant "
                f"{record.tenant_id!r}) does not authenticate: the catalog row is damaged"
            ) from None

    def drop_session(self, ref: int) -> None:
        """Forget a session's cached state (it reloads from the catalog when next used)."""
        self.sessions.pop(ref, None)
        self._no_shared.clear()
        self._names = {k: v for k, v in self._names.items() if v != ref and k[1] is not None}

    # -- namespaces ------------------------------------------------------------------------

    def namespace(self, user_ref: int, conn: Any = None) -> NamespacePages:
        """The page index of a namespace, loaded from the catalog on first use."""
        namespace = self.index.namespace(user_ref)
        if not namespace.loaded:
            if conn is None:
                with self.catalog.read() as own:
                    self.index.apply(namespace, pages.namespace_pages(own, user_ref, self.node_ref))
            else:
                self.index.apply(namespace, pages.namespace_pages(conn, user_ref, self.node_ref))
            namespace.loaded = True
        return namespace

    def drop_namespace(self, user_ref: int) -> None:
        """Drop every cached trace of a namespace: keys, sessions, page entries, host copies."""
        self.keys.forget(user_ref)
        self._users = {k: v for k, v in self._users.items() if v != user_ref}
        for ref in [ref for ref, state in self.sessions.items() if state.user_ref == user_ref]:
            self.drop_session(ref)
        self.index.drop_namespace(user_ref)

    def user_ref(self, tenant_id: str, user_id: str) -> int | None:
        """The namespace's row number, or ``None`` if it has none (found ones are remembered
        until the namespace is dropped)."""
        ref = self._users.get((tenant_id, user_id))
        if ref is None:
            with self.catalog.read() as conn:
                ref = namespaces.find_user(conn, tenant_id, user_id)
            if ref is not None:
                self._users[(tenant_id, user_id)] = ref
        return ref


def _change_in_place(state: SessionState, write: SessionWrite) -> None:
    """Apply this process's own ``write`` to ``state``, the state it was built on."""
    change = write.change
    head = change.head
    version = change.version
    if version is not None:
        assert write.version_id is not None
        state.add(_version_record(state.ref, write), version.tokens, version.walk)
        head = write.version_id
    for page_id in write.unheld:
        state.held.pop(page_id, None)
    if write.version_id is not None:
        retagged = set(change.retag)
        for page_id, tag in state.held.items():
            if tag in retagged:
                state.held[page_id] = write.version_id
        state.held.update(dict.fromkeys(change.touch, write.version_id))
    state.held.update(dict.fromkeys(write.held, write.version_id or 0))
    if change.pin is not None:
        version_id, pinned = change.pin
        state.versions[version_id] = state.versions[version_id]._replace(pinned=pinned)
    state.record = state.record._replace(
        seq=write.seq, last_access=write.stamp, head_id=head if head is not None else state.head_id
    )


def _version_record(ref: int, write: SessionWrite) -> VersionRecord:
    """The catalog row of the version this process's own write made in session ``ref``."""
    version = write.change.version
    assert version is not None and write.version_id is not None
    return VersionRecord(
        write.version_id,
        ref,
        version.parent_id,
        version.base_id,
        version.base_len,
        len(version.tokens) // TOKEN_BYTES,
        version.tokens[TOKEN_BYTES * version.base_len :],
        version.label,
        False,
        write.stamp,
    )
