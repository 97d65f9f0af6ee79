"""The answer of ``resume``: how much of a prompt is already computed, where, and whether to load it.

A :class:`ResumeResult` is computed eagerly where it is cheap (counts, the version) and
lazily where it is not (one :class:`PageRef` per page), from a snapshot taken when
``resume`` ran: later changes to the store do not alter it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from dss.core.types import TIER_CODE, TIERS, PageId, PageRef, VersionId
from dss.sessions.trie import Span


class Rates(NamedTuple):
    """Speeds used to estimate load time against recompute time."""

    tier_bytes_per_s: dict[str, float]
    recompute_tokens_per_s: float


class LoadDecision(NamedTuple):
    """Load the matched pages or recompute them: the estimates it was made from.

    ``load_seconds``: the matched pages' bytes over each tier's read speed;
    ``recompute_seconds``: their tokens over ``recompute_tokens_per_s`` (the store's
    ``recompute_tokens_per_s``, or an engine's measured prefill speed); ``load``: whether
    loading is estimated faster (never for nothing matched)."""

    load: bool
    load_seconds: float
    recompute_seconds: float
    recompute_tokens_per_s: float


class Candidate(NamedTuple):
    """A stored version near a prompt, verified token by token (what ``nearest`` returns).

    ``estimated_jaccard`` is the MinHash estimate, ``jaccard`` the exact Jaccard similarity of
    the two token-shingle sets; ``common_prefix`` the exact number of leading tokens the
    prompt and the version share; ``divergence`` the first position where they differ
    (``None`` when one is a prefix of the other); ``matched_tokens`` the page-aligned tokens
    of that common prefix whose pages some tier holds — what a resume could reuse from it;
    ``containment`` the share of the version's distinct shingles the prompt holds (``1.0``
    for a version the prompt extends unchanged).
    """

    session_id: str
    version_id: VersionId
    num_tokens: int
    estimated_jaccard: float
    jaccard: float
    common_prefix: int
    divergence: int | None
    matched_tokens: int
    containment: float = 0.0


class ResumeResult:
    """How many leading tokens of a prompt have stored, readable KV, and where.

    ``matched_tokens`` is page-aligned; ``pages`` has one :class:`PageRef` per matched
    page in prompt order; ``tiers`` maps tier name to matched tokens found there (fastest
    tier per page); ``version_id`` is the version of the session whose history the match
    runs along (the head when it does), ``None`` when nothing matched or the match came
    from the namespace's other sessions only. ``num_history_tokens`` is how many leading
    tokens the session's history holds, KV or not.

    ``source`` names the path the last matched page came from: ``"session"`` (the session's
    trie), ``"shared"`` (the tenant's shared prefixes), ``"namespace"`` (exact chain-hash
    lookup), ``"lsh"`` (a near-duplicate proposed by MinHash-LSH and verified exactly), or
    ``None`` when nothing matched. With approximate matching, ``num_candidates`` is how many
    candidate versions were verified and ``near`` the nearest of them (its divergence from
    the prompt included); ``0`` and ``None`` otherwise.

    ``encodings`` maps each lossy encoding (:mod:`dss.core.precision`) to the matched tokens
    whose pages a load would serve in it (empty: every matched token is exact, the saved
    bytes); ``lossy_tokens`` is their sum.
    """

    __slots__ = (
        "_pages",
        "_rates",
        "_spans",
        "encodings",
        "matched_tokens",
        "near",
        "num_candidates",
        "num_history_tokens",
        "num_prompt_tokens",
        "page_bytes",
        "page_tokens",
        "session_id",
        "source",
        "version_id",
    )

    def __init__(
        self,
        session_id: str | None,
        version_id: VersionId | None,
        matched_tokens: int,
        num_prompt_tokens: int,
        num_history_tokens: int,
        page_tokens: int,
        page_bytes: int,
        *,
        spans: Sequence[Span] = (),
        pages: list[PageRef] | None = None,
        rates: Rates | None = None,
        source: str | None = None,
        num_candidates: int = 0,
        near: Candidate | None = None,
        encodings: dict[str, int] | None = None,
    ) -> None:
        self.session_id = session_id
        self.version_id = version_id
        self.matched_tokens = matched_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_history_tokens = num_history_tokens
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.source = source if matched_tokens else None
        self.num_candidates = num_candidates
        self.near = near
        self._spans = spans
        self._pages = pages
        self._rates = rates
        self.encodings: dict[str, int] = dict(encodings or {})

    def annotated(self, num_candidates: int, near: Candidate | None) -> ResumeResult:
        """This result with what approximate matching verified (the match itself unchanged)."""
        return ResumeResult(
            self.session_id,
            self.version_id,
            self.matched_tokens,
            self.num_prompt_tokens,
            self.num_history_tokens,
            self.page_tokens,
            self.page_bytes,
            spans=self._spans,
            pages=self._pages,
            rates=self._rates,
            source=self.source,
            num_candidates=num_candidates,
            near=near,
            encodings=self.encodings,
        )

    def with_encodings(self, encodings: dict[str, int]) -> ResumeResult:
        """This result, saying how many matched tokens each lossy encoding holds."""
        out = self.annotated(self.num_candidates, self.near)
        out.encodings = dict(encodings)
        return out

    @property
    def lossy_tokens(self) -> int:
        """Matched tokens a load would serve approximate (lower-precision copies)."""
        return sum(self.encodings.values())

    @property
    def num_new_tokens(self) -> int:
        """Tokens of the prompt the engine still has to compute."""
        return self.num_prompt_tokens - self.matched_tokens

    @property
    def pages(self) -> list[PageRef]:
        """One reference per matched page, in order (built on first access)."""
        if self._pages is None:
            out: list[PageRef] = []
            for span in self._spans:
                for i in range(span.count):
                    out.append(PageRef(span.first + i, PageId(span.page_ids[i]), TIERS[span.codes[i] - 1]))
            self._pages = out
        return self._pages

    @property
    def tiers(self) -> dict[str, int]:
        """Matched tokens per tier (only tiers that hold some)."""
        counts: dict[str, int] = {}
        if self._pages is not None or not self._spans:
            for ref in self.pages:
                counts[ref.tier] = counts.get(ref.tier, 0) + self.page_tokens
            return counts
        for name, code in TIER_CODE.items():
            n = sum(span.codes.count(code, 0, span.count) for span in self._spans)
            if n:
                counts[name] = n * self.page_tokens
        return counts

    @property
    def load_seconds(self) -> float:
        """Estimated time to load the matched pages from their tiers (none for pages on ``device``:
        the engine holding them needs no load)."""
        return self.decision().load_seconds

    @property
    def recompute_seconds(self) -> float:
        """Estimated time to recompute the matched tokens instead."""
        return self.decision().recompute_seconds

    @property
    def should_load(self) -> bool:
        """Whether loading the matched pages is estimated to beat recomputing them."""
        return self.decision().load

    def decision(
        self, recompute_tokens_per_s: float | None = None, *, tiers: Mapping[str, int] | None = None
    ) -> LoadDecision:
        """Load or recompute, estimated with the store's speeds — or, given
        ``recompute_tokens_per_s`` (> 0), with that prefill speed (an engine's measured one) —
        for the matched tokens, or for ``tiers`` (tier name -> tokens: a part of the match, from
        where the engine plans to load it). Without speeds (a result built without them):
        load whatever matched, estimates 0."""
        counts = self.tiers if tiers is None else dict(tiers)
        if self._rates is None:
            return LoadDecision(sum(counts.values()) > 0, 0.0, 0.0, recompute_tokens_per_s or 0.0)
        speed = recompute_tokens_per_s or self._rates.recompute_tokens_per_s
        per_token = self.page_bytes / self.page_tokens
        load = sum(
            tokens * per_token / self._rates.tier_bytes_per_s.get(tier, 1e9)
            for tier, tokens in counts.items()
            if tier != "device"
        )
        recompute = sum(counts.values()) / speed
        return LoadDecision(sum(counts.values()) > 0 and load < recompute, load, recompute, speed)

    def __repr__(self) -> str:
        return (
            f"ResumeResult(session_id={self.session_id!r}, matched_tokens={self.matched_tokens}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, version_id={self.version_id}, tiers={self.tiers}, "
            f"source={self.source!r}{f', encodings={self.encodings}' if self.encodings else ''})"
        )
