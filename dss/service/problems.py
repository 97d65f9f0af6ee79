"""Errors over HTTP: RFC 9457 problem details for every ``DssError``, and back again.

The service answers every error with a JSON body ``application/problem+json``::

    {"type": "urn:dss:problem:UnknownSession", "title": "UnknownSession", "status": 404,
     "detail": "no session 'chat-1' in tenant 'acme'", "kind": "UnknownSession"}

``kind`` is the :class:`dss.core.errors.DssError` class name and ``detail`` its message, so
:func:`error_from_problem` turns a problem back into the same exception class the
embedded store raises. Neither function raises.
"""

from __future__ import annotations

from typing import Any

from dss.core import errors
from dss.core.errors import (
    DssError,
    Forbidden,
    InternalError,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
)

PROBLEM_TYPE_PREFIX = "urn:dss:problem:"
PROBLEM_MEDIA_TYPE = "application/problem+json"


SERVICE_ERRORS: dict[str, type[DssError]] = {
    cls.__name__: cls
    for cls in (Unauthorized, Forbidden, MethodNotAllowed, PayloadTooLarge, Unavailable, InternalError)
}

_BY_STATUS: dict[int, type[DssError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: errors.Conflict,
    413: PayloadTooLarge,
    500: InternalError,
    503: Unavailable,
}


def problem(kind: str, status: int, detail: str) -> dict[str, Any]:
    """The problem-details body for an error of class ``kind``."""
    return {"type": PROBLEM_TYPE_PREFIX + kind, "title": kind, "status": status, "detail": detail, "kind": kind}


def problem_of(exc: DssError) -> dict[str, Any]:
    """The problem-details body for a raised ``DssError``."""
    return problem(exc.kind, exc.status, str(exc))


def error_class(kind: str, status: int) -> type[DssError]:
    """The ``DssError`` subclass named ``kind`` (core or service), else the generic one for ``status``."""
    cls = SERVICE_ERRORS.get(kind) or getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, DssError):
        return cls
    return _BY_STATUS.get(status) or (InternalError if status >= 500 else InvalidInput)


def error_from_problem(status: int, body: Any) -> DssError:
    """The exception a client raises for an error response (``body`` is the decoded JSON, or anything)."""
    if isinstance(body, dict) and isinstance(body.get("kind"), str):
        kind = body["kind"]
        detail = body.get("detail")
        message = detail if isinstance(detail, str) else kind
    else:
        kind = ""
        message = f"HTTP {status}: {str(body)[:200]}" if body else f"HTTP {status}"
    return error_class(kind, status)(message)
