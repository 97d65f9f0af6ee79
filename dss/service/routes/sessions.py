"""Sessions: create, list, read, delete (tag ``sessions``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, V1, Call
from dss.service.codec import dump, list_of

router = APIRouter()


@router.post("/v1/sessions", response_model=m.SessionOut, tags=["sessions"], **V1)
def create_session(body: m.CreateSessionIn, call: Call = CALL) -> dict[str, Any]:
    """Create a session (idempotent for the same owner and layout: returns the existing one)."""
    tenant = call.scope.writing(body.tenant_id)
    return dump(
        call.store.create_session(
            body.session_id, user_id=body.user_id, tenant_id=tenant, layout=codec.layout_of(body.layout)
        )
    )


@router.get("/v1/sessions", response_model=list_of(m.SessionOut), tags=["sessions"], **V1)
def sessions(
    call: Call = CALL, tenant_id: str | None = None, user_id: str | None = None, all_tenants: bool = False
) -> list[dict[str, Any]]:
    """The tenant's sessions (optionally one user's), oldest first; ``all_tenants`` needs an admin key."""
    if all_tenants:
        call.scope.require_admin("listing every tenant's sessions")
        tenant: str | None = None
    else:
        tenant = call.scope.reading(tenant_id)
    return [dump(s) for s in call.store.sessions(tenant_id=tenant, user_id=user_id)]


@router.get("/v1/session", response_model=m.SessionOut, tags=["sessions"], **V1)
def session(session_id: str, tenant_id: str | None = None, call: Call = CALL) -> dict[str, Any]:
    """One session: owner, layout, head and number of versions."""
    return dump(call.store.session(session_id, tenant_id=call.scope.reading(tenant_id)))


@router.delete("/v1/session", response_model=m.DeleteOut, tags=["sessions"], **V1)
def delete_session(session_id: str, tenant_id: str | None = None, call: Call = CALL) -> dict[str, Any]:
    """Delete a session and its versions; pages no other session holds are released."""
    released = call.store.delete_session(session_id, tenant_id=call.scope.writing(tenant_id))
    return {"session_id": session_id, "num_pages_released": released}
