"""What an erasure says: its plan, its job's states and document, the checks, the receipt.

Small immutable types (pydantic, so the HTTP API documents them too); :mod:`dss.erasure.job` runs
the job. Nothing here does I/O.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from dss.core.errors import CatalogCorrupt


class JobState(StrEnum):
    """Where an erasure job stands; each state is reached by one committed step.

    The steps run in :data:`STEPS` order; ``done``, ``failed`` and ``no_such_user`` are final
    (the job is finished and its receipt is in the audit table)."""

    PLANNED = "planned"
    KEY_DESTROYED = "key_destroyed"
    CATALOG_PURGED = "catalog_purged"
    FILES_DELETED = "files_deleted"
    COMPACTED = "compacted"
    DONE = "done"
    FAILED = "failed"
    """Verification still found data of the user after a second sweep: reported, never retried."""
    NO_SUCH_USER = "no_such_user"
    """The tenant has no such user: nothing was erased."""

    @property
    def next(self) -> JobState:
        """The state the next step reaches (only for a state of :data:`STEPS` but the last)."""
        return STEPS[STEPS.index(self) + 1]

    @property
    def is_final(self) -> bool:
        return self in FINAL


STEPS = (
    JobState.PLANNED,
    JobState.KEY_DESTROYED,
    JobState.CATALOG_PURGED,
    JobState.FILES_DELETED,
    JobState.COMPACTED,
    JobState.DONE,
)
"""The states a job goes through, one committed step each, when it erases a user."""
FINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.NO_SUCH_USER})

ReceiptStatus = Literal["verified", "failed", "no_such_user"]
"""How an erasure ended: ``verified`` (nothing of the user left anywhere dss looked),
``failed`` (verification found data left after a second sweep: see the failed checks), or
``no_such_user`` (the tenant has no such user: nothing was erased and nothing verified)."""


class _Value(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TierCount(_Value):
    """Pages and bytes of a namespace on one tier (and, on disk, its segment files)."""

    pages: int = 0
    bytes: int = 0
    files: int | None = None


class Plan(_Value):
    """What forgetting a user removes (the dry run's answer; nothing changed). ``user_known``
    is ``False`` when the tenant has no such user (the erasure would answer ``no_such_user``)."""

    tenant_id: str
    user_id: str
    user_known: bool
    key_present: bool
    sessions: int
    versions: int
    pages: int
    tiers: dict[str, TierCount]


class Needle(_Value):
    """What a job keeps of a sampled page id: a prefix and a SHA-256 (see :mod:`dss.core.rawscan`)."""

    prefix: str
    sha256: str


class Removed(_Value):
    """What the purge deleted. ``files`` names the page files until they are deleted
    (``None`` from then on: only their digests stay)."""

    sessions: int
    versions: int
    pages: int
    tiers: dict[str, TierCount]
    page_ids_sha256: str
    sample: list[Needle]
    files: list[str] | None = None
    file_digests: list[str] = []


class Check(_Value):
    """One look for the user's data, in one place."""

    name: str
    ok: bool
    detail: str


class Verification(_Value):
    ok: bool
    checks: list[Check]


class RemovedCounts(_Value):
    sessions: int
    versions: int
    pages: int
    tiers: dict[str, TierCount]


class Receipt(_Value):
    """The proof an erasure ends with; kept in the audit table."""

    kind: Literal["forget-user"] = "forget-user"
    erasure_id: int
    tenant_id: str
    user_id: str
    status: ReceiptStatus = "verified"
    started_at: str
    finished_at: str
    user_known: bool
    key_destroyed: bool
    removed: RemovedCounts
    page_ids_sha256: str
    verification: Verification | None = None
    """The checks (``None`` for ``no_such_user``: there was nothing to look for)."""


class Job(Plan):
    """An erasure job's document, as the ``erasures`` row keeps it: the plan, then what each
    step recorded."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    started_at: str
    remote_tag: str | None = None
    """The remote tier's tag of the namespace (hex; see :func:`dss.pages.keys.remote_tag`), taken
    before its key is destroyed so that its keys can still be found."""
    remote_removed: int | None = None
    """Keys of the namespace deleted from the remote tier (``None``: none configured yet)."""
    key_destroyed: bool = False
    removed: Removed | None = None
    swept_again: bool = False
    """Verification failed once and the namespace was swept again (a second failure is final)."""
    receipt: Receipt | None = None


class AuditEntry(_Value):
    """An audit row: a receipt and when it was recorded."""

    audit_id: int
    kind: str
    tenant_id: str
    user_id: str
    created_at: str
    receipt: Receipt


M = TypeVar("M", bound=BaseModel)


def stored(model: type[M], text: str) -> M:
    """A receipt or job document as the catalog keeps it; ``CatalogCorrupt`` if it does not decode."""
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise CatalogCorrupt(
            f"a catalog row does not decode ({exc.errors()[0]['msg']}): the catalog is damaged"
        ) from None


def with_remote(tiers: dict[str, TierCount], job: Job) -> dict[str, TierCount]:
    """The receipt's tiers, with the keys deleted from the remote tier if there is one."""
    if job.remote_removed is None:
        return tiers
    return {**tiers, "remote": TierCount(pages=job.remote_removed)}


def failure_of(receipt: Receipt) -> str:
    """What ``ErasureIncomplete`` says of a job that ended ``failed``."""
    assert receipt.verification is not None
    failed = "; ".join(f"{c.name}: {c.detail}" for c in receipt.verification.checks if not c.ok)
    return (
        f"erasure {receipt.erasure_id} failed verification twice (its receipt, status 'failed', is in the "
        f"audit table): {failed}"
    )
