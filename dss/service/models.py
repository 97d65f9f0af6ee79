"""The HTTP API's wire format: pydantic request and response models.

Requests are validated here (types, token ids in ``[0, 2**32)``); everything about meaning
(names, layouts, page sizes, versions) is left to the store, so the service raises exactly
the errors the embedded store raises. Responses are built from dss's value types, and turned
back into them by the client, by :mod:`dss.service.codec`; the response models of the core
results are derived from those types there.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dss.approx.explanation import Explanation
from dss.core.tokens import MAX_TOKEN
from dss.core.types import Session, Version
from dss.service.codec import LayoutModel, PageIdHex, check_unicode, list_of, model_of
from dss.sessions.resume import Candidate
from dss.writes.compaction import Compaction

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN)]
Tokens = Annotated[
    list[TokenId], Field(description="Token ids in [0, 2**32); at most the server's max_tokens (see /v1/info).")
]
PageData = Annotated[str, Field(description="A page payload, standard base64.")]
_CANONICAL_INDEX = re.compile(r"0|[1-9][0-9]*")


def _page_index(key: Any) -> int:
    """A page key (a JSON object's name) as its index. Only the canonical decimal form is one
    (``"0"``, ``"17"``): pydantic would also read ``"00"``, ``"+1"``, ``" 1"`` or ``"1.0"`` as an
    index, and a body naming page 0 as both ``"0"`` and ``"00"`` would lose one payload."""
    if not isinstance(key, str) or _CANONICAL_INDEX.fullmatch(key) is None:
        raise PydanticCustomError(
            "page_index",
            "a page index is a decimal integer from 0, without sign, spaces or leading zeros, got {key}",
            {"key": repr(key)},
        )
    return int(key)


PageIndex = Annotated[int, BeforeValidator(_page_index)]
Pages = dict[PageIndex, PageData]
Int64 = Annotated[int, Field(strict=True, ge=-(1 << 63), le=(1 << 63) - 1)]
SqlParam = None | StrictBool | Int64 | float | StrictStr
TenantField = Annotated[
    str | None,
    Field(
        description="Tenant to act in; default the API key's own. Only admin keys "
        "may name another tenant, and only to read."
    ),
]


class _Model(BaseModel):
    """A request body: unknown fields are refused, and so is text that is not valid Unicode."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data


class _Out(BaseModel):
    """A response body."""


class TaggedValue(_Out):
    """An SQL cell JSON cannot carry as is (see the module docstring)."""

    type: Literal["bytes", "float", "datetime", "date", "time", "decimal", "json", "text"]
    value: str


SqlCell = None | bool | int | float | str | TaggedValue

# -- requests ----------------------------------------------------------------------------------


class CreateSessionIn(_Model):
    session_id: str
    user_id: str = "anonymous"
    layout: LayoutModel
    tenant_id: TenantField = None


class CommitIn(_Model):
    session_id: str
    tokens: Tokens
    pages: Pages | None = Field(None, description="Page index -> payload; only full pages.")
    label: str | None = None
    tenant_id: TenantField = None


class SavePagesIn(_Model):
    session_id: str | None = Field(description="The session, or null to keep the pages for (user_id, layout).")
    tokens: Tokens
    pages: Pages
    user_id: str | None = None
    layout: LayoutModel | None = None
    tenant_id: TenantField = None


Approximate = Annotated[
    StrictBool | None,
    Field(description="Verify MinHash-LSH candidates when the exact match is short (default: the store's setting)."),
]


class ResumeIn(_Model):
    session_id: str
    tokens: Tokens
    tenant_id: TenantField = None
    approximate: Approximate = None


class LookupIn(_Model):
    tokens: Tokens
    layout: LayoutModel
    user_id: str = "anonymous"
    tenant_id: TenantField = None
    approximate: Approximate = None


class _ScopeIn(_Model):
    """A prompt and where to look for its near-duplicates: ``session_id``'s namespace and
    layout, or else ``(user_id, layout)`` of the tenant."""

    tokens: Tokens
    session_id: str | None = None
    user_id: str | None = None
    layout: LayoutModel | None = None
    tenant_id: TenantField = None


class NearestIn(_ScopeIn):
    """A near-duplicate search."""

    k: StrictInt = 5


class ExplainIn(_ScopeIn):
    """Why exact reuse of a prompt stops where it does."""

    context: StrictInt = 8


class RollbackIn(_Model):
    session_id: str
    version_id: StrictInt
    tenant_id: TenantField = None


class BranchIn(_Model):
    session_id: str
    version_id: StrictInt
    new_session_id: str
    label: str | None = None
    tenant_id: TenantField = None


class PinIn(_Model):
    session_id: str
    version_id: StrictInt
    pinned: StrictBool = True
    tenant_id: TenantField = None


class PrefetchIn(_Model):
    session_id: str
    tenant_id: TenantField = None
    wait: StrictBool = Field(False, description="Answer once the pages moved, not at once.")


class PrefetchCandidatesIn(_ScopeIn):
    """The pages the nearest near-duplicates let a prompt reuse."""

    promote: StrictBool = Field(True, description="Read them now, bringing disk pages into the host tier.")


class RegisterPrefixIn(_Model):
    tokens: Tokens
    pages: Pages = Field(description="Page index -> payload; only full pages.")
    layout: LayoutModel
    label: str | None = None
    tenant_id: TenantField = None


class EnginePagesIn(_Model):
    engine_id: str
    page_ids: list[PageIdHex]


class EngineIn(_Model):
    engine_id: str


class CompactIn(_Model):
    dry_run: StrictBool = False


class PrefetchOut(_Model):
    session_id: str
    num_pages: int
    """Pages of the head moving up to host in the background."""


class ForgetUserIn(_Model):
    user_id: str
    tenant_id: str = Field(
        description="The user's tenant (required: an erasure always names it). It must be the API "
        "key's own tenant; an admin key may name another tenant only for a dry run."
    )
    dry_run: StrictBool = False


class ReadPagesIn(_Model):
    page_ids: list[PageIdHex]
    tenant_id: TenantField = None
    load: StrictBool = Field(
        True,
        description="An engine waits for these pages: promote them to host (else only as the placement policy allows).",
    )


class PageSizesIn(_Model):
    page_ids: list[PageIdHex]
    tenant_id: TenantField = None


class SqlIn(_Model):
    query: str
    params: dict[str, SqlParam] | None = None
    max_rows: int = Field(10_000, ge=1, le=100_000)


# -- responses ---------------------------------------------------------------------------------


SessionOut = model_of(Session)
VersionOut = model_of(Version)
CandidateOut = model_of(Candidate)
ExplainOut = model_of(Explanation, "ExplainOut")
NearestOut = create_model("NearestOut", candidates=(list_of(CandidateOut), ...))


class CompactionOut(model_of(Compaction, "CompactionFields")):  # type: ignore[misc]
    """What a compaction did (or, with ``dry_run``, would do), and the bytes it freed."""

    freed_bytes: int


class DeleteOut(_Out):
    session_id: str
    num_pages_released: int


class TokensOut(_Out):
    session_id: str
    version_id: int | None
    tokens: list[int]


class SavePagesOut(_Out):
    page_ids: dict[int, PageIdHex] = Field(description="The id of every page given, by its index.")
    num_new_pages: int


class PageRefOut(_Out):
    index: int
    page_id: str
    tier: str


class ResumeOut(_Out):
    session_id: str | None
    version_id: int | None
    matched_tokens: int
    num_prompt_tokens: int
    num_history_tokens: int
    num_new_tokens: int
    page_tokens: int
    page_bytes: int
    tiers: dict[str, int]
    load_seconds: float
    recompute_seconds: float
    should_load: bool
    pages: list[PageRefOut]
    source: str | None = None
    num_candidates: int = 0
    near: CandidateOut | None = None  # type: ignore[valid-type]
    encodings: dict[str, int] = {}
    """Matched tokens a load serves at each lossy encoding (empty: all exact)."""
    lossy_tokens: int = 0


class ReadPagesOut(_Out):
    pages: list[PageData | None]


class SqlOut(_Out):
    columns: list[str]
    rows: list[list[SqlCell]]


class CheckOut(_Out):
    problems: list[str]


class PageIdsOut(_Out):
    page_ids: list[PageIdHex]


class PageSizesOut(_Out):
    sizes: dict[PageIdHex, int]
    """Page id -> size of the pages the catalog holds (that the key may read)."""


class EngineOut(_Out):
    engine_id: str
    num_pages: int
    """The pages the request named (mark, evict), or those the engine held (forget)."""


class ResidencyOut(_Out):
    session_id: str
    engines: dict[str, int]
    """Engine id -> pages of the session's head it holds (engines holding none left out)."""


class CountOut(_Out):
    num_sessions: int


class RatesOut(_Out):
    tier_bytes_per_s: dict[str, float]
    recompute_tokens_per_s: float


class LimitsOut(_Out):
    max_body_bytes: int
    max_tokens: int


class InfoOut(_Out):
    version: str
    key_id: str
    tenant_id: str
    is_admin: bool
    limits: LimitsOut
    rates: RatesOut


class HealthOut(_Out):
    status: Literal["ok"]
    version: str


class ProblemOut(BaseModel):
    """RFC 9457 problem details; ``kind`` is the ``DssError`` class name."""

    type: str
    title: str
    status: int
    detail: str
    kind: str
