"""The worker side of the dss connector: copies pages between the store and vLLM's KV blocks.

It runs in each process that owns a KV cache (one per tensor-parallel rank and pipeline
stage) and handles its own shard (:mod:`dss_adapters.vllm.layout`): a page is block ``b``
of every attention layer this worker holds, in layer order, as raw bytes:
``page[l*L:(l+1)*L] == bytes(kv[layer_l][b_group(l)])`` with ``L`` the bytes of one block of
one layer (the block dimension is found in each layer's tensor, so any backend packing is
copied as is).

* :meth:`WorkerSide.start_load` reads the pages of the step's synchronous load jobs in one
  batched ``read_pages`` and copies them into their blocks before the forward: from disk
  into one reused buffer of page rows, then one copy per layer for all the pages; from this
  process's host tier straight from its bytes (on CUDA, layer by layer on a stream of their
  own, :mod:`dss_adapters.vllm.cuda`); asynchronous
  jobs go to the :class:`PageLoader` thread, which reads through a child process
  (:mod:`dss_adapters.vllm.reader`), and are reported done by
  :meth:`WorkerSide.transfer_results`. A page the store cannot return (gone, or corrupt
  and quarantined) is reported — by block (:meth:`WorkerSide.take_load_errors`), or, for a
  model with several KV cache groups, as a failed asynchronous load — and vLLM recomputes;
  it counts as a late miss of the tier it was planned to load from (``LoadJob.tiers``). A
  page a tier keeps at a lower precision (``disk_precision`` in ``store_options``: pages of
  vLLM's CPU backend are encodable) is dequantized into the KV dtype on its way into its
  blocks, and reported to the scheduler (``DssWorkerMetadata.lossy``); such loads are not
  staged (an encoded copy is smaller than a staging row).
* :meth:`WorkerSide.save` (after the forward) copies every block a save job names out of
  the KV cache and hands it to the :class:`PageWriter`, which writes in the background. Of
  ranks that hold identical KV (one shard), only the first writes. Shard 0 writes into the
  request's session; other shards write into the request's namespace with their own
  layout (a session has one layout).
"""

from __future__ import annotations

import array
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from dss_adapters.vllm.copy import BlockCopier, RowBuffer
from dss_adapters.vllm.cuda import LayerwiseCopier
from dss_adapters.vllm.layout import PageLayer
from dss_adapters.vllm.loader import LoadOutcome, PageLoader, load_pages
from dss_adapters.vllm.meta import DssConnectorMetadata, DssWorkerMetadata, LoadJob, SaveJob
from dss_adapters.vllm.metrics import DssConnectorStats
from dss_adapters.vllm.reader import PageReader
from dss_adapters.vllm.settings import Scope, Settings
from dss_adapters.vllm.writer import PageWriter, WriteJob

import dss
from dss import ConfigError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("vllm.dss.worker")

IDLE_WAIT_S = 0.02
"""How long a step that computes nothing waits for an asynchronous load to finish."""


class WorkerSide:
    """Worker-side state of the connector (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        layout: dss.Layout,
        store: dss.Store,
        layers: list[PageLayer],
        num_blocks: int,
        *,
        shard: int = 0,
        is_saver: bool = True,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.store = store
        self.layers = layers
        self.num_blocks = num_blocks
        self.shard = shard
        self.is_saver = is_saver
        self.num_groups = 1 + max(layer.group for layer in layers)
        self.page_tokens = layout.page_tokens
        self.num_pages_loaded = 0
        self.copier: BlockCopier | None = None
        self.staging: RowBuffer | None = None
        """The rows synchronous loads read their pages into (made by :meth:`register`)."""
        self.layerwise: LayerwiseCopier | None = None
        self.loader: PageLoader | None = None
        self.stats = DssConnectorStats()
        stats = store.stats()
        self._report_pages = stats["host"]["capacity"] > 0
        self._lossy_tiers = any(stats[tier]["precision"] != "exact" for tier in ("host", "disk"))
        """Some tier keeps lower-precision copies: a load may meet encoded pages (smaller than a page)."""
        self._lossy: dict[str, dict[str, int]] = {}
        self._last_pending = 0
        self._host_pages: list[bytes] = []
        self._tokens: dict[str, array.array] = {}
        self._load_errors: set[int] = set()
        self._step_failed = False
        self._dropped: dict[str, int] = {}
        self._dropped_jobs: dict[str, int] = {}
        self._held: dict[int, list[WriteJob]] = {}
        self._held_steps: list[int] = []
        self.writer = PageWriter(store, layout, settings.max_pending_bytes, report_pages=self._report_pages)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the KV tensors (one per layer); ``ConfigError`` if they do not add up to a page."""
        missing = [layer.name for layer in self.layers if layer.name not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing}")
        tensors = []
        for layer in self.layers:
            tensor = kv_caches[layer.name]
            dims = [d for d, size in enumerate(tensor.shape) if size == self.num_blocks]
            if not dims:
                raise ConfigError(
                    f"KV cache of {layer.name} has no dimension of {self.num_blocks} blocks: {tensor.shape}"
                )
            tensors.append(tensor.movedim(dims[0], 0))
        self.copier = BlockCopier(
            tensors, [layer.group for layer in self.layers], self.num_blocks, self.layout.page_bytes, self.layout
        )
        if self.copier.device.type == "cuda" and self.copier.uniform:  # state-space layers: whole pages
            self.layerwise = LayerwiseCopier(self.copier, [layer.name for layer in self.layers])
        log.info(
            "dss copies %s into this worker's KV cache",
            "whole pages" if self.copier.stacked is not None else "pages a layer at a time",
        )
        self.staging = RowBuffer(self.layout.page_bytes)
        self.loader = PageLoader(PageReader(self.settings.store, self.settings.reader_options), self.copier, self.shard)

    # -- loads -----------------------------------------------------------------------------

    def start_load(self, meta: DssConnectorMetadata) -> None:
        """Start this step's load jobs (see the module docstring)."""
        loader, copier = self.loader, self.copier
        assert loader is not None and copier is not None, "register_kv_caches was not called"
        sync: list[LoadJob] = []
        for job in meta.loads:
            if job.is_async:
                loader.put(job)
            else:
                sync.append(job)
        if not sync:
            return
        assert self.num_groups == 1, "synchronous loads need one KV cache group"
        page_ids = [p for job in sync for p in job.page_ids[self.shard]]
        block_ids = [[b for job in sync for b in job.block_ids[0]]]
        tiers = [tier for job in sync for tier in _tiers(job)]
        if self.layerwise is not None:
            outcome = self.layerwise.load(self.store, page_ids, block_ids)
        else:
            # pages from this process's RAM are copied straight from it (staging them costs a copy);
            # pages read from disk are decrypted into the staging rows, then copied a layer at a time,
            # unless they may be encoded copies (smaller than the rows), dequantized page by page
            unstaged = all(tier == "host" for tier in tiers) or (self._lossy_tiers and copier.decodes is not None)
            staging = None if unstaged else self.staging
            outcome = load_pages(self.store, copier, page_ids, block_ids, ",".join(job.req_id for job in sync), staging)
        first = 0
        for job in sync:
            count = len(job.page_ids[self.shard])
            self._note_lossy(job.req_id, [e for k, e in outcome.lossy_pages.items() if first <= k < first + count])
            first += count
        failed = {block_ids[0][k] for k in outcome.failed_pages}
        self._load_errors |= failed
        self._step_failed = bool(failed)
        self._note_load(outcome, tiers, in_host=True)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block the forward (on CUDA: its stream) until the layer's pages of this step are in."""
        if self.layerwise is not None:
            self.layerwise.wait_layer(layer_name)

    def transfer_results(self, finished_req_ids: set[str], *, idle: bool = False) -> tuple[set[str], set[str]]:
        """(asynchronous loads done, those of them that failed as a whole); forgets the token ids
        of finished requests (their queued save jobs hold their own copy). The failed pages of a
        load of a one-group model are reported by block instead (:meth:`take_load_errors`).

        In a step that computes nothing (``idle``) it first waits up to :data:`IDLE_WAIT_S` for a
        load to finish: the engine has nothing else to do, and would otherwise spin through
        empty steps, taking the CPU the load needs."""
        for req_id in finished_req_ids:
            self._tokens.pop(req_id, None)
        assert self.loader is not None
        if idle:
            self.loader.wait_done(IDLE_WAIT_S)
        done, failed = set(), set()
        for job, outcome in self.loader.take_done():
            done.add(job.req_id)
            if outcome.failed_pages:
                if self.num_groups == 1:
                    self._load_errors |= {job.block_ids[0][k] for k in outcome.failed_pages}
                else:
                    failed.add(job.req_id)
            self._note_load(outcome, None if job.fail else _tiers(job), in_host=False)
            self._note_lossy(job.req_id, list(outcome.lossy_pages.values()))
        return done, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves -----------------------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: DssConnectorMetadata) -> None:
        """After a layer's forward: start copying its blocks of this step's saves out (CUDA only)."""
        if self.layerwise is not None and self.is_saver and meta.saves and not self._step_failed:
            self.layerwise.save_layer(layer_name, [job.block_ids for job in meta.saves])

    def save(self, meta: DssConnectorMetadata) -> None:
        """Copy the blocks of this step's save jobs out of the KV cache and queue them for writing.

        If a synchronous load of this step failed, no block of this step is saved: the
        forward may have read the block that was not loaded (vLLM shares blocks between
        requests of a step, and tensor-parallel ranks share every layer's output), so the KV
        it wrote may be wrong. The jobs are reported as dropped instead. With several
        workers another rank's load may have failed: the copies of such a step are held
        (``meta.hold_saves``) until a later step's ``meta.settled`` says to write or drop
        them; copies still held when the worker closes are dropped.
        """
        self.writer.raise_if_failed()
        step_failed, self._step_failed = self._step_failed, False
        self._settle_held(meta.settled)
        if not self.is_saver or not meta.saves:
            return
        assert self.copier is not None, "register_kv_caches was not called"
        started = time.perf_counter()
        rows = (
            self.layerwise.finish_saves([job.block_ids for job in meta.saves])
            if self.layerwise is not None and not step_failed
            else None
        )
        offset = 0
        for job in meta.saves:
            tokens = self._tokens.setdefault(job.req_id, array.array("I"))
            if len(tokens) != job.num_known:
                raise AssertionError(
                    f"request {job.req_id}: worker holds {len(tokens)} tokens, scheduler assumed {job.num_known}"
                )
            tokens.extend(job.new_tokens)
            count = len(job.block_ids[0])
            if step_failed:
                self._drop(job.req_id, job.first_page)
                continue
            payload: np.ndarray = (
                rows[offset : offset + count] if rows is not None else self.copier.gather(job.block_ids)
            )
            offset += count
            end = (job.first_page + count) * self.page_tokens
            write = WriteJob(job.req_id, self._scope(job), tokens[:end], job.first_page, payload, started)
            if meta.hold_saves:
                self._held.setdefault(meta.step, []).append(write)
            else:
                self.writer.put(write)
        if meta.step in self._held:
            self._held_steps.append(meta.step)

    def _settle_held(self, settled: Mapping[int, bool]) -> None:
        """Write the held copies of the steps the scheduler settled, or drop them when a load of
        their step failed (``settled``: step -> failed)."""
        for step, failed in settled.items():
            for job in self._held.pop(step, []):
                if failed:
                    self._drop(job.req_id, job.first_page)
                else:
                    self.writer.put(job)

    def _drop(self, req_id: str, first_page: int) -> None:
        """A save job is not written (its blocks may hold KV computed from a page that failed to load)."""
        self._dropped[req_id] = min(first_page, self._dropped.get(req_id, first_page))
        self._dropped_jobs[req_id] = self._dropped_jobs.get(req_id, 0) + 1

    # -- reports ---------------------------------------------------------------------------

    def take_worker_meta(self) -> DssWorkerMetadata | None:
        """What finished since the last step (see :class:`DssWorkerMetadata`); ``None`` if nothing."""
        done = self.writer.take_done()
        saved = done.saved
        for req_id, count in self._dropped_jobs.items():
            saved[req_id] = saved.get(req_id, 0) + count
        dropped, self._dropped, self._dropped_jobs = self._dropped, {}, {}
        host = self._host_pages + done.page_ids
        self._host_pages = []
        self.stats.count("saved_pages", done.num_pages)
        self.stats.count("failed_saves", done.num_failed)
        for seconds in done.seconds:
            self.stats.observe("save", seconds)
        held, self._held_steps = self._held_steps, []
        lossy, self._lossy = self._lossy, {}
        if not (saved or dropped or host or held or lossy):
            return None
        return DssWorkerMetadata(saved, dropped, {self.shard: host} if host else {}, held, lossy)

    def take_stats(self) -> DssConnectorStats | None:
        if self.is_saver:
            pending = self.writer.pending_bytes
            if pending != self._last_pending:
                self.stats.set_pending(f"shard{self.shard}", pending)
                self._last_pending = pending
        return self.stats.take()

    def close(self) -> None:
        """Finish the queued loads and writes, then stop the threads."""
        if self.loader is not None:
            self.loader.close()
        self.writer.close()

    # -- internals -------------------------------------------------------------------------

    def _note_load(self, outcome: LoadOutcome, tiers: list[str] | None, *, in_host: bool) -> None:
        """Count a load. ``tiers``: the tier each page of it was planned to load from, so that a
        page the store did not return counts as a late miss there (``None``: the scheduler failed
        the job, nothing was read); ``in_host``: its pages are in this process's host tier now (a
        synchronous load read them through this worker's store; asynchronous loads read in the
        reader process)."""
        self.num_pages_loaded += len(outcome.loaded_page_ids)
        self.stats.observe("load", outcome.seconds)
        self.stats.count("failed_pages", len(outcome.failed_pages))
        if tiers is not None:
            for k in outcome.failed_pages:
                self.stats.count(f"late_miss_pages_{tiers[k]}")
        if self._report_pages and in_host:
            self._host_pages.extend(outcome.loaded_page_ids)

    def _note_lossy(self, req_id: str, encodings: list[str]) -> None:
        """Pages of a request were loaded from lower-precision copies (their encodings): reported
        to the scheduler in tokens per encoding (:class:`DssWorkerMetadata`)."""
        if encodings:
            mine = self._lossy.setdefault(req_id, {})
            for encoding in encodings:
                mine[encoding] = mine.get(encoding, 0) + self.page_tokens

    def _scope(self, job: SaveJob) -> Scope:
        """Where this shard saves a job's pages: the job's scope for shard 0, its namespace for others."""
        scope = job.scope
        return scope if self.shard == 0 or scope.session_id is None else Scope(scope.tenant_id, scope.user_id, None)


def _tiers(job: LoadJob) -> list[str]:
    """The tier each page of a job was planned to load from (``disk`` for a job that names none)."""
    return job.tiers or ["disk"] * len(job.page_ids[0])
