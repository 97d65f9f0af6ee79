"""The device tier: what engines hold in their own KV memory (tag ``engines``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dss.service import models as m
from dss.service.calls import CALL, V1, Call, admin

router = APIRouter()


@router.get("/v1/residency", response_model=m.ResidencyOut, tags=["engines"], **V1)
def residency(session_id: str, tenant_id: str | None = None, call: Call = CALL) -> dict[str, Any]:
    """How many pages of the session's head each live engine holds in its own KV memory."""
    engines = call.store.residency(session_id, tenant_id=call.scope.reading(tenant_id))
    return {"session_id": session_id, "engines": engines}


@router.post(
    "/v1/engines/resident",
    response_model=m.EngineOut,
    tags=["engines"],
    dependencies=[admin("reporting an engine's pages")],
    **V1,
)
def mark_resident(body: m.EnginePagesIn, call: Call = CALL) -> dict[str, Any]:
    """An engine instance holds these pages in its own KV memory (the device tier); renews its lease.
    Admin key: an engine serves every tenant."""
    ids = [bytes.fromhex(p) for p in body.page_ids]
    call.store.mark_resident(body.engine_id, ids)
    return {"engine_id": body.engine_id, "num_pages": len(ids)}


@router.post(
    "/v1/engines/evicted",
    response_model=m.EngineOut,
    tags=["engines"],
    dependencies=[admin("reporting an engine's pages")],
    **V1,
)
def evicted(body: m.EnginePagesIn, call: Call = CALL) -> dict[str, Any]:
    """An engine instance no longer holds these pages (it reused their memory). Admin key."""
    ids = [bytes.fromhex(p) for p in body.page_ids]
    call.store.evicted(body.engine_id, ids)
    return {"engine_id": body.engine_id, "num_pages": len(ids)}


@router.post(
    "/v1/engines/forget",
    response_model=m.EngineOut,
    tags=["engines"],
    dependencies=[admin("forgetting an engine")],
    **V1,
)
def forget_engine(body: m.EngineIn, call: Call = CALL) -> dict[str, Any]:
    """An engine instance went away: forget the pages it held (answers how many). Admin key."""
    return {"engine_id": body.engine_id, "num_pages": call.store.forget_engine(body.engine_id)}
