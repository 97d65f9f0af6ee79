"""Liveness, metrics and what the caller's key may do (tag ``service``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dss.core.errors import StoreClosed
from dss.core.version import VERSION
from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, ERRORS, V1, Call
from dss.service.docs import BEARER
from dss.service.middleware import PRINCIPAL
from dss.service.tenancy import TenantScope

router = APIRouter()


@router.get("/healthz", response_model=m.HealthOut, tags=["service"], responses={503: ERRORS[503]})
def healthz(request: Request) -> dict[str, Any]:
    """Liveness and readiness: 200 while the store is open, 503 once it is closing."""
    if request.app.state.store.is_closed:
        raise StoreClosed("this store is closed")
    return {"status": "ok", "version": VERSION}


@router.get(
    "/metrics",
    tags=["service"],
    response_class=Response,
    dependencies=[Security(BEARER)],
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
        401: ERRORS[401],
        403: ERRORS[403],
    },
)
def metrics(request: Request) -> Response:
    """Prometheus metrics (see :mod:`dss.service.metrics`); needs an admin key unless public_metrics."""
    if not request.app.state.config.public_metrics:
        TenantScope(request.scope[PRINCIPAL]).require_admin("/metrics")
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/info", response_model=m.InfoOut, tags=["service"], **V1)
def info(call: Call = CALL) -> dict[str, Any]:
    """The caller's key (tenant, admin), the service's limits and the rates resume estimates use."""
    p = call.scope.principal
    return {
        "version": VERSION,
        "key_id": p.key_id,
        "tenant_id": p.tenant_id,
        "is_admin": p.is_admin,
        "limits": {"max_body_bytes": call.config.max_body_bytes, "max_tokens": call.config.max_tokens},
        "rates": codec.rates_out(call.store.rates),
    }
