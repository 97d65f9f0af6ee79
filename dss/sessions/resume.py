"""The answer of ``resume``: how much of a prompt is already computed, where, and whether to load it.

A :class:`ResumeResult` is computed eagerly where it is cheap (counts, the version) and
lazily where it is not (one :class:`PageRef` per page), from a snapshot taken when
``resume`` ran: later changes to the store do not alter it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from dss.core.types import TIER_CODE, TIERS, PageId, PageRef, VersionId
from dss.sessions.trie import Span


class Rates(NamedTuple):
    """Speeds used to estimate load time against recompute time."""

    tier_bytes_per_s: dict[str, float]
    recompute_tokens_per_s: float


class Candidate(NamedTuple):
    """A stored version near a prompt, verified token by token (what ``nearest`` returns).

    ``estimated_jaccard`` is the MinHash estimate, ``jaccard`` the exact Jaccard similarity of
    the two token-shingle sets; ``common_prefix`` the exact number of leading tokens the
    prompt and the version share; ``divergence`` the first position where they differ
    (``None`` when one is a prefix of the other); ``matched_tokens`` the page-aligned tokens
    of that common prefix whose pages some tier holds — what a resume could reuse from it.
    """

    session_id: str
    version_id: VersionId
    num_tokens: int
    estimated_jaccard: float
    jaccard: float
    common_prefix: int
    divergence: int | None
    matched_tokens: int


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
        if self._rates is None:
            return 0.0
        per_page = self.page_bytes / self.page_tokens
        return sum(
            tokens * per_page / self._rates.tier_bytes_per_s.get(tier, 1e9)
            for tier, tokens in self.tiers.items()
            if tier != "device"
        )

    @property
    def recompute_seconds(self) -> float:
        """Estimated time to recompute the matched tokens instead."""
        if self._rates is None:
            return 0.0
        return self.matched_tokens / self._rates.recompute_tokens_per_s

    @property
    def should_load(self) -> bool:
        """Whether loading the matched pages is estimated to beat recomputing them."""
        return self.matched_tokens > 0 and self.load_seconds < self.recompute_seconds

    def __repr__(self) -> str:
        return (
            f"ResumeResult(session_id={self.session_id!r}, matched_tokens={self.matched_tokens}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, version_id={self.version_id}, tiers={self.tiers}, "
            f"source={self.source!r}{f', encodings={self.encodings}' if self.encodings else ''})"
        )
