"""The scheduler side of the dss connector: what to load, what to save, and the commit.

It runs in vLLM's EngineCore process (the main process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and only reads the store, except for the one commit
per finished request. For every request it

1. asks the store how much of the prompt is stored — ``resume`` for a session of the
   request's namespace and layout, ``lookup`` (exact chain-hash match in the namespace)
   for a request without one — and offers vLLM the pages past what vLLM already holds,
   at most ``(num_tokens - 1) // block_size`` blocks, because a synchronous load must leave
   a token to compute (:meth:`SchedulerSide.num_new_matched_tokens`, side-effect free);
2. turns vLLM's block allocation into a load job (block ids for the offered pages);
3. each step, plans a save job for every block that becomes full, prompt or generated,
   chunked prefill included, except pages the store already held;
4. when the request finishes (stopped, length-capped or by repetition), commits its tokens as a new
   version of its session and returns ``{"dss": {...}}`` as the request's output
   ``kv_transfer_params``.

A new request of a session whose previous request still has saves in flight waits for
them (``None``, "ask again", for at most ``session_wait_s``), so that a turn sent right
after the previous one finished reuses all of its pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dss_adapters.vllm_meta import DssConnectorMetadata, DssWorkerMetadata, LoadJob, SaveJob
from dss_adapters.vllm_settings import Scope, Settings, request_scope

import dss
from dss import DssError, InvalidInput, UnknownSession

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.dss.scheduler")


@dataclass(slots=True)
class _Tracked:
    """What the scheduler side knows about one live request."""

    request: Request
    scope: Scope
    """The request's scope as it asked for it."""
    save_scope: Scope
    """Where its pages are saved (the session's id is dropped when the session is unusable)."""
    commit_session: str | None
    """The session its tokens are committed to at the end, if any."""
    num_stored_pages: int = 0
    """Leading pages already in the store or in a save job."""
    num_sent_tokens: int = 0
    num_issued: int = 0
    num_done: int = 0
    num_loaded_tokens: int = 0
    loaded_blocks: list[int] = field(default_factory=list)
    """Block ids of the last load job, page ``first_loaded_page`` first."""
    first_loaded_page: int = 0
    waiting_for: set[str] | None = None
    """Finished requests of the same session whose saves this one waits for."""
    waiting_since: float | None = None


@dataclass(slots=True)
class _Plan:
    first_page: int
    page_ids: list[bytes] = field(default_factory=list)


class SchedulerSide:
    """Scheduler-side state of the connector (see the module docstring)."""

    def __init__(self, settings: Settings, layout: dss.Layout, store: dss.Store) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.page_tokens = layout.page_tokens
        self._tracked: dict[str, _Tracked] = {}
        self._plans: dict[str, _Plan] = {}
        self._loads: list[LoadJob] = []
        self._unsettled: dict[str, tuple[tuple[str, str, str], int]] = {}
        """Finished requests with save jobs not yet done: session key and jobs outstanding."""

    # -- vLLM hooks ------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` whose KV the store will load (synchronously).

        Changes nothing in the store. Returns ``(None, False)`` while the request waits for
        its session's previous saves, ``(0, False)`` on a miss or when dss does not serve
        the request (LoRA, multimodal or embedding inputs; malformed dss parameters).
        """
        tracked = self._track(request)
        if tracked is None or not self.settings.load:
            return 0, False
        if self._must_wait(tracked):
            return None, False
        result = self._match(tracked, request.all_token_ids[:])
        tracked.num_stored_pages = max(tracked.num_stored_pages, result.matched_tokens // self.page_tokens)
        limit = (request.num_tokens - 1) // self.page_tokens * self.page_tokens
        matched = min(result.matched_tokens, limit)
        if matched <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0, False
        first = num_computed_tokens // self.page_tokens
        pages = result.pages[first:matched // self.page_tokens]
        self._plans[request.request_id] = _Plan(first, [bytes(p.page_id) for p in pages])
        return matched - num_computed_tokens, False

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Turn the plan of an admitted request into a load job for ``num_external_tokens`` tokens."""
        tracked = self._track(request)
        plan = self._plans.pop(request.request_id, None)
        if tracked is None or plan is None or num_external_tokens <= 0:
            return
        count = num_external_tokens // self.page_tokens
        if count * self.page_tokens != num_external_tokens or count > len(plan.page_ids):
            raise AssertionError(f"vLLM granted {num_external_tokens} external tokens; dss offered "
                                 f"{len(plan.page_ids)} pages of {self.page_tokens}")
        block_ids = blocks.get_block_ids()[0][plan.first_page:plan.first_page + count]
        self._loads.append(LoadJob(request.request_id, plan.page_ids[:count], list(block_ids)))
        tracked.num_loaded_tokens += num_external_tokens
        tracked.loaded_blocks = list(block_ids)
        tracked.first_loaded_page = plan.first_page

    def build_meta(self, scheduler_output: SchedulerOutput) -> DssConnectorMetadata:
        """This step's jobs: the pending loads, and a save for every block that becomes full."""
        meta = DssConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self.settings.save:
            return meta
        state = scheduler_output.kv_connector_block_state
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            end = request.num_computed_tokens + num_scheduled - len(spec.get(req_id, ()))
            # only pages whose tokens are all known (with async scheduling the last sampled
            # token may not be in all_token_ids yet; such a page is saved a step later)
            end = min(end, request.num_tokens)
            first, full = tracked.num_stored_pages, end // self.page_tokens
            if full <= first or state is None:
                continue
            table = state.get_block_ids(req_id)
            if table is None:
                continue
            sent, need = tracked.num_sent_tokens, full * self.page_tokens
            meta.saves.append(SaveJob(req_id, tracked.save_scope, sent, request.all_token_ids[sent:need], first,
                                      list(table[0][first:full])))
            tracked.num_sent_tokens = max(sent, need)
            tracked.num_stored_pages = full
            tracked.num_issued += 1
        return meta

    def on_worker_output(self, output: KVConnectorOutput) -> None:
        """Count the save jobs the worker finished; plan again what failed to load or was dropped.

        vLLM recomputes a request from its first block that failed to load; the pages from
        there on are saved again once recomputed, and are not counted as loaded.
        """
        if output.invalid_block_ids:
            self._on_load_errors(output.invalid_block_ids)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, DssWorkerMetadata):
            return
        for req_id, first_page in meta.dropped.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.num_stored_pages = min(tracked.num_stored_pages, first_page)
        for req_id, count in meta.saved.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.num_done += count
            elif req_id in self._unsettled:
                key, left = self._unsettled[req_id]
                if left > count:
                    self._unsettled[req_id] = (key, left - count)
                else:
                    del self._unsettled[req_id]

    def finished(self, request: Request) -> dict[str, Any] | None:
        """Commit a finished request's tokens to its session; its output ``kv_transfer_params``."""
        from vllm.v1.request import RequestStatus

        self._plans.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return None
        left = tracked.num_issued - tracked.num_done
        key = _session_key(tracked.scope)
        if left > 0 and key is not None:
            self._unsettled[request.request_id] = (key, left)
        out: dict[str, Any] = {"session_id": tracked.commit_session, "version_id": None,
                               "loaded_tokens": tracked.num_loaded_tokens}
        complete = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                                      RequestStatus.FINISHED_REPETITION)
        if tracked.commit_session is not None and tracked.scope.commit and complete:
            out.update(self._commit(tracked, request.all_token_ids[:], tracked.scope.label))
        return {"dss": out}

    # -- internals -------------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked | None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return None
        try:
            scope = request_scope(self.settings, request.kv_transfer_params)
        except InvalidInput as exc:
            log.warning("request %s is served without dss: %s", request.request_id, exc)
            return None
        tracked = _Tracked(request, scope, scope, scope.session_id)
        if scope.session_id is not None:
            self._check_session(tracked)
        self._tracked[request.request_id] = tracked
        return tracked

    def _check_session(self, tracked: _Tracked) -> None:
        """Keep the session for pages only if it is the request's namespace's and has this layout."""
        scope = tracked.save_scope
        try:
            session = self.store.session(scope.session_id, tenant_id=scope.tenant_id)
        except UnknownSession:
            return
        if session.user_id != scope.user_id:
            log.warning("request %s names session %r of another user: served in its own namespace without it",
                        tracked.request.request_id, scope.session_id)
            tracked.commit_session = None
            tracked.save_scope = Scope(scope.tenant_id, scope.user_id, None)
        elif session.layout != self.layout:
            log.info("session %r has another page layout; request %s keeps its pages outside the session",
                     scope.session_id, tracked.request.request_id)
            tracked.save_scope = Scope(scope.tenant_id, scope.user_id, None)

    def _match(self, tracked: _Tracked, tokens: list[int]) -> dss.ResumeResult:
        scope = tracked.save_scope
        if scope.session_id is not None:
            try:
                return self.store.resume(scope.session_id, tokens, tenant_id=scope.tenant_id)
            except UnknownSession:
                pass
        return self.store.lookup(tokens, layout=self.layout, user_id=scope.user_id, tenant_id=scope.tenant_id)

    def _on_load_errors(self, block_ids: set[int]) -> None:
        for tracked in self._tracked.values():
            failed = [i for i, block in enumerate(tracked.loaded_blocks) if block in block_ids]
            if not failed:
                continue
            lost = len(tracked.loaded_blocks) - failed[0]
            tracked.num_loaded_tokens -= lost * self.page_tokens
            tracked.num_stored_pages = min(tracked.num_stored_pages, tracked.first_loaded_page + failed[0])
            tracked.loaded_blocks = tracked.loaded_blocks[:failed[0]]
            log.warning("request %s: %d dss pages failed to load; vLLM recomputes them",
                        tracked.request.request_id, lost)

    def _must_wait(self, tracked: _Tracked) -> bool:
        """Whether the request still waits for the saves of its session's earlier requests.

        It waits only for the requests that had finished with saves outstanding when it
        first asked (so a busy session cannot starve it), and at most ``session_wait_s``.
        """
        key = _session_key(tracked.scope)
        if key is None or self.settings.session_wait_s <= 0:
            return False
        now = time.monotonic()
        if tracked.waiting_for is None:
            tracked.waiting_for = {req_id for req_id, (k, _) in self._unsettled.items() if k == key}
            tracked.waiting_since = now
        if not any(req_id in self._unsettled for req_id in tracked.waiting_for):
            return False
        assert tracked.waiting_since is not None
        if now - tracked.waiting_since < self.settings.session_wait_s:
            return True
        log.warning("request %s stops waiting for the pending saves of session %r",
                    tracked.request.request_id, tracked.scope.session_id)
        tracked.waiting_for = set()
        return False

    def _commit(self, tracked: _Tracked, tokens: list[int], label: str | None) -> dict[str, Any]:
        scope = tracked.save_scope
        session_id = tracked.commit_session
        assert session_id is not None
        try:
            try:
                version = self.store.commit(session_id, tokens, label=label, tenant_id=scope.tenant_id)
            except UnknownSession:
                self.store.create_session(session_id, user_id=scope.user_id, tenant_id=scope.tenant_id,
                                          layout=self.layout)
                version = self.store.commit(session_id, tokens, label=label, tenant_id=scope.tenant_id)
        except DssError as exc:
            log.error("commit of request %s to session %r failed: %s", tracked.request.request_id, session_id, exc)
            return {"error": f"{exc.kind}: {exc}"}
        return {"version_id": int(version.version_id), "num_tokens": version.num_tokens}


def _session_key(scope: Scope) -> tuple[str, str, str] | None:
    """Requests naming the same session of the same namespace wait for each other's saves."""
    if scope.session_id is None:
        return None
    return (scope.tenant_id, scope.user_id, scope.session_id)
