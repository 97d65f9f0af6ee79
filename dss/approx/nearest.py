"""Approximate matching: near-duplicates of a prompt, verified exactly; why exact reuse stopped.

MinHash-LSH (:mod:`dss.approx.lsh`) only *proposes* versions of the prompt's namespace and layout;
every candidate is then compared with the prompt token by token, and the only reuse ever
reported is the exact common prefix whose pages some tier holds (DESIGN §3 rule 1). The page
ids of that prefix are the prompt's own chain ids (same namespace key, layout and tokens), so
nothing approximate can be served.

:class:`Nearest` answers ``Store.nearest``, ``resume(approximate=True)`` and ``Store.explain``
from the mirror; it builds a namespace's index from the catalog on its first use in this
process (or attaches to the shared Redis index when some node built it) and counts, per
tenant, the positions where prompts diverge (:meth:`Nearest.recurring`). Nothing here writes
to the catalog.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from dss.approx.explanation import Explanation, common_prefix, divergence_windows, realign
from dss.approx.lsh import Bucket, Hit
from dss.approx.minhash import shingle_hashes
from dss.approx.upkeep import Upkeep
from dss.catalog import sessions
from dss.core.errors import ErasureInProgress
from dss.core.types import Layout, PageId, VersionId
from dss.pages.index import PageIndex
from dss.sessions.matcher import SHARED_USER
from dss.sessions.mirror import Mirror
from dss.sessions.resume import Candidate, Rates, ResumeResult
from dss.sessions.state import SessionState
from dss.sessions.trie import Span

MAX_VERIFIED = 32
"""Most candidate versions compared exactly per query (the best LSH hits first)."""
RECURRING_KEPT = 1000
"""Most divergence positions counted per tenant (the rarest go first)."""

Decode = Callable[[list[int]], str]


class Nearest:
    """Near-duplicate search over one store's mirror. Not thread-safe; the store locks."""

    def __init__(self, mirror: Mirror, index: PageIndex, upkeep: Upkeep, rates: Rates, min_share: float) -> None:
        assert upkeep.lsh is not None
        self.mirror = mirror
        self.index = index
        self.upkeep = upkeep
        self.lsh = upkeep.lsh
        self.rates = rates
        self.min_share = min_share
        self._divergences: dict[str, Counter[int]] = {}

    # -- the index of a namespace ----------------------------------------------------------

    def bucket(self, user_ref: int, layout: Layout) -> Bucket:
        """The namespace's index for ``layout``, built from the catalog if this process lacks it
        (and, shared, nobody built it), with sessions other processes changed re-indexed."""
        lsh = self.lsh
        bucket = lsh.bucket(user_ref, layout.digest)
        mirror = self.mirror
        if bucket is None:
            bucket, built = lsh.open_bucket(user_ref, layout.digest, mirror.keys.of(user_ref).hash_key)
            if not built:
                with mirror.catalog.read() as conn:
                    for ref in sessions.namespace_sessions(conn, user_ref):
                        state = mirror.loaded(ref, conn)
                        if state is not None and state.layout.digest == layout.digest:
                            self.upkeep.stale.pop(ref, None)
                            self._index_session(bucket, state)
                lsh.mark_built(bucket)
        stale = [ref for ref, owner in self.upkeep.stale.items() if owner == user_ref]
        if stale:
            with mirror.catalog.read() as conn:
                for ref in stale:
                    state = mirror.loaded(ref, conn)
                    if state is None:  # deleted meanwhile
                        del self.upkeep.stale[ref]
                    elif state.layout.digest == layout.digest:  # another layout's waits for its own index
                        del self.upkeep.stale[ref]
                        self._index_session(bucket, state)
        return bucket

    def build_all(self) -> int:
        """Build (or attach to) the index of every namespace and layout that has versions, the
        most recently used first, while the index has room; the rest are built on first use.
        Returns how many were built. A namespace being erased is skipped."""
        with self.mirror.catalog.read() as conn:
            records = [rec for rec, count in sessions.list_sessions(conn) if count]
        records.sort(key=lambda rec: rec.last_access, reverse=True)
        done: set[tuple[int, bytes]] = set()
        room = self.lsh.settings.max_entries
        for rec in records:
            key = (rec.user_ref, rec.layout.digest)
            if key in done or rec.user_id == SHARED_USER:
                continue
            if self.lsh.num_entries >= room:
                break
            try:
                self.bucket(rec.user_ref, rec.layout)
            except ErasureInProgress:
                continue
            done.add(key)
        return len(done)

    def _index_session(self, bucket: Bucket, state: SessionState) -> None:
        for version_id in state.versions:
            self.lsh.add(bucket, state.ref, version_id, state.tokens(version_id), state.layout.page_tokens)

    # -- candidates ------------------------------------------------------------------------

    def candidates(
        self,
        buf: bytes | memoryview,
        layout: Layout,
        user_ref: int,
        *,
        k: int,
        extra: SessionState | None = None,
        also: tuple[tuple[int, int], ...] = (),
    ) -> tuple[list[Candidate], int]:
        """The ``k`` stored versions nearest the prompt, all of namespace ``user_ref`` and
        ``layout``, each verified; also how many were verified. Nearest first: the version of
        which the prompt holds the most distinct shingles (a next turn's nearest is the version
        it extends, not a shorter earlier turn), then exact Jaccard, then common prefix.

        ``extra``'s versions (the request's own session) and the ``also`` versions
        (``(session_ref, version_id)``) are compared too, proposed or not.
        """
        prompt = np.frombuffer(buf, dtype=np.uint32)
        if not len(prompt):
            return [], 0  # nothing is near an empty prompt
        bucket = self.bucket(user_ref, layout)
        wanted = self._wanted(self.lsh.query(bucket, buf, layout.page_tokens), extra, also)
        salt = bucket.salt
        prompt_hashes = shingle_hashes(prompt, self.lsh.settings.shingle_tokens, salt)
        prompt_sig, _ = self.lsh.signer.values(prompt_hashes)
        prompt_set = np.unique(prompt_hashes)
        out: dict[tuple[int, int], tuple[Candidate, int]] = {}
        verified = 0
        with self.mirror.catalog.read() as conn:
            for session_ref, version_id in wanted:
                if verified >= MAX_VERIFIED and (extra is None or session_ref != extra.ref):
                    continue
                state = (
                    extra if extra is not None and extra.ref == session_ref else self.mirror.loaded(session_ref, conn)
                )
                if state is None or state.user_ref != user_ref or state.layout.digest != layout.digest:
                    continue  # gone, or (never, by construction) of another namespace or layout
                vid = state.head_id if version_id == -1 else version_id
                if vid is None or vid not in state.versions or (session_ref, vid) in out:
                    continue
                verified += 1
                out[(session_ref, vid)] = self._verify(prompt, prompt_sig, prompt_set, state, vid, salt)
        ranked = sorted(
            out.values(),
            key=lambda cs: (-cs[1], -cs[0].jaccard, -cs[0].common_prefix, cs[0].session_id, cs[0].version_id),
        )
        return [c for c, _ in ranked[:k]], verified

    @staticmethod
    def _wanted(
        hits: list[Hit], extra: SessionState | None, also: tuple[tuple[int, int], ...]
    ) -> list[tuple[int, int]]:
        """The versions to compare, ``(session_ref, version_id)`` (``-1``: the session's head),
        in order: whole-version hits (longest first), window hits, ``extra``'s, ``also``."""
        wanted: dict[tuple[int, int], None] = {}
        for hit in sorted(hits, key=lambda h: (h.entry.is_window, -h.entry.num_tokens)):
            entry = hit.entry
            wanted.setdefault((entry.session_ref, entry.version_id))
            if entry.is_window:
                wanted.setdefault((entry.session_ref, -1))  # the session's head, which holds the window too
        if extra is not None:
            for version_id in extra.versions:
                wanted.setdefault((extra.ref, version_id))
        for pair in also:
            wanted.setdefault(pair)
        return list(wanted)

    def _verify(
        self,
        prompt: np.ndarray,
        prompt_sig: np.ndarray,
        prompt_set: np.ndarray,
        state: SessionState,
        version_id: int,
        salt: int,
    ) -> tuple[Candidate, int]:
        """The version compared with the prompt, and how many of its distinct shingles the
        prompt holds (what ranks it: the version the prompt holds most of comes first)."""
        stored = np.frombuffer(state.tokens(version_id), dtype=np.uint32)
        hashes = shingle_hashes(stored, self.lsh.settings.shingle_tokens, salt)
        sig, _ = self.lsh.signer.values(hashes)
        mine = np.unique(hashes)
        shared = len(np.intersect1d(prompt_set, mine, assume_unique=True))
        union = len(prompt_set) + len(mine) - shared
        common = common_prefix(prompt, stored)
        page_tokens = state.layout.page_tokens
        candidate = Candidate(
            state.session_id,
            VersionId(version_id),
            len(stored),
            float(np.mean(sig == prompt_sig)),
            shared / union if union else 1.0,
            common,
            common if common < min(len(prompt), len(stored)) else None,
            len(self._available(state, version_id, common // page_tokens)) * page_tokens,
            shared / len(mine) if len(mine) else 1.0,
        )
        return candidate, shared

    def _available(self, state: SessionState, version_id: int, num_pages: int) -> list[tuple[PageId, int]]:
        """The version's first pages, up to ``num_pages``, that some tier holds, as ``(id, code)``."""
        ids = state.page_ids(version_id)[:num_pages]
        code_of = self.index.code_of
        out = []
        for page_id in ids:
            code = code_of(page_id)
            if not code:
                break
            out.append((page_id, code))
        return out

    # -- approximate resume ----------------------------------------------------------------

    def improve(
        self,
        result: ResumeResult,
        buf: bytes | memoryview,
        layout: Layout,
        user_ref: int | None,
        state: SessionState | None,
        tenant_id: str,
    ) -> ResumeResult:
        """``result`` (the exact paths' answer), or a longer exact reuse found through an LSH
        candidate; either way with the candidates' count and the nearest near-duplicate.
        Runs the search only when ``result`` matched less than ``min_share`` of the prompt."""
        num_prompt = result.num_prompt_tokens
        if user_ref is None or not num_prompt or result.matched_tokens >= self.min_share * num_prompt:
            return result
        found, verified = self.candidates(buf, layout, user_ref, k=MAX_VERIFIED)
        if not found:
            return result.annotated(verified, None)
        near = found[0]
        if near.divergence is not None:
            self.count_divergence(tenant_id, near.divergence)
        best = max(found, key=lambda c: c.matched_tokens)
        if best.matched_tokens <= result.matched_tokens:
            return result.annotated(verified, near)
        owner = self.mirror.state(best.session_id, tenant_id)
        pages = self._available(owner, best.version_id, best.matched_tokens // layout.page_tokens)
        span = Span(0, tuple(p for p, _ in pages), bytearray(c for _, c in pages), len(pages))
        same = state is not None and owner.ref == state.ref
        return ResumeResult(
            result.session_id,
            best.version_id if same else None,
            len(pages) * layout.page_tokens,
            num_prompt,
            result.num_history_tokens,
            result.page_tokens,
            result.page_bytes,
            spans=[span],
            rates=self.rates,
            source="lsh",
            num_candidates=verified,
            near=near,
        )

    # -- explain ---------------------------------------------------------------------------

    def explain(
        self,
        result: ResumeResult,
        buf: bytes | memoryview,
        layout: Layout,
        user_ref: int | None,
        state: SessionState | None,
        tenant_id: str,
        *,
        decode: Decode | None = None,
        context: int = 8,
    ) -> Explanation:
        """Where the prompt first diverges from its nearest stored version, the tokens on both
        sides, where they run together again and what the divergence costs (see :class:`Explanation`)."""
        prompt = np.frombuffer(buf, dtype=np.uint32)
        base = Explanation(len(prompt), result.matched_tokens, result.source, None, None)
        near = self._nearest_one(buf, layout, user_ref, state)
        if near is None:
            return replace(base, recurring=self.recurring(tenant_id))
        owner = self.mirror.state(near.session_id, tenant_id)
        pos = near.divergence
        if pos is None:
            return replace(
                base,
                nearest=near,
                would_reuse_tokens=max(near.matched_tokens, result.matched_tokens),
                recurring=self.recurring(tenant_id),
            )
        self.count_divergence(tenant_id, pos)
        stored = np.frombuffer(owner.tokens(near.version_id), dtype=np.uint32)
        resync = realign(prompt, stored, pos, self.lsh.settings.shingle_tokens)
        would = max(self._would_reuse(owner, near, resync, layout.page_tokens), result.matched_tokens)
        p_win, s_win, start = divergence_windows(prompt, stored, pos, context)
        r_p, r_s, shared = resync if resync is not None else (None, None, 0)
        return replace(
            base,
            nearest=near,
            divergence=pos,
            prompt_window=p_win,
            stored_window=s_win,
            window_start=start,
            prompt_text=decode(p_win) if decode is not None else None,
            stored_text=decode(s_win) if decode is not None else None,
            resync_prompt=r_p,
            resync_stored=r_s,
            num_shared_after=shared,
            would_reuse_tokens=would,
            lost_tokens=would - result.matched_tokens,
            recurring=self.recurring(tenant_id),
        )

    def _nearest_one(
        self, buf: bytes | memoryview, layout: Layout, user_ref: int | None, state: SessionState | None
    ) -> Candidate | None:
        """The stored version most like the prompt, among the namespace's (``None``: none)."""
        if user_ref is None:
            return None
        self.bucket(user_ref, layout)  # every session of the namespace loaded
        also = self._longest_prefix(buf, layout, user_ref)
        found, _ = self.candidates(buf, layout, user_ref, k=1, extra=state, also=also)
        return found[0] if found else None

    def _would_reuse(
        self, owner: SessionState, near: Candidate, resync: tuple[int, int, int] | None, page_tokens: int
    ) -> int:
        """The page-aligned tokens of ``near`` with stored pages that resume would reuse had the
        prompt not diverged: up to where it runs along the version again, when it does."""
        if resync is None:
            return near.matched_tokens
        _, r_s, shared = resync
        return len(self._available(owner, near.version_id, (r_s + shared) // page_tokens)) * page_tokens

    def problems(self) -> list[str]:
        """Entries of this process's index whose session is gone or of another namespace (for
        ``Store.check()``; sessions waiting to be re-indexed are not problems)."""
        entries = [(b.user_ref, e) for b in self.lsh.buckets.values() for e in b.entries.values()]
        if not entries:
            return []
        with self.mirror.catalog.read() as conn:
            owner = dict(sessions.owners(conn, sorted({e.session_ref for _, e in entries})))
        out = []
        for user_ref, entry in entries:
            if owner.get(entry.session_ref) != user_ref:
                where = "is gone" if entry.session_ref not in owner else "belongs to another namespace"
                out.append(f"LSH entry {entry.key()} of namespace {user_ref}: its session {where}")
        return out

    def _longest_prefix(self, buf: bytes | memoryview, layout: Layout, user_ref: int) -> tuple[tuple[int, int], ...]:
        """The version of the namespace and layout that shares the longest exact prefix with the
        prompt (by walking each loaded session's trie), so explain names the version exact reuse
        ran along even when LSH proposes nothing (a short prompt, an early divergence)."""
        best: tuple[int, int, int] | None = None
        for state in list(self.mirror.sessions.values()):
            if state.user_ref != user_ref or state.layout.digest != layout.digest or not state.versions:
                continue
            match = state.trie.walk(buf)
            depth = match.num_tokens
            if not depth or (best is not None and depth <= best[0]):
                continue
            node = next(n for n in match.path if n.start < depth <= n.depth)
            version_id = state.trie.version_along(node, depth, state.head)
            if version_id is not None:
                best = (depth, state.ref, version_id)
        return ((best[1], best[2]),) if best is not None else ()

    # -- recurring divergences -------------------------------------------------------------

    def count_divergence(self, tenant_id: str, position: int) -> None:
        """Count one prompt of the tenant diverging at ``position`` (a position, no token)."""
        counts = self._divergences.setdefault(tenant_id, Counter())
        counts[position] += 1
        if len(counts) > RECURRING_KEPT:
            del counts[min(counts, key=counts.__getitem__)]

    def recurring(self, tenant_id: str, n: int = 10) -> list[tuple[int, int]]:
        """The tenant's ``n`` most frequent divergence positions, ``(position, count)``."""
        counts = self._divergences.get(tenant_id)
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n] if counts else []
