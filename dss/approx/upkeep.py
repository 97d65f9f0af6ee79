"""Keeping the MinHash-LSH index current from the same events the mirror applies.

The writer hands every committed change's events here right after the mirror applied them,
and the guard hands those it caught up on from other processes (:meth:`Upkeep.apply`):

* a version this process commits (or a branch it makes) is indexed at once in the namespaces
  whose index is open here (shared in Redis: wherever anyone built it);
* another process's change to a session drops that session's entries and marks it **stale**,
  to re-index when its namespace is next queried (a Redis index is kept by its writer);
* a deleted session's entries go; an erased namespace's index goes, in Redis too;
* a mirror that fell behind the feed and reset itself clears the index too.

Until the store opens an index (:attr:`Upkeep.lsh` is ``None``) every event is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable

from dss.approx.lsh import LshIndex
from dss.catalog.change import SessionWrite
from dss.catalog.feed import Event, NamespaceForgotten, SessionChanged
from dss.sessions.mirror import Mirror
from dss.sessions.state import SessionState


class Upkeep:
    """The LSH index of one store and the sessions to re-index. Not thread-safe; the store locks."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.lsh: LshIndex | None = None
        """The MinHash-LSH index, once the store opened one."""
        self.stale: dict[int, int] = {}
        """``session_ref -> user_ref`` of sessions another process changed, to re-index."""

    def apply(self, events: Iterable[Event] | None) -> None:
        """Bring the index up to date with events the mirror has just applied (``None``: the
        mirror reset itself)."""
        lsh = self.lsh
        if lsh is None:
            return
        if events is None:
            lsh.clear()
            self.stale.clear()
            return
        for event in events:
            match event:
                case SessionChanged(own=SessionWrite() as own):
                    if own.change.delete:
                        lsh.drop_session(event.session_ref, own.change.user_ref)
                    elif own.version_id is not None and own.change.version is not None:
                        state = self.mirror.sessions.get(event.session_ref)
                        if state is not None:
                            self._index_version(lsh, state, own.version_id, own.change.version.tokens)
                case SessionChanged():
                    if not lsh.is_shared and lsh.holds(event.user_ref):
                        lsh.drop_session(event.session_ref)  # shared in Redis: the writer keeps it current
                        self.stale[event.session_ref] = event.user_ref
                case NamespaceForgotten():
                    lsh.drop_namespace(event.user_ref)
                    self.stale = {s: u for s, u in self.stale.items() if u != event.user_ref}

    @staticmethod
    def _index_version(lsh: LshIndex, state: SessionState, version_id: int, buf: bytes) -> None:
        """Index a version this process committed, if its namespace's index is open here (or,
        shared in Redis, was built by anyone)."""
        bucket = lsh.bucket(state.user_ref, state.layout.digest)
        if bucket is None and lsh.is_shared:
            bucket, built = lsh.open_bucket(state.user_ref, state.layout.digest, state.key)
            if not built:
                lsh.close_bucket(state.user_ref, state.layout.digest)
                return
        if bucket is not None:
            lsh.add(bucket, state.ref, version_id, buf, state.layout.page_tokens)
