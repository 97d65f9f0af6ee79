"""dss: a dialogue state store for LLM inference.

    import dss
    store = dss.open("dss-data")
    r = store.resume("chat-1", tokens)

``dss.open`` opens a store in this process; the module-level :func:`resume` answers on the
default store (``DSS_HOME``, or what :func:`configure` set).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from dss.approx.explanation import Explanation
from dss.core.config import StoreConfig, load_config
from dss.core.errors import (
    AmbiguousSession,
    CatalogCorrupt,
    CatalogUnavailable,
    ConfigError,
    Conflict,
    DssError,
    ErasureIncomplete,
    ErasureInProgress,
    Forbidden,
    InternalError,
    InvalidInput,
    InvalidLayout,
    InvalidPage,
    InvalidTokens,
    NoStore,
    NotFound,
    PayloadTooLarge,
    ReadOnlyViolation,
    SchemaOutdated,
    SchemaTooNew,
    SessionExists,
    SqlError,
    StoreClosed,
    StoreFolderError,
    Unauthorized,
    Unavailable,
    UnknownSession,
    UnknownVersion,
)
from dss.core.packing import Encoded, decode_page, page_views
from dss.core.packing import encoding_of as page_encoding
from dss.core.precision import ENCODINGS
from dss.core.tokens import TokenInput
from dss.core.types import Layout, PageId, PageRef, SavedPages, Session, SqlResult, Version, VersionId
from dss.core.version import VERSION
from dss.erasure.documents import AuditEntry, Plan, Receipt
from dss.sessions.resume import Candidate, LoadDecision, ResumeResult
from dss.store import Store
from dss.writes.compaction import Compaction

__version__ = VERSION

__all__ = [
    "ENCODINGS",
    "AmbiguousSession",
    "AuditEntry",
    "Candidate",
    "CatalogCorrupt",
    "CatalogUnavailable",
    "Compaction",
    "ConfigError",
    "Conflict",
    "DssError",
    "Encoded",
    "ErasureInProgress",
    "ErasureIncomplete",
    "Explanation",
    "Forbidden",
    "InternalError",
    "InvalidInput",
    "InvalidLayout",
    "InvalidPage",
    "InvalidTokens",
    "Layout",
    "LoadDecision",
    "NoStore",
    "NotFound",
    "PageId",
    "PageRef",
    "PayloadTooLarge",
    "Plan",
    "ReadOnlyViolation",
    "Receipt",
    "ResumeResult",
    "SavedPages",
    "SchemaOutdated",
    "SchemaTooNew",
    "Session",
    "SessionExists",
    "SqlError",
    "SqlResult",
    "Store",
    "StoreClosed",
    "StoreConfig",
    "StoreFolderError",
    "Unauthorized",
    "Unavailable",
    "UnknownSession",
    "UnknownVersion",
    "Version",
    "VersionId",
    "configure",
    "connect",
    "decode_page",
    "default_store",
    "open",
    "page_encoding",
    "page_views",
    "resume",
]

_default_lock = threading.Lock()
_default_config: dict[str, Any] = {}
_default_store: Store | None = None


def open(path_or_url: str | os.PathLike[str] | None = None, **options: Any) -> Store:
    """Open (creating if needed) a store in this process.

    ``path_or_url`` is the store folder, or a catalog URL (``postgresql+psycopg://...``)
    with the folder taken from ``home=``/``DSS_HOME``; ``dss.open(home=...)`` names the
    folder too. Other keyword arguments override :class:`StoreConfig` fields
    (``host_bytes="2GiB"``, ``disk_bytes=...``, ...). Raises ``ConfigError`` when the folder
    or the catalog URL is given twice. ``create=False`` opens only a store that exists
    (``NoStore`` otherwise, and nothing is made); a file-system failure is a ``StoreFolderError``.
    """
    home = options.pop("home", None)
    create = options.pop("create", True)
    if path_or_url is not None and not isinstance(path_or_url, (str, os.PathLike)):
        raise ConfigError(f"dss.open needs a store folder or a catalog URL, not {type(path_or_url).__name__}")
    if path_or_url is not None and "://" in str(path_or_url):
        if options.get("catalog_url") is not None:
            raise ConfigError("the catalog URL is given twice: as the first argument and as catalog_url=")
        options["catalog_url"] = str(path_or_url)
    elif path_or_url is not None:
        if home is not None:
            raise ConfigError("the store folder is given twice: as the first argument and as home=")
        home = path_or_url
    return Store(load_config(home, **options), create=create)


def connect(url: str, *, api_key: str | None = None, **options: Any) -> Any:
    """A client of a ``dss serve`` service, with the same methods and result types as :class:`Store`."""
    from dss.service.client import Client

    return Client(url, api_key=api_key, **options)


def configure(home: str | os.PathLike[str] | None = None, **options: Any) -> None:
    """Set the default store used by :func:`resume` (closing a default store already open)."""
    global _default_store
    with _default_lock:
        if _default_store is not None:
            _default_store.close()
            _default_store = None
        _default_config.clear()
        _default_config.update(options)
        if home is not None:
            _default_config["home"] = home


def default_store() -> Store:
    """The default store, opened on first use from :func:`configure` or ``DSS_HOME``."""
    global _default_store
    with _default_lock:
        if _default_store is None:
            options = dict(_default_config)
            _default_store = Store(load_config(options.pop("home", None), **options))
        return _default_store


def resume(session_id: str, tokens: TokenInput, *, tenant_id: str | None = None) -> ResumeResult:
    """``default_store().resume(...)``: how much of ``tokens`` is already computed, and where."""
    return default_store().resume(session_id, tokens, tenant_id=tenant_id)
