"""The scheduler side's book of live requests: their dss scope, sessions, saves in flight and commits.

A request is tracked from the first time the scheduler asks about it until it finishes.
Its scope comes from its ``kv_transfer_params``; its session is used for pages only when
it belongs to the request's namespace and has shard 0's layout (otherwise the pages live
in the namespace, outside the session). When it finishes, its tokens are committed as a
new version of its session. A new request of a session whose previous request still has
saves in flight waits for them (at most ``session_wait_s``), so that a turn sent right
after the previous one finished reuses all of its pages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dss_adapters.vllm.settings import Scope, Settings, request_scope

import dss
from dss import DssError, InvalidInput, UnknownSession

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.dss.scheduler")


@dataclass(slots=True)
class Tracked:
    """What the scheduler side knows about one live request."""

    request: Request
    scope: Scope
    """The request's scope as it asked for it."""
    save_scope: Scope
    """Where its pages are saved (the session's id is dropped when the session is unusable)."""
    commit_session: str | None
    """The session its tokens are committed to at the end, if any."""
    num_stored_pages: int = 0
    """Leading pages already in the store (every shard) or in a save job."""
    num_sent_tokens: int = 0
    num_issued: int = 0
    """Save reports expected (one per job and shard)."""
    num_done: int = 0
    num_loaded_tokens: int = 0
    """Tokens loaded (every load of the request, less the pages that failed)."""
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    """``num_loaded_tokens`` by the tier each page was planned to load from."""
    loaded_blocks: list[int] = field(default_factory=list)
    """Block ids (of the first KV cache group) of the last load job, page ``first_loaded_page`` first."""
    loaded_tiers: list[str] = field(default_factory=list)
    """The tier each page of the last load job was planned to load from (as ``loaded_blocks``)."""
    first_loaded_page: int = 0
    asked: bool = False
    """dss looked up the request's prompt (it counts in the request metrics when it finishes)."""
    engine_cached_tokens: int = 0
    """Leading tokens vLLM's own prefix cache held when it last asked."""
    stored_tokens: int = 0
    """Leading tokens dss could have loaded when it last looked (page-aligned, a token left to compute)."""
    decision: dss.LoadDecision | None = None
    """The last load-or-recompute decision for it (``None``: dss had nothing past vLLM's own cache)."""
    hit_sources: dict[str, int] = field(default_factory=dict)
    """Tokens of the last load by the tier planned (``host``, ``disk``, ``remote``)."""
    lossy: dict[str, int] = field(default_factory=dict)
    """Loaded tokens that came from lower-precision copies, per encoding (as the workers reported)."""
    waiting_for: set[str] | None = None
    """Finished requests of the same session whose saves this one waits for."""
    waiting_since: float | None = None

    def took_load(
        self, first: int, blocks: Sequence[int], tiers: Sequence[str], num_tokens: int, page_tokens: int
    ) -> None:
        """A load job of ``num_tokens`` tokens, pages ``first ..`` into ``blocks`` (the first KV
        cache group's), each planned from its tier in ``tiers``, was scheduled: count it in."""
        self.num_loaded_tokens += num_tokens
        self.loaded_blocks = list(blocks)
        self.loaded_tiers = list(tiers)
        self.first_loaded_page = first
        self.hit_sources = {}
        for tier in tiers:
            self.hit_sources[tier] = self.hit_sources.get(tier, 0) + page_tokens
            self.loaded_by_tier[tier] = self.loaded_by_tier.get(tier, 0) + page_tokens

    def lose_load(self, first_failed: int, page_tokens: int) -> int:
        """Pages ``first_failed ..`` of the last load did not load: count them out (vLLM
        recomputes them). Returns how many pages were lost."""
        lost = len(self.loaded_blocks) - first_failed
        if lost <= 0:
            return 0
        self.num_loaded_tokens -= lost * page_tokens
        for tier in self.loaded_tiers[first_failed:]:
            self.loaded_by_tier[tier] -= page_tokens
        self.num_stored_pages = min(self.num_stored_pages, self.first_loaded_page + first_failed)
        self.loaded_blocks = self.loaded_blocks[:first_failed]
        self.loaded_tiers = self.loaded_tiers[:first_failed]
        return lost


class RequestBook:
    """Live requests and the finished ones whose saves are still in flight."""

    def __init__(self, settings: Settings, layout: dss.Layout, store: dss.Store) -> None:
        self.settings = settings
        self.layout = layout
        """Shard 0's layout: the one sessions are created with."""
        self.store = store
        self.live: dict[str, Tracked] = {}
        self._unsettled: dict[str, tuple[tuple[str, str, str], int]] = {}
        """Finished requests with save reports outstanding: session key and reports left."""

    def track(self, request: Request) -> Tracked | None:
        """The request's entry, made on first sight; ``None`` when dss does not serve it (LoRA,
        multimodal or embedding inputs, malformed dss parameters)."""
        tracked = self.live.get(request.request_id)
        if tracked is not None:
            return tracked
        if request.lora_request is not None or request.mm_features or request.prompt_embeds is not None:
            return None
        try:
            scope = request_scope(self.settings, request.kv_transfer_params)
        except InvalidInput as exc:
            log.warning("request %s is served without dss: %s", request.request_id, exc)
            return None
        tracked = Tracked(request, scope, scope, scope.session_id)
        if scope.session_id is not None:
            self._check_session(tracked)
        self.live[request.request_id] = tracked
        return tracked

    def note_lossy(self, lossy: dict[str, dict[str, int]]) -> None:
        """Count the loaded tokens the workers served from lower-precision copies (per request, per encoding)."""
        for req_id, counts in lossy.items():
            tracked = self.live.get(req_id)
            if tracked is not None:
                for encoding, tokens in counts.items():
                    tracked.lossy[encoding] = tracked.lossy.get(encoding, 0) + tokens

    def note_saved(self, saved: dict[str, int]) -> None:
        """Count the save reports of the workers (per request)."""
        for req_id, count in saved.items():
            tracked = self.live.get(req_id)
            if tracked is not None:
                tracked.num_done += count
            elif req_id in self._unsettled:
                key, left = self._unsettled[req_id]
                if left > count:
                    self._unsettled[req_id] = (key, left - count)
                else:
                    del self._unsettled[req_id]

    def finish(self, request: Request) -> dict[str, Any] | None:
        """Forget a finished request, commit its tokens to its session if it completed; its
        output ``kv_transfer_params`` (``None`` if dss did not serve it)."""
        from vllm.v1.request import RequestStatus

        tracked = self.live.pop(request.request_id, None)
        if tracked is None:
            return None
        left = tracked.num_issued - tracked.num_done
        key = _session_key(tracked.scope)
        if left > 0 and key is not None:
            self._unsettled[request.request_id] = (key, left)
        out: dict[str, Any] = {
            "session_id": tracked.commit_session,
            "version_id": None,
            "loaded_tokens": tracked.num_loaded_tokens,
            "engine_cached_tokens": tracked.engine_cached_tokens,
            "result": request_result(
                tracked.num_loaded_tokens, tracked.engine_cached_tokens, tracked.stored_tokens, tracked.decision
            ),
        }
        if tracked.decision is not None and not tracked.decision.load:
            out["decision"] = decision_out(tracked.decision)
        lossy = _lossy_out(tracked.lossy, tracked.num_loaded_tokens)
        if lossy:
            out["encodings"], out["lossy_tokens"] = lossy, sum(lossy.values())
        complete = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_REPETITION,
        )
        if tracked.commit_session is not None and tracked.scope.commit and complete:
            out.update(self._commit(tracked, request.all_token_ids[:], tracked.scope.label))
        return {"dss": out}

    def must_wait(self, tracked: Tracked) -> bool:
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
        log.warning(
            "request %s stops waiting for the pending saves of session %r",
            tracked.request.request_id,
            tracked.scope.session_id,
        )
        tracked.waiting_for = set()
        return False

    def _check_session(self, tracked: Tracked) -> None:
        """Keep the session for pages only if it is the request's namespace's and has this layout."""
        scope = tracked.save_scope
        try:
            session = self.store.session(scope.session_id, tenant_id=scope.tenant_id)
        except UnknownSession:
            return
        if session.user_id != scope.user_id:
            log.warning(
                "request %s names session %r of another user: served in its own namespace without it",
                tracked.request.request_id,
                scope.session_id,
            )
            tracked.commit_session = None
            tracked.save_scope = Scope(scope.tenant_id, scope.user_id, None)
        elif session.layout != self.layout:
            log.info(
                "session %r has another page layout; request %s keeps its pages outside the session",
                scope.session_id,
                tracked.request.request_id,
            )
            tracked.save_scope = Scope(scope.tenant_id, scope.user_id, None)

    def _commit(self, tracked: Tracked, tokens: list[int], label: str | None) -> dict[str, Any]:
        scope = tracked.save_scope
        session_id = tracked.commit_session
        assert session_id is not None
        try:
            try:
                version = self.store.commit(session_id, tokens, label=label, tenant_id=scope.tenant_id)
            except UnknownSession:
                self.store.create_session(
                    session_id, user_id=scope.user_id, tenant_id=scope.tenant_id, layout=self.layout
                )
                version = self.store.commit(session_id, tokens, label=label, tenant_id=scope.tenant_id)
        except DssError as exc:
            log.error("commit of request %s to session %r failed: %s", tracked.request.request_id, session_id, exc)
            return {"error": f"{exc.kind}: {exc}"}
        return {"version_id": int(version.version_id), "num_tokens": version.num_tokens}


def request_result(
    loaded_tokens: int, engine_cached_tokens: int, stored_tokens: int, decision: dss.LoadDecision | None = None
) -> str:
    """Who supplied a finished request's prompt KV: ``"hit"`` when dss loaded some
    (``loaded_tokens`` after pages that failed), ``"engine"`` when vLLM's own prefix cache held
    some and at least the ``stored_tokens`` dss could have loaded (dss had nothing to add),
    ``"recompute"`` when dss held more but recomputing it was estimated faster (``decision``),
    ``"miss"`` otherwise (neither had it; or dss had more but loaded none of it)."""
    if loaded_tokens > 0:
        return "hit"
    if engine_cached_tokens > 0 and engine_cached_tokens >= stored_tokens:
        return "engine"
    if decision is not None and not decision.load:
        return "recompute"
    return "miss"


def _lossy_out(lossy: dict[str, int], loaded_tokens: int) -> dict[str, int]:
    """Loaded tokens per lossy encoding, least lossy first, at most ``loaded_tokens`` in all (pages
    loaded past one that failed were recomputed by vLLM: the lossiest are counted out first)."""
    out: dict[str, int] = {}
    left = loaded_tokens
    for encoding in ("int8", "fp8", "k8v4"):
        tokens = min(lossy.get(encoding, 0), left)
        if tokens:
            out[encoding] = tokens
            left -= tokens
    return out


def decision_out(decision: dss.LoadDecision) -> dict[str, Any]:
    """A load decision in a request's output ``kv_transfer_params``: ``load`` (bool), the
    estimates ``load_ms`` and ``recompute_ms``, and the ``recompute_tokens_per_s`` used."""
    return {
        "load": decision.load,
        "load_ms": round(decision.load_seconds * 1e3, 3),
        "recompute_ms": round(decision.recompute_seconds * 1e3, 3),
        "recompute_tokens_per_s": round(decision.recompute_tokens_per_s, 1),
    }


def _session_key(scope: Scope) -> tuple[str, str, str] | None:
    """Requests naming the same session of the same namespace wait for each other's saves."""
    if scope.session_id is None:
        return None
    return (scope.tenant_id, scope.user_id, scope.session_id)
