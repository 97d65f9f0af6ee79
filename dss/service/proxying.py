"""What the router reads of a request: its body, bounded in depth, and the session or prompt
that keys it (see :mod:`dss.service.router`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from dss.core.errors import InvalidInput

PROXIED = ("/v1/completions", "/v1/chat/completions")


PREFIX_CHARS = 256
"""Characters of a prompt that key a request without a session."""


MAX_DEPTH = 128
"""Deepest nesting of arrays and objects in a request body, the top-level object counting as one
(OpenAI requests nest a handful deep; tool schemas a few dozen)."""


HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "host",
        "content-length",
    }
)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ``InvalidInput`` when it is not JSON, not an object, has
    a number too long to read, or nests deeper than :data:`MAX_DEPTH` (however deep: a parse
    that runs out of stack is caught). Nothing it returns nests deeper, so re-encoding it is safe."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidInput(f"the request body nests deeper than {MAX_DEPTH} levels of arrays and objects") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidInput("the request body is not JSON") from None
    except ValueError:  # an integer past Python's digit limit
        raise InvalidInput("the request body has a number with too many digits") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    if _nests_deeper(body, MAX_DEPTH):
        raise InvalidInput(f"the request body nests deeper than {MAX_DEPTH} levels of arrays and objects")
    return body


def _nests_deeper(value: object, depth: int) -> bool:
    """Whether ``value`` nests more than ``depth`` arrays and objects (level by level, no recursion)."""
    level: list[Any] = [value]
    for _ in range(depth):
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def request_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    """``(session_id, tenant_id, prefix_key)`` of a request (see the module docstring)."""
    params = body.get("kv_transfer_params")
    own = params.get("dss") if isinstance(params, dict) else None
    own = own if isinstance(own, dict) else {}
    session = headers.get("x-session-id") or own.get("session_id")
    tenant = headers.get("x-tenant-id") or own.get("tenant_id")
    if session is not None and not isinstance(session, str) or tenant is not None and not isinstance(tenant, str):
        raise InvalidInput("kv_transfer_params.dss.session_id and tenant_id must be strings")
    prompt = body.get("messages", body.get("prompt"))
    prefix = json.dumps(prompt, sort_keys=True)[:PREFIX_CHARS] if prompt is not None else None
    prefix_key = "p:" + hashlib.blake2b(prefix.encode(), digest_size=8).hexdigest() if prefix else None
    return session or None, tenant or None, prefix_key


def with_session(body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any] | None:
    """The body with the header's session written into ``kv_transfer_params.dss`` (``None``: unchanged)."""
    session = headers.get("x-session-id")
    params = body.get("kv_transfer_params")
    if session is None or isinstance(params, dict) and isinstance(params.get("dss"), dict):
        return None
    fields = {"session_id": session}
    for name in ("tenant_id", "user_id"):
        if headers.get(f"x-{name.replace('_', '-')}"):
            fields[name] = headers[f"x-{name.replace('_', '-')}"]
    return {**body, "kv_transfer_params": {**(params if isinstance(params, dict) else {}), "dss": fields}}
