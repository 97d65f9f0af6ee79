"""Making sessions: a new one (with its namespace and data key when those are new too), or a
branch of another at one of its versions. Both are changes the writer applies
(:mod:`dss.writes.writer`)."""

from __future__ import annotations

from dss.catalog import transaction
from dss.catalog.change import Change, Stale
from dss.catalog.database import catalog_errors
from dss.core.errors import Conflict, ErasureInProgress, SessionExists, UnknownSession
from dss.core.types import Layout
from dss.pages.keys import Keys, ensure_namespace
from dss.sessions import versions
from dss.sessions.state import SessionState
from dss.writes.writer import ATTEMPTS, Writer


class Creator:
    """Makes sessions for one store through its writer."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self._namespaces: dict[tuple[str, str], tuple[int, int]] = {}
        """``(tenant_id, user_id) -> (tenant_ref, user_ref)`` of namespaces this process made a
        session in: a later session there is made in a commit group (see :meth:`create`)."""

    def branch(
        self, session_id: str, tenant_id: str | None, version_id: int, new_session_id: str, label: str | None
    ) -> SessionState:
        """Start ``new_session_id`` at a version of a session; ``SessionExists`` if the id is taken."""
        w = self.writer
        for _ in range(ATTEMPTS):
            with w.guard.reading():
                state = w.mirror.state(session_id, tenant_id)
                tenant = state.record.tenant_id
                if self._exists(new_session_id, tenant):
                    raise SessionExists(f"session {new_session_id!r} already exists in tenant {tenant!r}")
                change = versions.branch(
                    state, w.context(state), version_id, new_session_id, w.keys.session_key(new_session_id), label
                )
            try:
                return w.state_of(w.apply(change))
            except Stale:
                continue  # made meanwhile: the check above says so next
        raise Conflict(f"session id {new_session_id!r} keeps being created and deleted by other writers")

    def _exists(self, session_id: str, tenant_id: str) -> bool:
        w = self.writer
        try:
            w.mirror.state(session_id, tenant_id)
        except UnknownSession:
            return False
        return True

    def create(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> SessionState:
        """The session, made if absent (idempotent for the same owner and layout), in one
        transaction with its namespace and data key when those are new too. In a namespace
        this process has made a session in before, the change joins a commit group (the
        transaction checks that the namespace still exists, unerased)."""
        w = self.writer
        for attempt in range(ATTEMPTS):
            with w.guard.reading():
                try:
                    state = w.mirror.state(session_id, tenant_id)
                except UnknownSession:
                    pass
                else:
                    if state.record.user_id != user_id or state.layout != layout:
                        raise SessionExists(
                            f"session {session_id!r} exists in tenant {tenant_id!r} with another owner or layout"
                        )
                    return state
                known = self._namespaces.get((tenant_id, user_id)) if attempt == 0 else None
                if known is not None:
                    try:
                        change = self._created(session_id, user_id, tenant_id, layout, *known, w.keys.of(known[1]))
                    except ErasureInProgress:
                        known = None  # its key is gone: the namespace's own transaction says why, or makes it anew
            if known is not None:
                try:
                    applied = w.apply(change)
                except Stale:
                    continue  # made meanwhile, or the namespace was erased: look again
                return w.state_of(applied)
            try:
                return self._create_in_namespace(session_id, user_id, tenant_id, layout)
            except Stale:
                continue
        raise Conflict(f"session {session_id!r} keeps being created and deleted by other writers; try again")

    def _create_in_namespace(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> SessionState:
        """Make the session in a transaction of its own, with its namespace and data key when
        those are new. Raises ``Stale`` (nothing made) when it was made meanwhile."""
        w = self.writer
        made = committed = False
        with w.guard.reading():
            try:
                with catalog_errors(), w.catalog.write() as tx:
                    tenant_ref, user_ref, made = ensure_namespace(tx.conn, tenant_id, user_id, w.master)
                    keys = w.keys.of(user_ref, tx.conn)
                    change = self._created(session_id, user_id, tenant_id, layout, tenant_ref, user_ref, keys)
                    applied = transaction.apply(tx, change)
                committed = True
            finally:
                if made and not committed:
                    w.keys.forget(user_ref)  # its transaction rolled back: that key never existed
            self._namespaces[(tenant_id, user_id)] = (tenant_ref, user_ref)
            w.taken(change, applied)
            assert applied.session_ref is not None
            cached = w.mirror.sessions.get(applied.session_ref)
            return cached if cached is not None else w.state_of(applied)

    def _created(
        self, session_id: str, user_id: str, tenant_id: str, layout: Layout, tenant_ref: int, user_ref: int, keys: Keys
    ) -> Change:
        w = self.writer
        return versions.create(
            session_id,
            w.keys.session_key(session_id),
            keys,
            tenant_id=tenant_id,
            tenant_ref=tenant_ref,
            user_id=user_id,
            user_ref=user_ref,
            layout=layout,
        )
