"""The store's sessions and versions: make, list and delete sessions; commit, save pages,
roll back, branch, pin; versions and their tokens."""

from __future__ import annotations

from collections.abc import Mapping

from dss.catalog import sessions
from dss.core.errors import ErasureInProgress, InvalidInput
from dss.core.tokens import TOKEN_BYTES, TokenInput, pack, unpack
from dss.core.types import Layout, SavedPages, Session, Version
from dss.core.validate import check_flag, check_label, check_name, check_pages
from dss.sessions import versions
from dss.sessions.state import session_of
from dss.store.base import Base, sessionless


class History(Base):
    """Sessions and versions (see :class:`dss.store.Store`)."""

    # -- sessions --------------------------------------------------------------------------

    def create_session(
        self, session_id: str, *, user_id: str = "anonymous", tenant_id: str = "default", layout: Layout
    ) -> Session:
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
            self.writer.compact_sparse(applied.thinned)
        return len(applied.dropped)

    # -- versions --------------------------------------------------------------------------

    def commit(
        self,
        session_id: str,
        tokens: TokenInput,
        pages: Mapping[int, bytes] | None = None,
        *,
        label: str | None = None,
        tenant_id: str | None = None,
    ) -> Version:
        """Record ``tokens`` as a new version of the session, child of the head, and make it the head.

        ``pages[i]`` is the KV of ``tokens[i*page_tokens:(i+1)*page_tokens]``, exactly
        ``layout.page_bytes`` bytes; only full pages may be given. Pages already stored in
        the namespace are not written again. Returns the new version.
        """
        buf = pack(tokens)
        check_label(label)
        applied = self.writer.write(session_id, tenant_id, versions.commit, buf, pages, label)
        self._wake_mover()
        return self._version(applied)

    def save_pages(
        self,
        session_id: str | None,
        tokens: TokenInput,
        pages: Mapping[int, bytes],
        *,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
    ) -> SavedPages:
        """Store pages of ``tokens`` ahead of the commit that will contain them.

        Engines save KV as they compute it and commit the version when the request ends;
        the session holds the saved pages from now on (they resume at once, and are
        released with the session). With ``session_id=None`` the pages are held for the
        namespace ``(tenant_id, user_id)`` and ``layout``, for requests that carry no
        session (they resume through :meth:`lookup`). Returns the id of every page given, by
        index (what :meth:`resume` will report for them), and how many were new to the store.
        """
        buf = pack(tokens)
        if session_id is None:
            tenant_id, user_id, layout = sessionless(tenant_id, user_id, layout)
            if not check_pages(pages, len(buf) // TOKEN_BYTES, layout):  # before the page-cache session is made
                return SavedPages({}, 0)
            state = self._cache_session(tenant_id, user_id, layout)
            session_id, tenant_id = state.session_id, state.record.tenant_id
        applied = self.writer.write(session_id, tenant_id, versions.save, buf, pages)
        self._wake_mover()
        return SavedPages(dict(applied.given), len(applied.stored))

    def rollback(self, session_id: str, version_id: int, *, tenant_id: str | None = None) -> Version:
        """Move the session's head to ``version_id``; the next commit's parent is that version.

        Copies nothing and deletes nothing: later versions stay and still resume.
        """
        applied = self.writer.write(session_id, tenant_id, versions.rollback, version_id)
        return self._version(applied, version_id)

    def branch(
        self,
        session_id: str,
        version_id: int,
        new_session_id: str,
        *,
        tenant_id: str | None = None,
        label: str | None = None,
    ) -> Session:
        """Start session ``new_session_id`` at ``version_id`` of this one (same owner and layout).

        The new session's first version has that version's tokens and shares its pages;
        no page is copied. Raises ``SessionExists`` if the new id is taken in the tenant.
        """
        check_name("new_session_id", new_session_id)
        if new_session_id.startswith("~"):
            raise InvalidInput("session ids starting with '~' are reserved for dss")
        check_label(label)
        return self.creator.branch(session_id, tenant_id, version_id, new_session_id, label).info()

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
