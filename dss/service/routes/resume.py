"""Resume, lookup, nearest and explain (tag ``resume``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, V1, Call, checked_tokens
from dss.service.codec import dump

router = APIRouter()


@router.post("/v1/resume", response_model=m.ResumeOut, tags=["resume"], **V1)
def resume(body: m.ResumeIn, call: Call = CALL) -> dict[str, Any]:
    """How many leading tokens of a prompt have stored KV, on which tiers, along which version."""
    tenant = call.scope.reading(body.tenant_id)
    prompt = checked_tokens(call, body.tokens)
    start = time.perf_counter()
    result = call.store.resume(body.session_id, prompt, tenant_id=tenant, approximate=body.approximate)
    call.metrics.observe_resume(result, time.perf_counter() - start)
    return codec.resume_out(result)


@router.post("/v1/lookup", response_model=m.ResumeOut, tags=["resume"], **V1)
def lookup(body: m.LookupIn, call: Call = CALL) -> dict[str, Any]:
    """Resume for a request without a session: exact lookup in the namespace (user_id, layout)."""
    tenant = call.scope.reading(body.tenant_id)
    prompt = checked_tokens(call, body.tokens)
    start = time.perf_counter()
    result = call.store.lookup(
        prompt,
        layout=codec.layout_of(body.layout),
        user_id=body.user_id,
        tenant_id=tenant,
        approximate=body.approximate,
    )
    call.metrics.observe_resume(result, time.perf_counter() - start)
    return codec.resume_out(result)


@router.post("/v1/nearest", response_model=m.NearestOut, tags=["resume"], **V1)
def nearest(body: m.NearestIn, call: Call = CALL) -> dict[str, Any]:
    """Stored versions nearest a prompt (MinHash-LSH candidates verified token by token), in one
    namespace and layout: the session's, or (user_id, layout) of the tenant."""
    tenant = call.scope.reading(body.tenant_id)
    found = call.store.nearest(
        checked_tokens(call, body.tokens),
        session_id=body.session_id,
        tenant_id=tenant,
        user_id=body.user_id,
        layout=codec.layout_of(body.layout) if body.layout is not None else None,
        k=body.k,
    )
    return {"candidates": dump(found)}


@router.post("/v1/explain", response_model=m.ExplainOut, tags=["resume"], **V1)
def explain(body: m.ExplainIn, call: Call = CALL) -> dict[str, Any]:
    """Why exact reuse of a prompt stops where it does: the first divergence from its nearest
    stored version, the tokens around it, the reuse it costs, the tenant's recurring positions."""
    tenant = call.scope.reading(body.tenant_id)
    why = call.store.explain(
        body.session_id,
        checked_tokens(call, body.tokens),
        tenant_id=tenant,
        user_id=body.user_id,
        layout=codec.layout_of(body.layout) if body.layout is not None else None,
        context=body.context,
    )
    return dump(why)
