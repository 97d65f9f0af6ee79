"""Pages: save, read, sizes, shared prefixes, prefetch (tag ``pages``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from dss.service import codec
from dss.service import models as m
from dss.service.calls import CALL, V1, Call, checked_tokens
from dss.service.codec import dump, list_of

router = APIRouter()


@router.post("/v1/pages", response_model=m.SavePagesOut, tags=["pages"], **V1)
def save_pages(body: m.SavePagesIn, call: Call = CALL) -> dict[str, Any]:
    """Store pages of tokens ahead of the commit that will contain them (or, with no session, for the
    namespace (user_id, layout))."""
    tenant = call.scope.writing(body.tenant_id)
    layout = codec.layout_of(body.layout) if body.layout is not None else None
    saved = call.store.save_pages(
        body.session_id,
        checked_tokens(call, body.tokens),
        codec.decode_pages(body.pages),
        tenant_id=tenant,
        user_id=body.user_id,
        layout=layout,
    )
    return codec.saved_out(saved)


@router.post("/v1/pages/read", response_model=m.ReadPagesOut, tags=["pages"], **V1)
def read_pages(body: m.ReadPagesIn, call: Call = CALL) -> dict[str, Any]:
    """Payloads of pages by id (null for a page no tier holds, or one the key may not read, or one of
    another tenant than ``tenant_id``)."""
    ids = [bytes.fromhex(p) for p in body.page_ids]
    payloads = call.scope.read_pages(
        call.store, ids, call.config.max_body_bytes, tenant_id=body.tenant_id, load=body.load
    )
    return {"pages": [codec.encode_page(p) for p in payloads]}


@router.post("/v1/pages/sizes", response_model=m.PageSizesOut, tags=["pages"], **V1)
def page_sizes(body: m.PageSizesIn, call: Call = CALL) -> dict[str, Any]:
    """Sizes of the pages the catalog holds, of those the key may read (of ``tenant_id`` if named)."""
    ids = [bytes.fromhex(p) for p in body.page_ids]
    sizes = call.store.page_sizes(ids, tenant_id=call.scope.page_tenant(body.tenant_id))
    return {"sizes": {page_id.hex(): size for page_id, size in sizes.items()}}


@router.post("/v1/prefixes", response_model=m.VersionOut, status_code=201, tags=["pages"], **V1)
def register_prefix(body: m.RegisterPrefixIn, call: Call = CALL) -> dict[str, Any]:
    """Share a prefix (a system prompt, tool definitions) with every user of the tenant: its pages
    belong to the tenant, are pinned and stay when a user is erased."""
    tenant = call.scope.writing(body.tenant_id)
    return dump(
        call.store.register_prefix(
            checked_tokens(call, body.tokens),
            codec.decode_pages(body.pages),
            layout=codec.layout_of(body.layout),
            tenant_id=tenant,
            label=body.label,
        )
    )


@router.get("/v1/prefixes", response_model=list_of(m.VersionOut), tags=["pages"], **V1)
def shared_prefixes(tenant_id: str | None = None, call: Call = CALL) -> list[dict[str, Any]]:
    """The tenant's shared prefixes (every layout), oldest first."""
    return [dump(v) for v in call.store.shared_prefixes(tenant_id=call.scope.reading(tenant_id))]


@router.post("/v1/prefetch", response_model=m.PrefetchOut, status_code=202, tags=["pages"], **V1)
def prefetch(body: m.PrefetchIn, call: Call = CALL) -> dict[str, Any]:
    """Move the pages of the session's head up to host in the background (call it when the user starts
    typing); answers at once with how many pages will move (``wait``: once they moved)."""
    tenant = call.scope.reading(body.tenant_id)
    moving = call.store.prefetch(body.session_id, tenant_id=tenant, wait=body.wait)
    return {"session_id": body.session_id, "num_pages": moving}


@router.post("/v1/prefetch_candidates", response_model=m.PageIdsOut, tags=["pages"], **V1)
def prefetch_candidates(body: m.PrefetchCandidatesIn, call: Call = CALL) -> dict[str, Any]:
    """Ids of the pages the nearest near-duplicate lets a prompt reuse, longest first; with ``promote``
    they are read now (disk pages come into the host tier). Scope as /v1/nearest."""
    tenant = call.scope.reading(body.tenant_id)
    ids = call.store.prefetch_candidates(
        checked_tokens(call, body.tokens),
        session_id=body.session_id,
        tenant_id=tenant,
        user_id=body.user_id,
        layout=codec.layout_of(body.layout) if body.layout is not None else None,
        promote=body.promote,
    )
    return {"page_ids": [page_id.hex() for page_id in ids]}
