"""The device tier from vLLM's side: which dss pages this engine's KV cache still holds.

When a request finishes, vLLM keeps its full blocks in its prefix cache (GPU memory in
production) until it needs them for other requests. The scheduler side of the connector
records, for every page of a finished request that dss stores and whose blocks vLLM's
block pool still caches, the vLLM block hashes of the page, and tells the store the engine
holds it (``Store.mark_resident``); every scheduler step it checks the pages it recorded
against the block pool and tells the store which ones vLLM let go (``Store.evicted``). So
``resume`` reports those pages on the ``device`` tier, and a router asking
``Store.residency(session_id)`` learns which engine holds a session. vLLM itself never loads
such pages from dss: its own prefix cache serves them first.

A finished request's last pages may still be on their way to the store (saves run in the
workers); they are looked up again at later steps, for a while (:data:`PENDING_STEPS`). The
lease on the engine's residency is renewed every :data:`RENEW_S` seconds of steps; when the
engine shuts down, its residency is forgotten.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import dss
from dss import UnknownSession

if TYPE_CHECKING:
    from dss_adapters.vllm.settings import Scope
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.request import Request

log = logging.getLogger("vllm.dss.device")

PENDING_STEPS = 64
"""Scheduler steps a finished request's pages are looked for in the store (its saves may lag)."""
RENEW_S = 10.0
"""How often the engine's lease on its residency is renewed while it runs."""


@dataclass(slots=True)
class _Finished:
    scope: Scope
    tokens: list[int]
    hashes: list[Any]
    """vLLM's block hashes of the request, at the pool's hash block size."""
    steps_left: int


class DeviceResidency:
    """What this engine's block pool holds, told to the store (see the module docstring)."""

    def __init__(self, store: dss.Store, engine_id: str, layout: dss.Layout, num_groups: int) -> None:
        self.store = store
        self.engine_id = engine_id
        self.layout = layout
        self.group_ids = list(range(num_groups))
        self.pool: BlockPool | None = None
        self.pages: dict[bytes, list[Any]] = {}
        """Pages the store was told this engine holds, with their blocks' hashes."""
        self._pending: list[_Finished] = []
        self._renewed = 0.0

    def bind(self, pool: BlockPool) -> None:
        self.pool = pool

    def finished(self, request: Request, scope: Scope) -> None:
        """A request finished (and committed): its pages that vLLM caches are on this device."""
        if self.pool is None or not self.pool.enable_caching or scope is None:
            return
        entry = _Finished(scope, request.all_token_ids[:], list(request.block_hashes), PENDING_STEPS)
        if not self._mark(entry):
            self._pending.append(entry)

    def step(self) -> None:
        """Once per scheduler step: pages vLLM let go, pages of finished requests stored meanwhile."""
        if self.pool is None:
            return
        gone = [page_id for page_id, hashes in self.pages.items() if not self._cached(hashes)]
        for page_id in gone:
            del self.pages[page_id]
        now = time.monotonic()
        if gone or now - self._renewed > RENEW_S:
            self.store.evicted(self.engine_id, gone)
            self._renewed = now
        if self._pending:
            still = []
            for entry in self._pending:
                entry.steps_left -= 1
                if not self._mark(entry) and entry.steps_left > 0:
                    still.append(entry)
            self._pending = still

    def close(self) -> None:
        """The engine shuts down: it holds nothing any more."""
        self._pending.clear()
        self.pages.clear()
        try:
            self.store.forget_engine(self.engine_id)
        except dss.StoreClosed:
            pass

    # -- internals -------------------------------------------------------------------------

    def _mark(self, entry: _Finished) -> bool:
        """Tell the store which of the request's stored pages vLLM caches; whether every full
        page of it was stored already (nothing left to look for later)."""
        assert self.pool is not None
        page_tokens = self.layout.page_tokens
        per_page = page_tokens // self.pool.hash_block_size
        if per_page <= 0 or page_tokens % self.pool.hash_block_size:
            return True  # pages smaller than vLLM's hash blocks: residency is not tracked
        result = self._stored(entry)
        if result is None:
            return True
        held = []
        for i, ref in enumerate(result.pages):
            hashes = entry.hashes[i * per_page : (i + 1) * per_page]
            if len(hashes) == per_page and self._cached(hashes):
                held.append(bytes(ref.page_id))
                self.pages[bytes(ref.page_id)] = hashes
        if held:
            self.store.mark_resident(self.engine_id, held)
            self._renewed = time.monotonic()
        full = min(len(entry.hashes) // per_page, (len(entry.tokens) - 1) // page_tokens)
        return result.matched_tokens >= full * page_tokens

    def _stored(self, entry: _Finished) -> dss.ResumeResult | None:
        scope = entry.scope
        try:
            if scope.session_id is not None:
                return self.store.resume(scope.session_id, entry.tokens, tenant_id=scope.tenant_id)
            return self.store.lookup(entry.tokens, layout=self.layout, user_id=scope.user_id, tenant_id=scope.tenant_id)
        except (UnknownSession, dss.ErasureInProgress):
            return None

    def _cached(self, hashes: list[Any]) -> bool:
        assert self.pool is not None
        return all(self.pool.get_cached_block(h, self.group_ids) is not None for h in hashes)
