"""Settings of the vLLM connector (``kv_connector_extra_config``) and the dss scope of one request.

All configuration is read and validated here, once, when a connector is built; the
scheduler and worker sides receive a frozen :class:`Settings`. Its fields are the keys of
``kv_connector_extra_config``; each field's ``metadata["description"]`` says what it means
(the documentation's configuration reference is generated from them). ``store`` is required;
every other key has a default.

Per request, ``SamplingParams(extra_args={"kv_transfer_params": {"dss": {...}}})`` (or the
same under ``kv_transfer_params`` of the OpenAI API) carries ``session_id`` (optional),
``tenant_id`` and ``user_id`` (when ``namespace_source="request"``), ``label`` (of the
version committed at the end) and ``commit`` (``false`` to leave the session unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dss import ConfigError, InvalidInput

PARAMS_KEY = "dss"
"""The key of ``kv_transfer_params`` that holds this connector's per-request fields."""

_KEYS = {
    "store",
    "store_options",
    "namespace_source",
    "default_tenant_id",
    "default_user_id",
    "model_revision",
    "page_bytes",
    "load",
    "save",
    "max_pending_bytes",
    "session_wait_s",
    "load_mode",
    "recompute_tokens_per_s",
}
_REQUEST_KEYS = {"session_id", "tenant_id", "user_id", "label", "commit"}


@dataclass(frozen=True, slots=True)
class Settings:
    """The validated ``kv_connector_extra_config`` (see the module docstring)."""

    store: str = field(
        metadata={"description": "The dss store: a folder (`/var/lib/dss`) or a catalog URL, as for `dss.open`."}
    )
    store_options: Mapping[str, Any] = field(
        default_factory=dict,
        metadata={"description": 'Keyword arguments of `dss.open` for the engine\'s store (`{"host_bytes": "4GiB"}`).'},
    )
    namespace_source: Literal["request", "config"] = field(
        default="request",
        metadata={
            "description": "`request`: `tenant_id` and `user_id` come from the request's `kv_transfer_params` (the "
            "gateway sets them and drops what clients send); `config`: every request is in the default "
            "namespace."
        },
    )
    default_tenant_id: str = field(default="default", metadata={"description": "Tenant of requests that name none."})
    default_user_id: str = field(default="anonymous", metadata={"description": "User of requests that name none."})
    model_revision: str | None = field(
        default=None,
        metadata={
            "description": "Recorded in the page layout; default vLLM's `revision`, else a fingerprint of the model "
            "folder's weight files. Set it when serving from a hub cache."
        },
    )
    page_bytes: int | None = field(
        default=None,
        metadata={
            "description": "If set, refuse to start unless a page (one block over all layers) has exactly this many "
            "bytes."
        },
    )
    load: bool = field(default=True, metadata={"description": "Load stored pages (off: never load)."})
    save: bool = field(
        default=True, metadata={"description": "Save new pages and commit versions (off: a read-only replica)."}
    )
    max_pending_bytes: int = field(
        default=1 << 30,
        metadata={
            "description": "Page bytes copied out of the KV cache and not yet written before a step waits for the "
            "writer."
        },
    )
    session_wait_s: float = field(
        default=5.0,
        metadata={
            "description": "Seconds a session's next request waits for the previous request's pages to be written "
            "before it runs without them (0: no wait)."
        },
    )
    load_mode: Literal["auto", "sync", "async"] = field(
        default="auto",
        metadata={
            "description": "`auto`: synchronous from the workers' RAM or when nothing else runs, asynchronous from "
            "disk while other requests run (always asynchronous with several KV cache groups); "
            "`async`: always asynchronous; `sync`: always synchronous (one KV cache group only)."
        },
    )

    recompute_tokens_per_s: float | None = field(
        default=None,
        metadata={
            "description": "Prefill speed (tokens/s) to weigh loading against recomputing; default: measured on "
            "the engine's own prefill steps (the store's `recompute_tokens_per_s` until then)."
        },
    )

    @property
    def reader_options(self) -> dict[str, Any]:
        """``store_options`` for the processes that only move pages (workers, the reader): they
        never resume, so approximate matching stays off there (no index is built at open)."""
        return {**self.store_options, "approximate": False}

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        """Validate ``kv_connector_extra_config``; raises ``dss.ConfigError`` naming the bad key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigError(f"unknown dss connector option(s) {unknown}; known: {sorted(_KEYS)}")
        store = extra.get("store")
        if not isinstance(store, str) or not store:
            raise ConfigError("kv_connector_extra_config needs 'store': the dss store folder or catalog URL")
        options = extra.get("store_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError("'store_options' must be a mapping of dss.open keyword arguments")
        _check_kinds(extra)
        source = _choice(extra, "namespace_source", ("request", "config"))
        mode = _choice(extra, "load_mode", ("auto", "sync", "async"))
        wait = extra.get("session_wait_s", 5.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
            raise ConfigError("'session_wait_s' must be a number of seconds >= 0")
        return cls(
            store=store,
            store_options=dict(options),
            namespace_source=source,
            default_tenant_id=extra.get("default_tenant_id", "default"),
            default_user_id=extra.get("default_user_id", "anonymous"),
            model_revision=extra.get("model_revision"),
            page_bytes=extra.get("page_bytes"),
            load=extra.get("load", True),
            save=extra.get("save", True),
            max_pending_bytes=extra.get("max_pending_bytes", 1 << 30),
            session_wait_s=float(wait),
            load_mode=mode,
            recompute_tokens_per_s=_speed(extra.get("recompute_tokens_per_s")),
        )


def _check_kinds(extra: Mapping[str, Any]) -> None:
    """The options that are plain strings, positive integers or flags, where given."""
    for key in ("default_tenant_id", "default_user_id", "model_revision"):
        if key in extra and (not isinstance(extra[key], str) or not extra[key]):
            raise ConfigError(f"{key!r} must be a non-empty string")
    for key in ("page_bytes", "max_pending_bytes"):
        if key in extra and (type(extra[key]) is not int or extra[key] <= 0):
            raise ConfigError(f"{key!r} must be a positive integer")
    for key in ("load", "save"):
        if key in extra and not isinstance(extra[key], bool):
            raise ConfigError(f"{key!r} must be true or false")


def _choice(extra: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """An option naming one of ``choices`` (the first by default)."""
    value = extra.get(key, choices[0])
    if value not in choices:
        named = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ConfigError(f"{key!r} must be {named}, not {value!r}")
    return str(value)


def _speed(value: Any) -> float | None:
    """The ``recompute_tokens_per_s`` setting: ``None`` or a positive, finite number."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e300):
        raise ConfigError("'recompute_tokens_per_s' must be a positive number of tokens per second")
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a request's pages live: its namespace and, optionally, its session."""

    tenant_id: str
    user_id: str
    session_id: str | None
    label: str | None = None
    commit: bool = True


def request_scope(settings: Settings, params: Mapping[str, Any] | None) -> Scope:
    """The scope of a request from its ``kv_transfer_params`` (``None`` or without ``"dss"``: the
    default namespace, no session). Raises ``dss.InvalidInput`` for malformed fields."""
    fields = (params or {}).get(PARAMS_KEY) or {}
    if not isinstance(fields, Mapping):
        raise InvalidInput(f"kv_transfer_params[{PARAMS_KEY!r}] must be a mapping, not {type(fields).__name__}")
    unknown = sorted(set(fields) - _REQUEST_KEYS)
    if unknown:
        raise InvalidInput(f"unknown dss request field(s) {unknown}; known: {sorted(_REQUEST_KEYS)}")
    for key in ("session_id", "tenant_id", "user_id", "label"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise InvalidInput(f"dss request field {key!r} must be a string")
    if not isinstance(fields.get("commit", True), bool):
        raise InvalidInput("dss request field 'commit' must be true or false")
    if settings.namespace_source == "config":
        tenant, user = settings.default_tenant_id, settings.default_user_id
    else:
        tenant = fields.get("tenant_id") or settings.default_tenant_id
        user = fields.get("user_id") or settings.default_user_id
    return Scope(tenant, user, fields.get("session_id") or None, fields.get("label"), fields.get("commit", True))
