"""The value types of the public API: ids, layouts, page references, versions, sessions.

Everything here is an immutable value with no behaviour beyond validation and encoding,
so every layer may import it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, NewType

from dss.core.errors import InvalidLayout

VersionId = NewType("VersionId", int)
PageId = NewType("PageId", bytes)
"""16 bytes: the keyed chain hash of a page (see :mod:`dss.core.hashing`)."""

TIERS: tuple[str, ...] = ("device", "host", "disk", "remote")
"""Tier names, fastest first. A tier's code is its position plus one; 0 means absent."""

TIER_CODE: dict[str, int] = {name: i + 1 for i, name in enumerate(TIERS)}

CACHE_PREFIX = "~cache-"
"""Session ids of the sessions holding pages saved without a session (one per namespace and layout)."""

_FIELD_TYPES = (str, int, float, bool)


class Layout:
    """What the bytes of a page mean; pages of different layouts never mix.

    ``Layout(name, page_tokens, page_bytes, **fields)``: ``page_tokens`` tokens per page,
    ``page_bytes`` bytes per page payload, and free-form ``fields`` (model, revision, dtype,
    attention backend, ...) that the adapter fills in. Two layouts are equal exactly when
    every field is equal; their :attr:`digest` is then equal too.
    """

    __slots__ = ("digest", "fields", "name", "page_bytes", "page_tokens")

    name: str
    page_tokens: int
    page_bytes: int
    fields: tuple[tuple[str, str | int | float | bool], ...]
    digest: bytes

    def __init__(self, name: str, page_tokens: int, page_bytes: int, **fields: Any) -> None:
        if not isinstance(name, str) or not name or not _utf8(name):
            raise InvalidLayout("layout name must be a non-empty string")
        for label, value, upper in (("page_tokens", page_tokens, 1 << 16), ("page_bytes", page_bytes, 1 << 30)):
            if type(value) is not int or not 1 <= value <= upper:
                raise InvalidLayout(f"layout {label} must be an integer in [1, {upper}], got {value!r}")
        for key, value in fields.items():
            if not isinstance(value, _FIELD_TYPES):
                raise InvalidLayout(f"layout field {key!r} must be str, int, float or bool, got {type(value).__name__}")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidLayout(f"layout field {key!r} must be a finite number, got {value!r}")
            if not _utf8(key) or isinstance(value, str) and not _utf8(value):
                raise InvalidLayout(f"layout field {key!r} is not valid text")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "page_tokens", page_tokens)
        object.__setattr__(self, "page_bytes", page_bytes)
        object.__setattr__(self, "fields", tuple(sorted(fields.items())))
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.blake2b(canonical.encode(), digest_size=16).digest())

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("Layout is immutable")

    def __getattr__(self, key: str) -> Any:
        for name, value in object.__getattribute__(self, "fields"):
            if name == key:
                return value
        raise AttributeError(key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.fields)
        return f"Layout(name={self.name!r}, page_tokens={self.page_tokens}, page_bytes={self.page_bytes}{extra})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Layout.from_dict, (self.to_dict(),))

    def to_dict(self) -> dict[str, Any]:
        """The layout as a JSON-able dict; ``Layout.from_dict`` inverts it."""
        return {"name": self.name, "page_tokens": self.page_tokens, "page_bytes": self.page_bytes, **dict(self.fields)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Build a layout from :meth:`to_dict` output; raises ``InvalidLayout`` for anything
        but a mapping of string keys that has every field."""
        if not isinstance(data, Mapping):
            raise InvalidLayout(f"a layout must be a mapping of field names to values, not {type(data).__name__}")
        data = dict(data)
        bad = [key for key in data if not isinstance(key, str)]
        if bad:
            raise InvalidLayout(f"layout field names must be strings, got {bad[0]!r}")
        for key in ("name", "page_tokens", "page_bytes"):
            if key not in data:
                raise InvalidLayout(f"layout lacks the field {key!r}")
        return cls(data.pop("name"), data.pop("page_tokens"), data.pop("page_bytes"), **data)


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class PageRef(NamedTuple):
    """One matched page: its position in the prompt, its id, and the fastest tier holding it."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index
    page_id: PageId
    tier: str


class SavedPages(NamedTuple):
    """What a save stored: the id of every page it was given, by the page's index in the
    tokens, and how many of them the store did not hold before."""

    page_ids: dict[int, PageId]
    num_new: int


class Version(NamedTuple):
    """An immutable snapshot of a session's token history."""

    version_id: VersionId
    session_id: str
    parent_id: VersionId | None
    num_tokens: int
    created_at: dt.datetime
    label: str | None
    is_head: bool
    is_pinned: bool


class Session(NamedTuple):
    """A conversation and its owner."""

    session_id: str
    tenant_id: str
    user_id: str
    layout: Layout
    head_id: VersionId | None
    num_versions: int
    created_at: dt.datetime
    last_access: dt.datetime


class SqlResult(NamedTuple):
    """Rows of a read-only query, with the column names."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
