"""What every route of the service shares: the per-request :class:`Call`, the admin checks,
the problem responses each ``/v1`` route documents, and the limit on tokens per request."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

from fastapi import Depends, Request, Security
from fastapi.responses import Response
from fastapi.routing import APIRoute

from dss.core.errors import InvalidTokens
from dss.service.apikeys import Principal
from dss.service.config import ServerConfig
from dss.service.docs import BEARER
from dss.service.metrics import Metrics
from dss.service.middleware import PRINCIPAL
from dss.service.problems import PROBLEM_MEDIA_TYPE
from dss.service.tenancy import TenantScope
from dss.store import Store

PROBLEM_CONTENT = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/ProblemOut"}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": PROBLEM_CONTENT}
    for code, text in (
        (400, "Bad input (InvalidInput, InvalidTokens, InvalidPage, InvalidLayout, SqlError)"),
        (401, "Missing or unknown API key (Unauthorized)"),
        (403, "Not allowed for this key (Forbidden, ReadOnlyViolation)"),
        (404, "Not found, or another tenant's (UnknownSession, UnknownVersion)"),
        (409, "Conflict (SessionExists, ErasureInProgress)"),
        (413, "Request body too large (PayloadTooLarge)"),
        (503, "The store is closing or needs an upgrade (StoreClosed, SchemaOutdated)"),
    )
}


class Call(NamedTuple):
    """What a request handler needs: the store, the caller's scope, the limits, the metrics."""

    store: Store
    scope: TenantScope
    config: ServerConfig
    metrics: Metrics


def _call(request: Request, _key: Any = Security(BEARER)) -> Call:
    state = request.app.state
    principal: Principal = request.scope[PRINCIPAL]
    return Call(state.store, TenantScope(principal), state.config, state.metrics)


def admin(what: str) -> Any:
    """A route dependency: the key must be an admin key (``Forbidden`` otherwise), checked before
    the request body is validated, so a non-admin key learns nothing from the endpoint."""

    def require_admin(request: Request) -> None:
        TenantScope(request.scope[PRINCIPAL]).require_admin(what)

    return Depends(require_admin)


def admin_first(what: str) -> type[APIRoute]:
    """A route class whose handler checks for an admin key (``Forbidden`` otherwise) before it reads
    the request body: FastAPI parses a declared body before any dependency runs, so with
    :func:`admin` alone a non-admin key would learn how its body was refused."""

    class AdminFirst(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handle = super().get_route_handler()

            async def admin_first(request: Request) -> Response:
                TenantScope(request.scope[PRINCIPAL]).require_admin(what)
                return await handle(request)

            return admin_first

    return AdminFirst


CALL = Depends(_call)
"""The route parameter default that gives a handler its :class:`Call`."""
V1: dict[str, Any] = {"responses": ERRORS}
"""What every ``/v1`` route passes to its decorator: the problems it may answer."""


def checked_tokens(call: Call, tokens: list[int]) -> list[int]:
    """``tokens``, unless there are more than the service takes in one request (``InvalidTokens``)."""
    if len(tokens) > call.config.max_tokens:
        raise InvalidTokens(
            f"a request may carry at most {call.config.max_tokens} tokens (max_tokens), got {len(tokens)}"
        )
    return tokens
