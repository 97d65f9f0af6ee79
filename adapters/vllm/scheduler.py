"""The scheduler side of the dss connector: what to load (and how), what to save, and the commit.

It runs in vLLM's EngineCore process (the main process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and only reads the store, except for the one commit
per finished request (:mod:`dss_adapters.vllm.requests`). For every request it

1. asks the store how much of the prompt every shard has stored — ``resume`` for a
   session of the request's namespace and shard 0's layout, ``lookup`` (exact chain-hash
   match in the namespace) for the other shards and for a request without a session —
   and offers vLLM the pages past what vLLM already holds that **every** shard has, at most
   ``(num_tokens - 1) // block_size`` blocks (a synchronous load must leave a token to
   compute), and nothing when recomputing them is estimated faster than loading them from
   the tiers planned (:meth:`dss.ResumeResult.decision` at the engine's prefill speed,
   measured on its own steps, :mod:`dss_adapters.vllm.prefill`; the request's output
   ``kv_transfer_params`` carry the decision, and such a request counts as ``recompute``)
   (:meth:`SchedulerSide.num_new_matched_tokens`, side-effect free);
2. chooses how to load (``load_mode``): synchronously when the workers hold every page in
   their host tiers (:mod:`dss_adapters.vllm.hosts`) or when no other request is running
   (the load stalls nobody), asynchronously otherwise, and always
   asynchronously with several KV cache groups (vLLM takes block-level failures from one
   group only). With several workers, a synchronous load that fails on one rank leaves the
   other ranks' saves of that step computed from it, so the workers hold the saves of a
   step with synchronous loads until the scheduler has seen its outcome on every rank and
   tells them, with the next step's metadata, to write or drop them;
3. turns vLLM's block allocation into a load job (each group's block ids for the offered
   pages; blocks a sliding-window group does not keep are not loaded, and a state-space
   group's only where vLLM allocated one: at the last page, whose state the request goes
   on from);
4. each step, plans a save job for every block that becomes full, prompt or generated,
   chunked prefill included, except pages the store already held; with state-space
   groups, only pages whose boundary state vLLM hands over in that step
   (:meth:`SchedulerSide._with_states`);
5. when a load fails (a block reported by a worker, or a whole asynchronous load), plans
   the pages from there on again, to be saved once vLLM has recomputed them;
6. tells the store which pages vLLM's prefix cache still holds after a request finished,
   and which it let go (:mod:`dss_adapters.vllm.device`: the device tier);
7. counts each finished request in the metrics (:mod:`dss_adapters.vllm.metrics`): its
   result against vLLM's own prefix cache, and the tokens it loaded by the tier planned, net
   of the pages that failed (the workers count those as late misses).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dss_adapters.vllm.device import DeviceResidency
from dss_adapters.vllm.hosts import WorkerHosts
from dss_adapters.vllm.layout import Shards, shard_layouts
from dss_adapters.vllm.meta import NO_BLOCK, DssConnectorMetadata, DssWorkerMetadata, LoadJob, SaveJob, ShardHandshake
from dss_adapters.vllm.metrics import DssConnectorStats
from dss_adapters.vllm.prefill import PrefillSpeed
from dss_adapters.vllm.requests import RequestBook, Tracked
from dss_adapters.vllm.settings import Settings
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

import dss
from dss import ConfigError, UnknownSession

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.dss.scheduler")


@dataclass(slots=True)
class _Plan:
    first_page: int
    page_ids: list[list[bytes]]
    """Per shard, the pages offered."""
    is_async: bool
    tiers: list[str]
    """Per offered page, the tier it is planned to load from: ``host`` (every worker holds it in
    RAM), ``remote`` (the catalog has it on another node only), ``disk``."""


class SchedulerSide:
    """Scheduler-side state of the connector (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        layouts: list[dss.Layout],
        shards: Shards,
        num_groups: int,
        store: dss.Store,
        state_groups: Sequence[int] = (),
        engine_id: str = "vllm",
    ) -> None:
        """``layouts``: the shards' layouts the scheduler can tell itself (pipeline stage 0's);
        with pipeline parallelism the others come from :meth:`take_handshakes`, and nothing is
        loaded before. ``state_groups``: the state-space (Mamba) KV cache groups; ``engine_id``: the
        engine whose memory holds the device tier's pages."""
        self.settings = settings
        self.state_groups = list(state_groups)
        self.layouts = layouts
        self.store = store
        self.page_tokens = layouts[0].page_tokens
        self.num_shards = shards.count
        self.can_load_sync = num_groups == 1
        if settings.load_mode == "sync" and not self.can_load_sync:
            raise ConfigError(
                "load_mode='sync' needs one KV cache group (vLLM takes block-level load failures from "
                "one group only); use 'auto' or 'async'"
            )
        self.num_workers = shards.tp_size * shards.pp_size
        self.book = RequestBook(settings, layouts[0], store)
        self.hosts = WorkerHosts(self.num_shards, int(store.stats()["host"]["capacity"]), layouts[0].page_bytes)
        self.stats = DssConnectorStats()
        self._plans: dict[str, _Plan] = {}
        self._loads: list[LoadJob] = []
        self._step = 0
        self._settled: dict[int, bool] = {}
        self._running: set[str] = set()
        """Requests the last step computed, less those finished since: a synchronous load stalls them."""
        self.device = DeviceResidency(store, engine_id, layouts[0], num_groups)
        self.prefill = PrefillSpeed(settings.recompute_tokens_per_s)
        """The engine's prefill speed (measured, or the setting) the load decision uses."""

    # -- vLLM hooks ------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` whose KV the store will load, and whether the load is
        asynchronous.

        Changes nothing in the store. Returns ``(None, False)`` while the request waits for
        its session's previous saves, ``(0, False)`` on a miss or when dss does not serve
        the request (LoRA, multimodal or embedding inputs; malformed dss parameters).
        """
        tracked = self.book.track(request)
        if tracked is None:
            return 0, False
        tracked.engine_cached_tokens = num_computed_tokens
        if not self.settings.load or len(self.layouts) < self.num_shards:
            return 0, False
        if self.book.must_wait(tracked):
            return None, False
        tracked.asked = True
        results = self._match(tracked, request.all_token_ids[:])
        stored = min(r.matched_tokens for r in results)
        tracked.num_stored_pages = max(tracked.num_stored_pages, stored // self.page_tokens)
        matched = min(stored, (request.num_tokens - 1) // self.page_tokens * self.page_tokens)
        tracked.stored_tokens = matched
        self._plans.pop(request.request_id, None)
        tracked.decision = None
        if matched <= num_computed_tokens:
            return 0, False
        first, end = num_computed_tokens // self.page_tokens, matched // self.page_tokens
        page_ids = [[bytes(p.page_id) for p in r.pages[first:end]] for r in results]
        held = self.hosts.held(page_ids)
        tiers = [
            "host" if is_held else "remote" if ref.tier == "remote" else "disk"
            for is_held, ref in zip(held, results[0].pages[first:end])
        ]
        tracked.decision = self.prefill.decide(results[0], tiers, self.page_tokens)
        if not tracked.decision.load:
            return 0, False
        if self.settings.load_mode == "auto":
            is_async = not self.can_load_sync or (not all(held) and bool(self._running))
        else:
            is_async = self.settings.load_mode == "async"
        self._plans[request.request_id] = _Plan(first, page_ids, is_async, tiers)
        return matched - num_computed_tokens, is_async

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Turn the plan of an admitted request into a load job for ``num_external_tokens`` tokens."""
        tracked = self.book.live.get(request.request_id)
        plan = self._plans.pop(request.request_id, None)
        if tracked is None or plan is None or num_external_tokens <= 0:
            return
        count = num_external_tokens // self.page_tokens
        if count * self.page_tokens != num_external_tokens or count > len(plan.page_ids[0]):
            raise AssertionError(
                f"vLLM granted {num_external_tokens} external tokens; dss offered "
                f"{len(plan.page_ids[0])} pages of {self.page_tokens}"
            )
        first = plan.first_page
        block_ids = [
            [NO_BLOCK if block.is_null else block.block_id for block in group[first : first + count]]
            for group in blocks.blocks
        ]
        # the request goes on from the state after the last page: vLLM must have given it a block
        stateless = any(block_ids[group][-1] == NO_BLOCK for group in self.state_groups)
        if stateless:
            log.error(
                "request %s: vLLM allocated no state block at token %d; its dss load fails and vLLM recomputes",
                request.request_id,
                (first + count) * self.page_tokens,
            )
        tiers = plan.tiers[:count]
        self._loads.append(
            LoadJob(
                request.request_id,
                [ids[:count] for ids in plan.page_ids],
                block_ids,
                plan.is_async,
                fail=stateless,
                tiers=tiers,
            )
        )
        tracked.took_load(first, block_ids[0], tiers, num_external_tokens, self.page_tokens)

    def hit_sources(self, request: Request) -> dict[str, int]:
        """The tokens of the request's last load by tier (for vLLM's cached-token metrics)."""
        tracked = self.book.live.get(request.request_id)
        return {k: v for k, v in tracked.hit_sources.items() if v} if tracked is not None else {}

    def build_meta(self, scheduler_output: SchedulerOutput) -> DssConnectorMetadata:
        """This step's jobs: the pending loads, and a save for every block that becomes full."""
        self._step += 1
        self.device.step()
        self._running = set(scheduler_output.num_scheduled_tokens)
        has_sync_loads = any(not job.is_async for job in self._loads)
        self.prefill.step_started(scheduler_output.total_num_scheduled_tokens, has_sync_loads)
        meta = DssConnectorMetadata(
            loads=self._loads,
            step=self._step,
            settled=self._settled,
            hold_saves=self.num_workers > 1 and has_sync_loads,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._loads, self._settled = [], {}
        if not self.settings.save:
            return meta
        state = scheduler_output.kv_connector_block_state
        if state is None:
            return meta
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self.book.live.get(req_id)
            if tracked is not None:
                job = self._save_job(req_id, tracked, state, num_scheduled - len(spec.get(req_id, ())))
                if job is not None:
                    meta.saves.append(job)
        return meta

    def _save_job(
        self, req_id: str, tracked: Tracked, state: KVConnectorBlockState, num_scheduled: int
    ) -> SaveJob | None:
        """The save of a request's pages that this step makes full (``None``: none), its
        tracking moved past them."""
        request = tracked.request
        # only pages whose tokens are all known (with async scheduling the last sampled
        # token may not be in all_token_ids yet; such a page is saved a step later)
        end = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
        first, full = tracked.num_stored_pages, end // self.page_tokens
        table = state.get_block_ids(req_id) if full > first else None
        if table is None:
            return None
        groups = [list(group[first:full]) for group in table]
        if self.state_groups:
            groups = self._with_states(req_id, state, first, groups)
            full = first + len(groups[0])
            if full == first:
                return None
        tracked.num_stored_pages = full
        # a page is saved whole: start past the last page a sliding-window group no longer keeps
        skip = max((i + 1 for g in groups for i, block in enumerate(g) if block == NULL_BLOCK_ID), default=0)
        if skip >= full - first or any(len(g) != full - first for g in groups):
            return None
        groups = [g[skip:] for g in groups]
        sent, need = tracked.num_sent_tokens, full * self.page_tokens
        tracked.num_sent_tokens = max(sent, need)
        tracked.num_issued += self.num_shards
        return SaveJob(req_id, tracked.save_scope, sent, request.all_token_ids[sent:need], first + skip, groups)

    def _with_states(
        self, req_id: str, state: KVConnectorBlockState, first: int, groups: list[list[int]]
    ) -> list[list[int]]:
        """The pages ``first ..`` of ``groups`` whose state vLLM keeps, each state-space group's
        block replaced by the block vLLM hands over with that boundary's state this step.

        vLLM keeps (``mamba_cache_mode="align"``) the state at the end of each scheduled chunk
        that ends on a block boundary, and offers it to connectors in the step that computes
        it, with its exact block (a request's block table does not tell it: vLLM moves and
        frees state blocks). A page whose state was not kept is not saved, nor any after it
        (they could never be resumed without it): a miss later, never a wrong state.
        """
        kept = {(group, tokens): block for group, block, tokens in state.boundary_state_offloads.get(req_id, ())}
        count = 0
        for k in range(len(groups[0])):
            boundary = (first + k + 1) * self.page_tokens
            found = [kept.get((group, boundary)) for group in self.state_groups]
            blocks = [block for block in found if block is not None]
            if len(blocks) < len(found):
                break
            for group, block in zip(self.state_groups, blocks):
                groups[group][k] = block
            count += 1
        if count < len(groups[0]):
            log.debug(
                "request %s: vLLM kept no state at token %d; its pages from %d on are not saved",
                req_id,
                (first + count + 1) * self.page_tokens,
                first + count,
            )
        return [group[:count] for group in groups]

    def on_worker_output(self, output: KVConnectorOutput) -> None:
        """Count the save jobs the workers finished; plan again what failed to load or was dropped.

        vLLM recomputes a request from its first block that failed to load (or all of it,
        for a failed asynchronous load of a model with several KV cache groups); the pages
        from there on are saved again once recomputed, and are not counted as loaded.
        """
        self.prefill.step_over()
        if output.invalid_block_ids:
            self._on_failed_blocks(output.invalid_block_ids)
        for req_id in getattr(output, "failed_recving", None) or ():
            tracked = self.book.live.get(req_id)
            if tracked is not None:
                self._lose_load(tracked, 0)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, DssWorkerMetadata):
            return
        for step in meta.held:  # this is that step's output: did a load fail in it, on any rank?
            self._settled[step] = bool(output.invalid_block_ids)
        for req_id, first_page in meta.dropped.items():
            tracked = self.book.live.get(req_id)
            if tracked is not None:
                tracked.num_stored_pages = min(tracked.num_stored_pages, first_page)
        self.book.note_saved(meta.saved)
        self.book.note_lossy(meta.lossy)
        self.hosts.note(meta.host_pages)

    def finished(self, request: Request) -> dict[str, Any] | None:
        """Commit a finished request's tokens to its session and count it in the metrics (its
        result, the tokens it loaded by tier); its output ``kv_transfer_params``."""
        self._plans.pop(request.request_id, None)
        self._running.discard(request.request_id)
        tracked = self.book.live.get(request.request_id)
        out = self.book.finish(request)
        if tracked is not None:
            self.device.finished(request, tracked.save_scope)
        if tracked is not None and out is not None and tracked.asked:
            self.stats.count_request(out["dss"]["result"], tracked.loaded_by_tier, out["dss"].get("encodings", {}))
        return out

    def take_stats(self) -> DssConnectorStats | None:
        return self.stats.take()

    def take_handshakes(self, handshakes: Iterable[ShardHandshake]) -> None:
        """Learn every shard's layout from its workers (at start); ``ConfigError`` when a shard is
        missing, its workers disagree, or one differs from the layout the scheduler computed."""
        self.layouts = shard_layouts(handshakes, self.layouts, self.num_shards)

    # -- internals -------------------------------------------------------------------------

    def _match(self, tracked: Tracked, tokens: list[int]) -> list[dss.ResumeResult]:
        """Every shard's match of ``tokens`` (shards past the first look up only what the first matched)."""
        scope = tracked.save_scope
        first = None
        if scope.session_id is not None:
            try:
                first = self.store.resume(scope.session_id, tokens, tenant_id=scope.tenant_id)
            except UnknownSession:
                pass
        if first is None:
            first = self.store.lookup(tokens, layout=self.layouts[0], user_id=scope.user_id, tenant_id=scope.tenant_id)
        near = getattr(first, "near", None)
        if near is not None:  # approximate matching found a near-duplicate (its ids name no user)
            log.info(
                "request %s: reuses %d of %d tokens (%s); nearest stored version %d diverges at token %s "
                "(Jaccard %.2f, %d candidates verified)",
                tracked.request.request_id,
                first.matched_tokens,
                len(tokens),
                first.source,
                near.version_id,
                near.divergence,
                near.jaccard,
                first.num_candidates,
            )
        results = [first]
        prefix = tokens[: first.matched_tokens]
        for layout in self.layouts[1:]:
            results.append(self.store.lookup(prefix, layout=layout, user_id=scope.user_id, tenant_id=scope.tenant_id))
        return results

    def _on_failed_blocks(self, block_ids: set[int]) -> None:
        for tracked in self.book.live.values():
            failed = [i for i, block in enumerate(tracked.loaded_blocks) if block in block_ids]
            if failed:
                self._lose_load(tracked, failed[0])

    def _lose_load(self, tracked: Tracked, first_failed: int) -> None:
        """Pages ``first_failed ..`` of the request's last load did not load."""
        lost = tracked.lose_load(first_failed, self.page_tokens)
        if lost:
            log.warning(
                "request %s: %d dss pages failed to load; vLLM recomputes them", tracked.request.request_id, lost
            )
