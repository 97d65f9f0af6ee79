"""The calls an engine's connector makes of ``dss serve``: reading pages and reporting what
the engines hold (the device tier). :class:`dss.service.client.Client` has them with the rest
of the store's API."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

from dss.core.errors import InvalidInput
from dss.core.types import PageRef
from dss.core.validate import check_buffers, check_flag, check_page_ids, check_ready
from dss.service import codec
from dss.service.transport import Transport, params_of


class EngineCalls(Transport):
    """Pages and the device tier through the service (see :class:`dss.service.client.Client`)."""

    @overload
    def read_pages(
        self, pages: Sequence[PageRef | bytes], *, tenant_id: str | None = None, load: bool = True, into: None = None
    ) -> list[bytes | None]: ...

    @overload
    def read_pages(
        self,
        pages: Sequence[PageRef | bytes],
        *,
        tenant_id: str | None = None,
        load: bool = True,
        into: Sequence[Any],
        ready: Callable[[list[int]], object] | None = None,
    ) -> list[memoryview | None]: ...

    def read_pages(
        self,
        pages: Sequence[PageRef | bytes],
        *,
        tenant_id: str | None = None,
        load: bool = True,
        into: Sequence[Any] | None = None,
        ready: Callable[[list[int]], object] | None = None,
    ) -> list[bytes | None] | list[memoryview | None]:
        """:meth:`dss.Store.read_pages`; ``None`` also for a page the key may not read (another
        tenant's). With ``into``, the payloads that came back are copied into the buffers (none
        is written, and ``InvalidInput`` raised, when a payload's size is not its buffer's),
        and ``ready`` is told them all at once."""
        ids = [page_id.hex() for page_id in check_page_ids(pages)]
        buffers = check_buffers(into, len(ids))
        check_flag("load", load)
        check_ready(ready, buffers)
        out = self._call("POST", "/v1/pages/read", json={"page_ids": ids, "tenant_id": tenant_id, "load": load})
        payloads = [codec.decode_pages({0: p})[0] if p is not None else None for p in out["pages"]]
        if buffers is None:
            return payloads
        copied = _copied(payloads, buffers)
        filled = [i for i, view in enumerate(copied) if view is not None]
        if ready is not None and filled:
            ready(filled)
        return copied

    def page_sizes(self, page_ids: Sequence[bytes], *, tenant_id: str | None = None) -> dict[bytes, int]:
        """:meth:`dss.Store.page_sizes` of the pages the key may read (a non-admin key: its tenant's)."""
        ids = [page_id.hex() for page_id in check_page_ids(page_ids)]
        sizes = self._call("POST", "/v1/pages/sizes", json={"page_ids": ids, "tenant_id": tenant_id})["sizes"]
        return {bytes.fromhex(page_id): int(size) for page_id, size in sizes.items()}

    # -- engines: the device tier (admin key, but residency) ----------------------------------

    def mark_resident(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """:meth:`dss.Store.mark_resident` in the service's store (admin key)."""
        body = {"engine_id": engine_id, "page_ids": [page_id.hex() for page_id in check_page_ids(page_ids)]}
        self._call("POST", "/v1/engines/resident", json=body)

    def evicted(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """:meth:`dss.Store.evicted` in the service's store (admin key)."""
        body = {"engine_id": engine_id, "page_ids": [page_id.hex() for page_id in check_page_ids(page_ids)]}
        self._call("POST", "/v1/engines/evicted", json=body)

    def forget_engine(self, engine_id: str) -> int:
        """:meth:`dss.Store.forget_engine` (admin key): how many pages the engine held."""
        return int(self._call("POST", "/v1/engines/forget", json={"engine_id": engine_id})["num_pages"])

    def residency(self, session_id: str, *, tenant_id: str | None = None) -> dict[str, int]:
        """:meth:`dss.Store.residency`: ``{engine_id: pages}`` of the session's head."""
        out = self._call("GET", "/v1/residency", params=params_of(session_id=session_id, tenant_id=tenant_id))
        return {engine: int(n) for engine, n in out["engines"].items()}


def _copied(payloads: Sequence[bytes | None], buffers: Sequence[memoryview]) -> list[memoryview | None]:
    """Each payload copied into its buffer, the buffer in its place (``None`` stays ``None``);
    nothing is copied when a size differs."""
    for i, (payload, view) in enumerate(zip(payloads, buffers)):
        if payload is not None and len(payload) != len(view):
            raise InvalidInput(f"buffer {i} has {len(view)} bytes; its page has {len(payload)}")
    for payload, view in zip(payloads, buffers):
        if payload is not None:
            view[:] = payload
    return [view if payload is not None else None for payload, view in zip(payloads, buffers)]
