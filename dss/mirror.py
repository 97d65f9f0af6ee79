"""This process's mirror of the catalog: session states and the page index, kept current.

Several processes may share one store. Each keeps a :class:`Mirror` of what it read from
the catalog (sessions with their tries, the pages of each namespace) and catches up before
every operation: when the epoch file moved (:mod:`dss.epoch`), it reads the change feed
(:meth:`dss.catalog.Catalog.changes_since`) and drops or refreshes exactly what changed.
Its own writes it applies directly, and skips them in the feed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import select

from dss import records
from dss.catalog import Catalog, Tx
from dss.crypto import Sealer, SealError, namespace_hash_key, session_key, session_lookup_key, unwrap
from dss.epoch import Epoch
from dss.errors import AmbiguousSession, CatalogCorrupt, ErasureInProgress, UnknownSession
from dss.keys import label_aad, name_aad, owner_tag, tokens_aad
from dss.pageindex import Namespace, PageIndex
from dss.records import SessionRecord, VersionRecord
from dss.sessions import SessionState
from dss.types import PageId
from dss.validate import check_name


class Keys(NamedTuple):
    """What a namespace's data key yields: the page-id hashing key, the sealer of pages and
    token histories (``None`` when the store does not encrypt), and the sealer of session ids
    and labels (always)."""

    hash_key: bytes
    sealer: Sealer | None
    names: Sealer


class Mirror:
    """Session states and namespaces of one process. Not thread-safe; the store locks."""

    def __init__(self, catalog: Catalog, epoch: Epoch, index: PageIndex, master: bytes, *, encrypt: bool) -> None:
        self.catalog = catalog
        self.epoch = epoch
        self.index = index
        self._master = master
        self._lookup = session_lookup_key(master)
        self._encrypt = encrypt
        self.sessions: dict[int, SessionState] = {}
        self._names: dict[tuple[str, str | None], int] = {}
        self._keys: dict[int, Keys] = {}
        self._no_shared: set[tuple[str, bytes]] = set()
        self._tenants: dict[int, str] = {}
        self._users: dict[tuple[str, str], int] = {}
        self._own: set[int] = set()
        self._seq = catalog.latest_seq()
        self._epoch_seen = epoch.read()

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

    def sync(self) -> None:
        """Catch up with what other processes committed (a memory load when nothing changed)."""
        seen = self.epoch.read()
        if seen == self._epoch_seen:
            return
        self._epoch_seen = seen
        latest, rows = self.catalog.changes_since(self._seq)
        if rows is None:
            self.sessions.clear()
            self._names.clear()
            self._keys.clear()
            self._users.clear()
            self._tenants.clear()
            self._no_shared.clear()
            for user_ref in list(self.index.namespaces):
                self.index.drop_namespace(user_ref)
        else:
            reload: dict[int, int] = {}
            for seq, kind, session_ref, user_ref, page_id in rows:
                if seq in self._own:
                    continue
                if kind == "session":
                    self.sessions.pop(session_ref, None)
                    self._names = {k: v for k, v in self._names.items() if k[1] is not None}
                    self._no_shared.clear()
                elif kind == "pages":
                    reload[user_ref] = min(seq, reload.get(user_ref, seq))
                elif kind == "drop":
                    self.index.forget([PageId(bytes(page_id))])
                elif kind == "evict":
                    self.index.lose_durable([PageId(bytes(page_id))])
                elif kind == "forget":
                    self.forget_user(user_ref)
            for user_ref, since in reload.items():
                ns = self.index.namespaces.get(user_ref)
                if ns is not None and ns.loaded:
                    with self.catalog.read() as conn:
                        self.index.apply(ns, records.namespace_pages(conn, user_ref, since))
        self._own = {s for s in self._own if s > latest}
        self._seq = latest

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
            # a deleted session's row number may now belong to another session (SQLite reuses it)
            if loaded is not None and loaded.session_id == session_id and tenant_id in (None, loaded.record.tenant_id):
                return loaded
            del self._names[(session_id, tenant_id)]
        with self.catalog.read() as conn:
            found = records.find_sessions(conn, self.session_key(session_id), tenant_id)
            if not found:
                where = f" in tenant {tenant_id!r}" if tenant_id is not None else ""
                raise UnknownSession(f"no session {session_id!r}{where}")
            if len(found) > 1:
                raise AmbiguousSession(f"session id {session_id!r} exists in {len(found)} tenants: pass tenant_id")
            state = self.loaded(found[0].ref, conn)
        assert state is not None
        self._names[(session_id, tenant_id)] = state.ref
        return state

    def shared(self, tenant_id: str, layout: Any, session_id: str) -> SessionState | None:
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
        record = records.session_by_ref(conn, ref)
        if record is None:
            return None
        return self.build(record, records.session_versions(conn, ref), records.session_refs(conn, ref), conn)

    def build(self, record: SessionRecord, versions: list[VersionRecord], refs: dict[bytes, int],
              conn: Any) -> SessionState:
        """Make and cache the state of a session from its catalog rows."""
        self._no_shared.discard((record.tenant_id, record.layout.digest))
        keys = self.keys(record.user_ref, conn)
        record = self.opened(record, conn)
        state = SessionState(record, keys.hash_key, self.namespace(record.user_ref, conn),
                             self.unsealed(record, versions, conn), refs)
        self.sessions[record.ref] = state
        return state

    def session_key(self, session_id: str) -> bytes:
        """The keyed hash the catalog finds a session id by."""
        return session_key(self._lookup, session_id)

    def opened(self, record: SessionRecord, conn: Any = None) -> SessionRecord:
        """``record`` with its session id unsealed. Raises ``ErasureInProgress`` when the
        owner's key is destroyed, ``CatalogCorrupt`` when the sealed id does not authenticate."""
        if record.session_id:
            return record
        try:
            name = self.keys(record.user_ref, conn).names.open(record.sealed_name, name_aad(record.session_key))
            return record._replace(session_id=name.decode())
        except (SealError, UnicodeDecodeError):
            raise CatalogCorrupt(f"the sealed id of session {record.session_key.hex()} (tenant {record.tenant_id!r}) "
                                 "does not authenticate: the catalog row is damaged") from None

    def unsealed(self, record: SessionRecord, versions: list[VersionRecord], conn: Any = None) -> list[VersionRecord]:
        """The version rows with their token histories and labels in clear."""
        if not any(v.sealed or v.sealed_label is not None for v in versions):
            return versions
        keys = self.keys(record.user_ref, conn)
        tokens = keys.sealer or keys.names
        aad, labels = tokens_aad(record.ref), label_aad(record.ref)
        try:
            return [v._replace(suffix=tokens.open(v.suffix, aad) if v.sealed else v.suffix, sealed=False,
                               label=keys.names.open(v.sealed_label, labels).decode() if v.sealed_label is not None
                               else None, sealed_label=None) for v in versions]
        except (SealError, UnicodeDecodeError):
            raise CatalogCorrupt(f"a token history or label of session {record.session_id!r} (tenant "
                                 f"{record.tenant_id!r}) does not authenticate: the catalog row is damaged") from None

    def fresh(self, tx: Tx, state: SessionState) -> SessionState:
        """``state`` as of write transaction ``tx``, reloaded if another process changed it."""
        row = tx.conn.execute(select(records.sessions.c.seq).where(records.sessions.c.id == state.ref)).first()
        if row is None:
            self.drop(state.ref)
            raise UnknownSession(f"session {state.session_id!r} was deleted")
        if row[0] == state.record.seq:
            return state
        self.sessions.pop(state.ref, None)
        fresh = self.loaded(state.ref, tx.conn)
        assert fresh is not None
        return fresh

    def drop(self, ref: int) -> None:
        """Forget a session this process deleted."""
        self.sessions.pop(ref, None)
        self._no_shared.clear()
        self._names = {k: v for k, v in self._names.items() if v != ref}

    # -- namespaces ------------------------------------------------------------------------

    def namespace(self, user_ref: int, conn: Any = None) -> Namespace:
        """The page index of a namespace, loaded from the catalog on first use."""
        ns = self.index.namespace(user_ref)
        if not ns.loaded:
            if conn is None:
                with self.catalog.read() as own:
                    self.index.apply(ns, records.namespace_pages(own, user_ref))
            else:
                self.index.apply(ns, records.namespace_pages(conn, user_ref))
            ns.loaded = True
        return ns

    def keys(self, user_ref: int, conn: Any = None) -> Keys:
        """The keys of a namespace, unwrapped from the catalog on first use.

        Raises ``ErasureInProgress`` when the namespace's data key was destroyed.
        """
        keys = self._keys.get(user_ref)
        if keys is not None:
            return keys
        data_key = self._data_key(user_ref, conn)
        names = Sealer(data_key)
        keys = self._keys[user_ref] = Keys(namespace_hash_key(data_key), names if self._encrypt else None, names)
        return keys

    def _data_key(self, user_ref: int, conn: Any) -> bytes:
        if conn is None:
            with self.catalog.read() as own:
                wrapped = records.wrapped_key(own, user_ref)
        else:
            wrapped = records.wrapped_key(conn, user_ref)
        if wrapped is None:
            raise ErasureInProgress("this user's data key is destroyed: their data is being (or was) erased")
        try:
            return unwrap(self._master, wrapped, owner_tag(user_ref))
        except SealError:
            raise CatalogCorrupt(f"the data key of namespace {user_ref} does not authenticate under the master key: "
                                 "the catalog row is damaged") from None

    def seal_tokens(self, tx: Tx, user_ref: int, session_ref: int, buf: bytes) -> tuple[bytes, bool]:
        """A token history as stored: sealed under the owner's data key, bound to its session
        (``(buf, False)`` when the store does not encrypt)."""
        sealer = self.keys(user_ref, tx.conn).sealer
        if sealer is None:
            return buf, False
        return sealer.seal(buf, tokens_aad(session_ref)), True

    def seal_name(self, tx: Tx, user_ref: int, session_key: bytes, session_id: str) -> bytes:
        """A session id as stored: sealed under the owner's data key, bound to its keyed hash."""
        return self.keys(user_ref, tx.conn).names.seal(session_id.encode(), name_aad(session_key))

    def seal_label(self, tx: Tx, user_ref: int, session_ref: int, label: str | None) -> bytes | None:
        """A version label as stored: sealed under the owner's data key, bound to its session."""
        if label is None:
            return None
        return self.keys(user_ref, tx.conn).names.seal(label.encode(), label_aad(session_ref))

    def sealer_of(self, user_ref: int) -> Sealer | None:
        """The sealer of a namespace, or ``None`` if its key is gone (its pages are then unreadable)."""
        try:
            return self.keys(user_ref).sealer
        except ErasureInProgress:
            return None

    def forget_user(self, user_ref: int) -> None:
        """Drop every cached trace of a namespace: key, sessions, page entries, host copies."""
        self._keys.pop(user_ref, None)
        self._tenants.pop(user_ref, None)
        self._users = {k: v for k, v in self._users.items() if v != user_ref}
        for ref in [ref for ref, state in self.sessions.items() if state.record.user_ref == user_ref]:
            self.drop(ref)
        self.index.drop_namespace(user_ref)

    def tenant_of(self, user_ref: int) -> str | None:
        """The tenant a namespace belongs to (``None`` for an unknown one)."""
        tenant = self._tenants.get(user_ref)
        if tenant is None:
            with self.catalog.read() as conn:
                tenant = records.tenant_of(conn, user_ref)
            if tenant is not None:
                self._tenants[user_ref] = tenant
        return tenant

    def user_ref(self, tenant_id: str, user_id: str) -> int | None:
        """The namespace's row number, or ``None`` if it has none (found ones are remembered
        until the user is forgotten)."""
        ref = self._users.get((tenant_id, user_id))
        if ref is None:
            with self.catalog.read() as conn:
                ref = records.find_user(conn, tenant_id, user_id)
            if ref is not None:
                self._users[(tenant_id, user_id)] = ref
        return ref
