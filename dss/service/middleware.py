"""ASGI middleware of the service: metrics, API-key authentication, request body limit.

They wrap the FastAPI app, outermost first: :class:`MetricsMiddleware` (times and counts
every request, the rejected ones too), :class:`AuthMiddleware` (sets
``scope["dss.principal"]`` or answers 401 before the body is read), :class:`BodyLimitMiddleware`
(answers 413 once a body passes the limit, before the app parses it). Each answers errors as
problem details, like the app.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import JSONResponse

from dss.core.errors import DssError
from dss.service.apikeys import KeyRing
from dss.service.metrics import UNMATCHED, Metrics
from dss.service.problems import PROBLEM_MEDIA_TYPE, PayloadTooLarge, problem_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PRINCIPAL = "dss.principal"
"""The scope key holding the request's :class:`dss.service.apikeys.Principal`."""


def problem_response(exc: DssError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The HTTP response for an error."""
    if exc.status == 401:
        headers = {"WWW-Authenticate": 'Bearer realm="dss"', **(headers or {})}
    return JSONResponse(problem_of(exc), status_code=exc.status, media_type=PROBLEM_MEDIA_TYPE, headers=headers)


class MetricsMiddleware:
    """Counts and times every HTTP request under its route (``unmatched`` for unknown paths)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, record_status)
        finally:
            self.metrics.in_flight.dec()
            path = scope["path"]
            route = path if path in self.routes else UNMATCHED
            self.metrics.observe_request(scope["method"], route, status, time.perf_counter() - start)


class AuthMiddleware:
    """Resolves ``Authorization: Bearer <key>`` for protected paths; 401 when it is missing or unknown.

    ``protected(path)`` says which paths need a key; for the others the principal is set
    when a valid key is sent and left out otherwise.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, protected: Callable[[str], bool]) -> None:
        self.app = app
        self.keys = keys
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            key = _bearer(scope)
            try:
                if key is not None or self.protected(scope["path"]):
                    scope[PRINCIPAL] = self.keys.authenticate(key)
            except DssError as exc:
                if self.protected(scope["path"]):
                    await problem_response(exc)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole request body up front and answers 413 once it passes ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLarge(f"request bodies are limited to {self.max_bytes} bytes (max_body_bytes)")
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await problem_response(too_large, {"Connection": "close"})(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await problem_response(too_large, {"Connection": "close"})(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1")).strip()
    return None


def _bearer(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
