"""``DssConnector``: a vLLM V1 KV connector that loads and saves dss pages.

Enable it with::

    LLM(model, ..., kv_transfer_config={
        "kv_connector": "DssConnector",
        "kv_connector_module_path": "dss_adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "/var/lib/dss"},
    })

(or ``vllm serve MODEL --kv-transfer-config '{...}'``), and send each request's session and
namespace in ``SamplingParams(extra_args={"kv_transfer_params": {"dss": {"session_id":
"chat-1", "tenant_id": "acme", "user_id": "u42"}}})``. The options are described in
:mod:`dss_adapters.vllm.settings`, the page format in :mod:`dss_adapters.vllm.layout`, the
metrics in :mod:`dss_adapters.vllm.metrics`.

vLLM builds one scheduler-role instance (:mod:`dss_adapters.vllm.scheduler`) and one
worker-role instance per worker (:mod:`dss_adapters.vllm.worker`: each tensor-parallel rank
and pipeline stage), in different processes unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
Each opens the store folder itself; they share nothing else but the metadata vLLM carries
between them. The connector supports vLLM's hybrid KV cache manager (full-attention,
sliding-window and state-space (Mamba) groups; the latter with vLLM's prefix caching,
``mamba_cache_mode="align"``, which keeps every block boundary's state once the
connector has set ``prefix_cache_retention_interval`` to ``None``); models it cannot serve
are refused at start with a ``dss.ConfigError`` naming the feature.

A finished request's output ``kv_transfer_params`` holds ``{"dss": {"session_id",
"version_id", "num_tokens", "loaded_tokens", "engine_cached_tokens", "result"}}``:
``version_id`` of the version committed; ``loaded_tokens`` the prompt tokens dss loaded (less
pages that turned out gone when read, which vLLM recomputed); ``engine_cached_tokens`` those
vLLM's own prefix cache held; ``result`` ``"hit"``, ``"engine"`` or ``"miss"``
(:func:`dss_adapters.vllm.requests.request_result`, as counted in
``vllm:dss_requests_total``). When some loaded tokens came from copies a tier keeps at a
lower precision (``store_options`` ``{"disk_precision": "int8"}``, say: the pages of vLLM's
CPU backend can be encoded), it also holds ``encodings`` (tokens per encoding) and
``lossy_tokens`` (their sum): approximate KV is always announced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dss_adapters.vllm.layout import (
    Shards,
    attention_spec,
    engine_layouts,
    engine_shards,
    page_layers,
    shard_layout,
    stage_layers,
    state_groups,
)
from dss_adapters.vllm.meta import DssConnectorMetadata, ShardHandshake
from dss_adapters.vllm.metrics import DssConnectorStats, DssPromMetrics
from dss_adapters.vllm.scheduler import SchedulerSide
from dss_adapters.vllm.settings import Settings
from dss_adapters.vllm.worker import WorkerSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

import dss
from dss import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger("vllm.dss.connector")


class DssConnector(KVConnectorBase_V1, SupportsHMA):
    """The dss KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = Settings.from_extra_config(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kv_load_failure_policy is not 'recompute': a dss page that cannot be read fails "
                "its request instead of being recomputed"
            )
        attention_spec(kv_cache_config)
        shards = engine_shards(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._open_scheduler_side(
                vllm_config, kv_cache_config, shards, transfer.engine_id or "vllm"
            )
        else:
            self._worker = self._open_worker_side(vllm_config, kv_cache_config, shards)
        log.info("dss connector (%s) on %s, layout %s", role.name.lower(), self.settings.store, self.layout)

    def _open_scheduler_side(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, shards: Shards, engine_id: str
    ) -> SchedulerSide:
        """The scheduler's part, with the store opened to write and shard 0's layout."""
        _keep_every_state(vllm_config, kv_cache_config)
        layouts = engine_layouts(vllm_config, kv_cache_config, self.settings)
        self.layout = layouts[0]
        self.store = dss.open(self.settings.store, **self.settings.store_options)
        groups = len(kv_cache_config.kv_cache_groups)
        return SchedulerSide(
            self.settings, layouts, shards, groups, self.store, state_groups(kv_cache_config), engine_id=engine_id
        )

    def _open_worker_side(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, shards: Shards) -> WorkerSide:
        """This worker's part, with the store opened to read and its shard's layout."""
        tp_rank, pp_rank = _worker_ranks()
        layers = page_layers(kv_cache_config)
        if stage_layers(vllm_config, kv_cache_config, pp_rank) != layers:
            raise ConfigError(
                f"the attention layers of pipeline stage {pp_rank} are not the ones its index "
                "range names; the dss connector serves this model without pipeline parallelism"
            )
        shard = shards.index(tp_rank, pp_rank)
        self.layout = shard_layout(vllm_config, kv_cache_config, self.settings, shards, shard, layers)
        self.store = dss.open(self.settings.store, **self.settings.reader_options)
        return WorkerSide(
            self.settings,
            self.layout,
            self.store,
            layers,
            kv_cache_config.num_blocks,
            shard=shard,
            is_saver=shards.is_saver(tp_rank),
        )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """On CUDA, loads and saves run layer by layer around each attention layer: those hooks
        must run between CUDA graph pieces, never be skipped by a graph replay."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a save that does not happen is a later miss, never an error."""
        return False

    def shutdown(self) -> None:
        """Finish the worker's loads and writes (or forget what the engine held), then close the store."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.device.close()
        self.store.close()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """The scheduler's block pool: which blocks vLLM's prefix cache holds (the device tier)."""
        if self._scheduler is not None:
            self._scheduler.device.bind(gpu_block_pool)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._worker_side().save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker_side().save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        idle = self.has_connector_metadata() and self._meta().idle
        done, failed = self._worker_side().transfer_results(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, _ = self._worker_side().transfer_results(finished_req_ids)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker_side().take_worker_meta()

    def get_handshake_metadata(self) -> ShardHandshake | None:
        """This worker's shard and layout, for the scheduler at start."""
        worker = self._worker_side()
        return ShardHandshake(worker.shard, self.layout.to_dict())

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        sources = self._scheduler_side().hit_sources(request)
        if sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        for tier, count in sources.items():  # vLLM has no remote-store source: its fallback names one
            source = CacheHitSource.EXTERNAL_UNSPECIFIED if tier == "remote" else CacheHitSource(tier)
            out[source] = out.get(source, 0) + count
        return out

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._scheduler_side().take_handshakes(m for m in metadata.values() if isinstance(m, ShardHandshake))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._scheduler_side().take_handshakes(m for m in metadata.values() if isinstance(m, ShardHandshake))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().on_worker_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler_side().finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler_side().finished(request)

    # -- metrics (both sides) --------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        assert side is not None
        return side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return DssConnectorStats(data=data) if data is not None else DssConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> DssPromMetrics:
        return DssPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- helpers ---------------------------------------------------------------------------

    def _meta(self) -> DssConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DssConnectorMetadata)
        return meta

    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side hook was called on the scheduler-side connector"
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side hook was called on the worker-side connector"
        return self._scheduler


def _keep_every_state(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Make vLLM keep a state-space group's state at every block boundary it computes.

    A page holds the state after its last token, so dss can save a page only where vLLM
    kept that state. vLLM 0.32 keeps, by default (``prefix_cache_retention_interval=0``),
    only the states it expects to reuse itself (the last block boundary of a prompt): the
    scheduler-side connector, built before vLLM's KV cache manager reads the setting, sets
    it to ``None`` (every block boundary) for models with state-space layers, and says so.

    vLLM computes a state only at the end of a scheduled chunk (and, on CUDA, at one
    checkpoint inside a prompt's last chunk): when a step may compute more than one block of
    a prompt, the connector warns that a prompt's pages are saved only up to the first block
    boundary inside a chunk (``max_num_batched_tokens`` of one block saves every page).
    """
    groups = state_groups(kv_cache_config)
    if not groups:
        return
    block = kv_cache_config.kv_cache_groups[groups[0]].kv_cache_spec.block_size
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is not None and not 0 < interval <= block:
        log.warning(
            "dss connector: prefix_cache_retention_interval=%s keeps state-space (Mamba) states at some block "
            "boundaries only; set to None (every boundary), so that every page can be saved",
            interval,
        )
        kv_cache_config.prefix_cache_retention_interval = None
        vllm_config.cache_config.prefix_cache_retention_interval = None
    chunk = vllm_config.scheduler_config.max_num_batched_tokens
    if chunk > block:
        log.warning(
            "dss connector: a step computes up to %d tokens, more than a block (%d); vLLM keeps the "
            "state-space (Mamba) state only where a chunk ends, so dss saves a prompt's pages only up to "
            "the first block boundary inside a chunk (max_num_batched_tokens=%d saves every page)",
            chunk,
            block,
            block,
        )


def _worker_ranks() -> tuple[int, int]:
    """This worker's tensor-parallel rank and pipeline stage."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
