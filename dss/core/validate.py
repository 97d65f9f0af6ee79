"""Checks of caller input that raise a clear ``DssError`` before anything changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dss.core.errors import InvalidInput, InvalidPage
from dss.core.types import Layout, PageId, PageRef

MAX_NAME = 256
PAGE_ID_BYTES = 16


def check_name(label: str, value: Any, *, optional: bool = False) -> None:
    """Ids (session, user, tenant) are printable strings of 1 to 256 characters (or ``None``
    where ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME or not value.isprintable():
        raise InvalidInput(f"{label} must be a printable string of 1 to {MAX_NAME} characters, got {_shown(value)}")


def check_buffers(into: Any, count: int) -> list[memoryview] | None:
    """``read_pages``' ``into``: ``None``, or one writable, contiguous buffer per page (as flat
    byte views)."""
    if into is None:
        return None
    if isinstance(into, (str, bytes, bytearray, memoryview)) or not isinstance(into, Sequence) or len(into) != count:
        raise InvalidInput(f"into must be a list of {count} writable buffers, one per page")
    views = []
    for i, item in enumerate(into):
        try:
            view = memoryview(item)
        except TypeError:
            raise InvalidInput(f"into[{i}] must be a writable buffer, not {type(item).__name__}") from None
        if view.readonly or not view.contiguous:
            raise InvalidInput(f"into[{i}] must be a writable, contiguous buffer")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return views


def check_ready(ready: Any, buffers: list[memoryview] | None) -> None:
    """``read_pages``' ``ready``: ``None``, or a function given with ``into``."""
    check_callback("ready", ready)
    if ready is not None and buffers is None:
        raise InvalidInput("ready is told which buffers are filled: give it with into")


def check_flag(label: str, value: Any) -> None:
    if type(value) is not bool:
        raise InvalidInput(f"{label} must be True or False, not {type(value).__name__}")


def check_layout(layout: Any) -> Layout:
    if not isinstance(layout, Layout):
        raise InvalidInput(f"layout must be a dss.Layout, not {type(layout).__name__}")
    return layout


def check_page_ids(pages: Any) -> list[PageId]:
    """The ids of ``read_pages``' argument: a list or tuple of ``PageRef`` or 16-byte ids."""
    if isinstance(pages, (str, bytes, bytearray)) or not isinstance(pages, Sequence):
        raise InvalidInput(
            f"pages must be a list of PageRef or {PAGE_ID_BYTES}-byte page ids, not {type(pages).__name__}"
        )
    ids: list[PageId] = []
    for i, item in enumerate(pages):
        raw = item.page_id if isinstance(item, PageRef) else item
        if not isinstance(raw, (bytes, bytearray, memoryview)) or memoryview(raw).nbytes != PAGE_ID_BYTES:
            raise InvalidInput(f"page {i} must be a PageRef or a {PAGE_ID_BYTES}-byte page id, got {_shown(item)}")
        ids.append(PageId(bytes(raw)))
    return ids


def check_callback(label: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise InvalidInput(f"{label} must be a function or None, not {type(value).__name__}")


def _shown(value: Any) -> str:
    """A value for an error message: its repr, cut short."""
    text = repr(value) if isinstance(value, (str, bytes, int, float)) or value is None else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


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


def page_payloads(pages: Mapping[int, Any]) -> dict[int, memoryview]:
    """The payloads of ``pages`` as views keyed by page index, in the mapping's order.

    Each index must be an ``int``, named once, and its payload bytes-like; anything else raises
    ``InvalidPage`` (a mapping whose iteration names an index twice included: one of the two
    payloads would be dropped). Ranges and sizes are :func:`check_pages`' to check.
    """
    if not isinstance(pages, Mapping):
        raise InvalidPage(f"pages must be a mapping of page index to bytes, not {type(pages).__name__}")
    out: dict[int, memoryview] = {}
    for index, payload in pages.items():
        if type(index) is not int:
            raise InvalidPage(f"page index {index!r} must be an int, not {type(index).__name__}")
        if index in out:
            raise InvalidPage(f"page index {index} is given twice: give each page once")
        try:
            out[index] = memoryview(payload)
        except TypeError:
            raise InvalidPage(f"page {index} must be bytes-like, not {type(payload).__name__}") from None
    return out


def check_pages(pages: Mapping[int, Any] | None, num_tokens: int, layout: Layout) -> dict[int, bytes]:
    """Page payloads keyed by page index, as bytes, in index order.

    Only full pages of the ``num_tokens`` tokens may be given, each exactly
    ``layout.page_bytes`` long, each index once and as an ``int`` (:func:`page_payloads`);
    anything else raises ``InvalidPage``.
    """
    if pages is None:
        return {}
    full = num_tokens // layout.page_tokens
    out: dict[int, bytes] = {}
    for index, view in page_payloads(pages).items():
        if not 0 <= index < full:
            raise InvalidPage(
                f"page index {index!r} is out of range: {num_tokens} tokens hold {full} full pages "
                f"of {layout.page_tokens} tokens"
            )
        if view.nbytes != layout.page_bytes:
            raise InvalidPage(
                f"page {index} has {view.nbytes} bytes; layout {layout.name!r} pages have {layout.page_bytes}"
            )
        payload = pages[index]
        out[index] = payload if type(payload) is bytes else view.tobytes()
    return dict(sorted(out.items()))
