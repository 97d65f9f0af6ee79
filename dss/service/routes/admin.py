"""SQL, checks, statistics, compaction and the mover: admin keys only (tag ``admin``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, V1, Call, admin, admin_first

router = APIRouter()


def sql(body: m.SqlIn, call: Call = CALL) -> dict[str, Any]:
    """Run one read-only SQL statement on the catalog (admin key)."""
    return codec.sql_out(call.store.sql(body.query, body.params, max_rows=body.max_rows))


router.add_api_route(
    "/v1/sql",
    sql,
    methods=["POST"],
    response_model=m.SqlOut,
    tags=["admin"],
    route_class_override=admin_first("SQL"),
    **V1,
)


@router.get("/v1/check", response_model=m.CheckOut, tags=["admin"], dependencies=[admin("check")], **V1)
def check(call: Call = CALL) -> dict[str, Any]:
    """Every broken invariant of the store (empty when sound; admin key)."""
    return {"problems": call.store.check()}


@router.get("/v1/stats", response_model=dict[str, dict[str, Any]], tags=["admin"], dependencies=[admin("stats")], **V1)
def stats(call: Call = CALL) -> dict[str, Any]:
    """The tiers: sizes, watermarks, what the placement policy did, prefetch counts (admin key)."""
    return call.store.stats()


@router.get(
    "/v1/sessions/count",
    response_model=m.CountOut,
    tags=["admin"],
    dependencies=[admin("counting every tenant's sessions")],
    **V1,
)
def count_sessions(call: Call = CALL) -> dict[str, Any]:
    """The number of sessions in the store, every tenant's (admin key)."""
    return {"num_sessions": call.store.count_sessions()}


@router.post("/v1/compact", response_model=m.CompactionOut, tags=["admin"], dependencies=[admin("compact")], **V1)
def compact(body: m.CompactIn, call: Call = CALL) -> dict[str, Any]:
    """Rewrite the disk tier's sparse page files so their dead bytes are freed; ``dry_run`` says what it
    would do and changes nothing (admin key)."""
    return codec.compaction_out(call.store.compact(dry_run=body.dry_run))


@router.post(
    "/v1/mover", response_model=dict[str, int], tags=["admin"], dependencies=[admin("running the mover")], **V1
)
def run_mover(call: Call = CALL) -> dict[str, int]:
    """One pass of the mover now: the pages demoted from host and evicted from disk (admin key)."""
    return call.store.run_mover()
