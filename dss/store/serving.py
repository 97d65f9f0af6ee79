"""What the store serves engines: resume, lookup, near-duplicate search and its explanation,
shared prefixes, page reads and prefetch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

from dss.approx.explanation import Explanation
from dss.approx.nearest import Decode
from dss.catalog import pages
from dss.catalog.change import Change
from dss.core.errors import InvalidInput
from dss.core.tokens import TokenInput, view
from dss.core.types import Layout, PageRef
from dss.core.validate import (
    check_buffers,
    check_callback,
    check_flag,
    check_layout,
    check_name,
    check_page_ids,
    check_ready,
)
from dss.sessions.resume import Candidate, ResumeResult
from dss.store.base import Base


class Serving(Base):
    """Resume and pages (see :class:`dss.store.Store`)."""

    # -- resume and pages ------------------------------------------------------------------

    def resume(
        self, session_id: str, tokens: TokenInput, *, tenant_id: str | None = None, approximate: bool | None = None
    ) -> ResumeResult:
        """How many leading tokens of ``tokens`` have stored, readable KV, and where.

        Walks the session's trie (every version, not only the head), fills pages it lacks
        from the tenant's registered shared prefixes, then — past the trie's match — looks
        further pages up by their chain hash in the session's namespace. With
        ``approximate=True`` (default: the ``approximate`` setting), when that matched less
        than ``lsh_min_share`` of the prompt, versions of the namespace and layout that
        MinHash-LSH proposes are compared token by token and the longest exact common prefix
        with stored pages wins (``source="lsh"``); the result names the nearest one and how
        many were tried. Only exact prefixes are ever reported. Where a tier keeps lossy
        copies (its precision setting), ``encodings`` and ``lossy_tokens`` say how many
        matched tokens a load would serve approximate, at which encoding. Side-effect free: changes
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
                result = self._nearest_index().improve(
                    result, buf, record.layout, record.user_ref, state, record.tenant_id
                )
            return self._announced(result)

    def lookup(
        self,
        tokens: TokenInput,
        *,
        layout: Layout,
        user_id: str = "anonymous",
        tenant_id: str = "default",
        approximate: bool | None = None,
    ) -> ResumeResult:
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
            return self._announced(result)

    def _announced(self, result: ResumeResult) -> ResumeResult:
        """``result`` with the tokens its pages hold at each lossy encoding (when some copy is lossy)."""
        if not self.index.has_lossy or not result.matched_tokens:
            return result
        encodings = self.index.encodings([ref.page_id for ref in result.pages], result.page_tokens)
        return result.with_encodings(encodings) if encodings else result

    def nearest(
        self,
        tokens: TokenInput,
        *,
        session_id: str | None = None,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        k: int = 5,
    ) -> list[Candidate]:
        """The ``k`` stored versions nearest ``tokens``, each verified token by token: estimated
        and exact Jaccard, exact common prefix, first divergence, reusable tokens, containment.
        Nearest first: the version of which ``tokens`` hold the most distinct shingles (the
        version a next turn extends, however long the new turn), then exact Jaccard.

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
            layout, _tenant, user_ref, state = self._scope(session_id, tenant_id, user_id, layout)
            if user_ref is None:
                return []
            return near.candidates(buf, layout, user_ref, k=k, extra=state)[0]

    def explain(
        self,
        session_id: str | None,
        tokens: TokenInput,
        *,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        decode: Decode | None = None,
        context: int = 8,
    ) -> Explanation:
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

    def prefetch_candidates(
        self,
        tokens: TokenInput,
        *,
        session_id: str | None = None,
        tenant_id: str | None = None,
        user_id: str | None = None,
        layout: Layout | None = None,
        promote: bool = True,
    ) -> list[bytes]:
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

    @overload
    def read_pages(
        self, pages: Sequence[PageRef | bytes], *, tenant_id: str | None = None, load: bool = True, into: None = None
    ) -> list[bytes | None]: ...

    @overload
    def read_pages(
        self,
        pages: Sequence[PageRef | bytes],
        *,
        tenant_id: str | None = None,
        load: bool = True,
        into: Sequence[Any],
        ready: Callable[[list[int]], object] | None = None,
    ) -> list[memoryview | None]: ...

    def read_pages(
        self,
        pages: Sequence[PageRef | bytes],
        *,
        tenant_id: str | None = None,
        load: bool = True,
        into: Sequence[Any] | None = None,
        ready: Callable[[list[int]], object] | None = None,
    ) -> list[bytes | None] | list[memoryview | None]:
        """The payloads of pages (``PageRef`` or page id), in order, checksums verified.

        ``None`` for a page no tier holds any more or whose bytes fail verification (that
        page is quarantined: removed from the catalog, recorded in ``quarantine``), and,
        with ``tenant_id``, for a page of another tenant. Reads from disk are batched. With
        ``load=True`` (an engine waits for these pages) they are promoted to host; with
        ``load=False`` (inspection, export) only as the policy allows: after repeated access
        within ``promote_interval_s``, never during a demoted page's cool-down.

        ``into``: one writable buffer per page (a ``bytearray``, a row of a numpy array, a
        pinned staging tensor's memory), each exactly its page's size; each payload is put in
        its buffer (a sealed page decrypted straight into it) and a flat byte ``memoryview``
        of the buffer returned in its place, with no ``bytes`` made per page. ``InvalidInput``
        (nothing read) when their number or a size is wrong or one is read-only. The buffer of
        a page returned as ``None`` holds unspecified bytes.

        ``ready`` (with ``into`` only): called with the indexes (into ``pages``) of pages whose
        buffers hold their verified payloads, as soon as they do — the host tier's hits at
        once, then after each batched disk read — so a caller can move those while the rest
        are read. It runs in the calling thread, is told each page returned once, before this
        returns, and never a page returned as ``None``; what it raises, this raises.
        """
        ids = check_page_ids(pages)
        buffers = check_buffers(into, len(ids))
        check_name("tenant_id", tenant_id, optional=True)
        check_flag("load", load)
        check_ready(ready, buffers)
        with self._reading():
            if tenant_id is not None:
                allowed = [tenant == tenant_id for tenant in self.reader.tenants(ids)]
                ids = [i for i, ok in zip(ids, allowed) if ok]
                if buffers is not None:
                    buffers = [b for b, ok in zip(buffers, allowed) if ok]
                if ready is not None:
                    ready = _renumbered(ready, [i for i, ok in enumerate(allowed) if ok])
            read = self.reader.read(ids, load=load, into=buffers, ready=ready)
        self._wake_mover()
        if read.bad:
            applied = self.writer.apply(Change(quarantine=tuple(read.bad)))
            if applied.thinned:
                self.writer.compact_sparse(applied.thinned)
        payloads: list[Any] = read.payloads
        if tenant_id is None:
            return payloads
        found = iter(payloads)
        return [next(found) if ok else None for ok in allowed]

    def page_sizes(self, page_ids: Sequence[bytes], *, tenant_id: str | None = None) -> dict[bytes, int]:
        """``page_id -> size`` of the pages the catalog holds (of ``tenant_id`` only, if given)."""
        ids = check_page_ids(page_ids)
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading(), self.catalog.read() as conn:
            owners = pages.page_owners(conn, ids)
        return {p: size for p, (tenant, size) in owners.items() if tenant_id is None or tenant == tenant_id}

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
                    read = self.reader.read(ids[start : start + batch], prefetch=True)
                self._wake_mover()
                if read.bad:
                    self.writer.apply(Change(quarantine=tuple(read.bad)))

        if wait or not self.mover.submit(move):
            move()
        return len(ids)


def _renumbered(ready: Callable[[list[int]], object], positions: list[int]) -> Callable[[list[int]], object]:
    """``ready`` told indexes into a filtered list, as indexes into the list it was filtered
    from (``positions[j]``: where its ``j``-th item was)."""
    return lambda indexes: ready([positions[j] for j in indexes])
