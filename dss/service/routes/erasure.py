"""Forgetting a user, and the audit of erasures (tag ``erasure``)."""

from __future__ import annotations

from fastapi import APIRouter

from dss.core.errors import ErasureIncomplete
from dss.erasure.documents import AuditEntry, Plan, Receipt
from dss.service import models as m
from dss.service.calls import CALL, ERRORS, PROBLEM_CONTENT, V1, Call, admin

router = APIRouter()


@router.post(
    "/v1/forget_user",
    response_model=Receipt | Plan,
    response_model_exclude_none=True,
    tags=["erasure"],
    dependencies=[admin("forget_user")],
    responses={
        **ERRORS,
        500: {
            "description": "The erasure could not finish now (it stays open and may be "
            "retried), or verification failed for good (ErasureIncomplete)",
            "content": PROBLEM_CONTENT,
        },
    },
)
def forget_user(body: m.ForgetUserIn, call: Call = CALL) -> Receipt | Plan:
    """Erase every session, version, token and page of one user of the tenant named in the body
    (GDPR Art. 17), keys first; returns the receipt (``status``: ``verified``, or ``no_such_user`` when the
    tenant has no such user). ``dry_run`` returns the plan and changes nothing. Admin key (also for a dry
    run); the tenant is the key's own (a dry run may name another, as reads may)."""
    tenant = call.scope.reading(body.tenant_id) if body.dry_run else call.scope.writing(body.tenant_id)
    if body.dry_run:
        return call.store.forget_user(body.user_id, tenant_id=tenant, dry_run=True)
    try:
        receipt = call.store.forget_user(body.user_id, tenant_id=tenant)
    except ErasureIncomplete:
        call.metrics.observe_erasure(done=False)
        raise
    call.metrics.observe_erasure(done=True)
    return receipt


@router.get("/v1/audit", response_model=list[AuditEntry], response_model_exclude_none=True, tags=["erasure"], **V1)
def audit(call: Call = CALL, tenant_id: str | None = None, all_tenants: bool = False) -> list[AuditEntry]:
    """Receipts of the tenant's erasures, oldest first; ``all_tenants`` needs an admin key."""
    if all_tenants:
        call.scope.require_admin("reading every tenant's audit")
        return call.store.audit()
    return call.store.audit(tenant_id=call.scope.reading(tenant_id))
