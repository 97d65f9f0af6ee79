"""Versions: list, tokens, commit, rollback, branch, pin (tag ``versions``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, V1, Call, checked_tokens
from dss.service.codec import dump, list_of

router = APIRouter()


@router.get("/v1/versions", response_model=list_of(m.VersionOut), tags=["versions"], **V1)
def versions(session_id: str, tenant_id: str | None = None, call: Call = CALL) -> list[dict[str, Any]]:
    """Every version of a session, oldest first (the head has ``is_head``)."""
    return [dump(v) for v in call.store.versions(session_id, tenant_id=call.scope.reading(tenant_id))]


@router.get("/v1/tokens", response_model=m.TokensOut, tags=["versions"], **V1)
def tokens(
    session_id: str, version_id: int | None = Query(None), tenant_id: str | None = None, call: Call = CALL
) -> dict[str, Any]:
    """The tokens of a version (default the head; empty if the session has none)."""
    tenant = call.scope.reading(tenant_id)
    if version_id is None:
        version_id = call.store.session(session_id, tenant_id=tenant).head_id
    out = call.store.tokens(session_id, version_id, tenant_id=tenant)
    return {"session_id": session_id, "version_id": version_id, "tokens": out}


@router.post("/v1/commit", response_model=m.VersionOut, status_code=201, tags=["versions"], **V1)
def commit(body: m.CommitIn, call: Call = CALL) -> dict[str, Any]:
    """Record tokens (and optionally their full pages) as a new version, child of the head; it becomes
    the head. Answered only once durable."""
    tenant = call.scope.writing(body.tenant_id)
    pages = codec.decode_pages(body.pages) if body.pages is not None else None
    version = call.store.commit(
        body.session_id, checked_tokens(call, body.tokens), pages, label=body.label, tenant_id=tenant
    )
    call.metrics.observe_commit(version.num_tokens)
    return dump(version)


@router.post("/v1/rollback", response_model=m.VersionOut, tags=["versions"], **V1)
def rollback(body: m.RollbackIn, call: Call = CALL) -> dict[str, Any]:
    """Move the session's head back to a version (copies and deletes nothing)."""
    tenant = call.scope.writing(body.tenant_id)
    return dump(call.store.rollback(body.session_id, body.version_id, tenant_id=tenant))


@router.post("/v1/branch", response_model=m.SessionOut, status_code=201, tags=["versions"], **V1)
def branch(body: m.BranchIn, call: Call = CALL) -> dict[str, Any]:
    """Start a new session at a version of this one, sharing its pages."""
    tenant = call.scope.writing(body.tenant_id)
    return dump(
        call.store.branch(body.session_id, body.version_id, body.new_session_id, tenant_id=tenant, label=body.label)
    )


@router.post("/v1/pin", response_model=m.VersionOut, tags=["versions"], **V1)
def pin(body: m.PinIn, call: Call = CALL) -> dict[str, Any]:
    """Pin (or unpin) a version: eviction never drops the pages of a pinned version."""
    tenant = call.scope.writing(body.tenant_id)
    return dump(call.store.pin(body.session_id, body.version_id, pinned=body.pinned, tenant_id=tenant))
