"""Checks of caller input that raise a clear ``DssError`` before anything changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dss.errors import InvalidInput, InvalidPage
from dss.types import Layout

MAX_NAME = 256


def check_name(label: str, value: Any) -> None:
    """Ids (session, user, tenant) are printable strings of 1 to 256 characters."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME or not value.isprintable():
        raise InvalidInput(f"{label} must be a printable string of 1 to {MAX_NAME} characters, got {value!r}")


def check_label(label: Any) -> None:
    if label is not None and (not isinstance(label, str) or len(label) > MAX_NAME or not is_text(label)):
        raise InvalidInput(f"label must be a string of at most {MAX_NAME} characters, got {label!r}")


def is_text(value: str) -> bool:
    """Whether a string can be stored (UTF-8 encodes it: no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_version_id(version_id: Any) -> int:
    if type(version_id) is not int:
        raise InvalidInput(f"version_id must be an int, not {type(version_id).__name__}")
    return version_id


def check_pages(pages: Mapping[int, Any] | None, num_tokens: int, layout: Layout) -> dict[int, bytes]:
    """Page payloads keyed by page index, as bytes, in index order.

    Only full pages of the ``num_tokens`` tokens may be given, each exactly
    ``layout.page_bytes`` long; anything else raises ``InvalidPage``.
    """
    if pages is None:
        return {}
    if not isinstance(pages, Mapping):
        raise InvalidPage(f"pages must be a mapping of page index to bytes, not {type(pages).__name__}")
    full = num_tokens // layout.page_tokens
    out: dict[int, bytes] = {}
    for index, payload in pages.items():
        if type(index) is not int or not 0 <= index < full:
            raise InvalidPage(f"page index {index!r} is out of range: {num_tokens} tokens hold {full} full pages "
                              f"of {layout.page_tokens} tokens")
        try:
            view = memoryview(payload)
        except TypeError:
            raise InvalidPage(f"page {index} must be bytes-like, not {type(payload).__name__}") from None
        if view.nbytes != layout.page_bytes:
            raise InvalidPage(f"page {index} has {view.nbytes} bytes; layout {layout.name!r} pages have "
                              f"{layout.page_bytes}")
        out[index] = payload if type(payload) is bytes else view.tobytes()
    return dict(sorted(out.items()))
