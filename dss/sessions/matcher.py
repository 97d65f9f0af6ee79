"""Matching a prompt: what ``resume`` and ``lookup`` answer.

In order: the session's own trie (every version), then — for the pages the trie lacks —
the tenant's registered shared prefixes, then, past the trie's match, an exact chain-hash
lookup of further pages in the namespace. Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from dss.core.hashing import chain_ids, chain_root
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import Layout, PageId, VersionId
from dss.pages.index import PageIndex
from dss.sessions.mirror import Mirror
from dss.sessions.resume import Rates, ResumeResult
from dss.sessions.state import SessionState
from dss.sessions.trie import Match, Span
from dss.tiers.device import Residency

SHARED_PREFIX = "~shared-"
"""Session ids of a tenant's registered shared prefixes (one session per layout)."""
SHARED_USER = "~shared"
"""The owner of a tenant's shared prefixes: the tenant, not any user."""


def shared_session_id(layout: Layout) -> str:
    """The id of the session holding a tenant's shared prefixes of one layout."""
    return f"{SHARED_PREFIX}{layout.digest.hex()[:16]}"


class _Found(NamedTuple):
    """What a match found so far: its spans and pages, where the last came from, the
    session's history along the prompt, the trie's match, and the session trie's page ids of
    the prompt (``None``: no shared prefix was consulted)."""

    spans: list[Span]
    num_pages: int
    source: str
    history: int
    match: Match | None
    own_ids: Sequence[PageId] | None


class Matcher:
    """Answers ``resume`` and ``lookup`` from this process's mirror and page index."""

    def __init__(self, mirror: Mirror, index: PageIndex, rates: Rates, residency: Residency | None = None) -> None:
        self.mirror = mirror
        self.index = index
        self.rates = rates
        self.residency = residency
        self._residency_seen = -1

    def _catch_up_residency(self) -> None:
        """Expire engines' stale reports; a change of what engines hold re-codes every namespace's tiers."""
        if self.residency is None:
            return
        self.residency.expire(at_most_every_s=1.0)
        if self.residency.version != self._residency_seen:
            self._residency_seen = self.residency.version
            self.index.bump_all()  # tier codes cached per namespace generation now name other tiers

    def _namespace_span(
        self,
        buf: bytes | memoryview,
        layout: Layout,
        user_ref: int,
        own_ids: Sequence[PageId] | None,
        spans: list[Span],
        num_pages: int,
    ) -> Span | None:
        """Past the pages found so far, the namespace's further pages by exact chain-hash lookup."""
        page_tokens = layout.page_tokens
        key = self.mirror.keys.of(user_ref).hash_key
        prev = self._user_page_id(buf, key, layout, own_ids, spans, num_pages)

        def chain(prev_id: PageId, k: int) -> PageId:
            return chain_ids(key, prev_id, buf, k, 1, page_tokens)[0]

        return _chain_span(chain, prev, num_pages, len(buf) // TOKEN_BYTES // page_tokens, self.index.code_of)

    def match(
        self, buf: bytes | memoryview, layout: Layout, tenant_id: str, user_ref: int | None, state: SessionState | None
    ) -> ResumeResult:
        """The resume answer for ``buf``: session trie, shared prefixes, then chain lookup."""
        self._catch_up_residency()
        page_tokens = layout.page_tokens
        found = self._from_tries(buf, layout, tenant_id, state)
        version_id = _version_of(state, found.match, min(found.num_pages * page_tokens, found.history))
        total = len(buf) // TOKEN_BYTES // page_tokens
        if user_ref is not None and found.history < (found.num_pages + 1) * page_tokens and found.num_pages < total:
            if state is None:
                self.mirror.namespace(user_ref)
            extra = self._namespace_span(buf, layout, user_ref, found.own_ids, found.spans, found.num_pages)
            if extra is not None:
                found = found._replace(
                    spans=[*found.spans, extra], num_pages=found.num_pages + extra.count, source="namespace"
                )
        return ResumeResult(
            state.session_id if state is not None else None,
            version_id,
            found.num_pages * page_tokens,
            len(buf) // TOKEN_BYTES,
            found.history,
            page_tokens,
            layout.page_bytes,
            spans=found.spans,
            rates=self.rates,
            source=found.source,
        )

    def _from_tries(
        self, buf: bytes | memoryview, layout: Layout, tenant_id: str, state: SessionState | None
    ) -> _Found:
        """The pages of ``buf`` the session's trie holds, then those the tenant's shared
        prefixes hold past them."""
        spans: list[Span] = []
        history = 0
        match = None
        if state is not None:
            match = state.trie.walk(buf)
            history = match.num_tokens
            spans = state.trie.available(match, state.namespace.gen, self.index.code_of)
        found = _Found(spans, sum(span.count for span in spans), "session", history, match, None)
        shared = self.mirror.shared(tenant_id, layout, shared_session_id(layout))
        if shared is None:
            return found
        extra, own_ids = self._fill_from_shared(buf, state, match, shared, found.num_pages)
        if extra is None:
            return found._replace(own_ids=own_ids)
        return found._replace(
            spans=[*spans, extra], num_pages=found.num_pages + extra.count, source="shared", own_ids=own_ids
        )

    def _fill_from_shared(
        self, buf: bytes | memoryview, state: SessionState | None, match: Match | None, shared: SessionState, first: int
    ) -> tuple[Span | None, Sequence[PageId]]:
        """Pages ``first, first+1, ...`` from the session's own trie or, where it lacks them,
        from the shared prefixes; also the session trie's page ids of the prompt."""
        code_of = self.index.code_of
        own_ids: Sequence[PageId] = ()
        own_codes = bytearray()
        if state is not None:
            assert match is not None
            own_ids, own_codes = state.trie.page_table(match, state.namespace.gen, code_of)
        shared_ids, shared_codes = shared.trie.page_table(shared.trie.walk(buf), shared.namespace.gen, code_of)
        ids: list[PageId] = []
        codes = bytearray()
        k = first
        while k < max(len(own_ids), len(shared_ids)):
            if k < len(own_ids) and own_codes[k]:
                ids.append(own_ids[k])
                codes.append(own_codes[k])
            elif k < len(shared_ids) and shared_codes[k]:
                ids.append(shared_ids[k])
                codes.append(shared_codes[k])
            else:
                break
            k += 1
        return (Span(first, tuple(ids), codes, len(ids)) if ids else None), own_ids

    def _user_page_id(
        self,
        buf: bytes | memoryview,
        key: bytes,
        layout: Layout,
        own_ids: Sequence[PageId] | None,
        spans: list[Span],
        num_pages: int,
    ) -> PageId:
        """The namespace's chain id of page ``num_pages - 1`` of the prompt (the root if none).

        ``own_ids`` is ``None`` when no shared prefix was consulted: every span then holds
        the namespace's own ids.
        """
        if num_pages == 0:
            return chain_root(key, layout.digest)
        if own_ids is None:
            return spans[-1].page_ids[spans[-1].count - 1]
        known = min(len(own_ids), num_pages)
        prev = own_ids[known - 1] if known else chain_root(key, layout.digest)
        if known < num_pages:
            prev = chain_ids(key, prev, buf, known, num_pages - known, layout.page_tokens)[-1]
        return prev


def _chain_span(
    chain: Callable[[PageId, int], PageId], prev: PageId, first: int, end: int, code_of: Callable[[PageId], int]
) -> Span | None:
    """Pages ``first, first+1, ... < end`` whose chain-hash ids some tier holds, as one span."""
    ids: list[PageId] = []
    codes = bytearray()
    for k in range(first, end):
        page_id = chain(prev, k)
        code = code_of(page_id)
        if not code:
            break
        ids.append(page_id)
        codes.append(code)
        prev = page_id
    return Span(first, tuple(ids), codes, len(ids)) if ids else None


def _version_of(state: SessionState | None, match: Match | None, depth: int) -> VersionId | None:
    """The version along the trie's match that the first ``depth`` matched tokens belong to
    (``None`` when nothing of the session matched)."""
    if state is None or match is None or not depth:
        return None
    node = next(n for n in match.path if n.start < depth <= n.depth)
    return state.trie.version_along(node, depth, state.head)
