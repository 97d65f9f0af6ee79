"""``DssConnector``: a vLLM V1 KV connector that loads and saves dss pages.

Enable it with::

    LLM(model, ..., kv_transfer_config={
        "kv_connector": "DssConnector",
        "kv_connector_module_path": "dss_adapters.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "/var/lib/dss"},
    })

(or ``vllm serve MODEL --kv-transfer-config '{...}'``), and send each request's session and
namespace in ``SamplingParams(extra_args={"kv_transfer_params": {"dss": {"session_id":
"chat-1", "tenant_id": "acme", "user_id": "u42"}}})``. The options are described in
:mod:`dss_adapters.vllm_settings`, the page format in :mod:`dss_adapters.vllm_layout`.

vLLM builds two instances: the scheduler role (:mod:`dss_adapters.vllm_scheduler`) and the
worker role (:mod:`dss_adapters.vllm_worker`), in different processes unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. Each opens the store folder itself; they share
nothing else but the metadata vLLM carries between them.

Loads are synchronous (the pages are in the blocks before the step's forward); saves are
copied out of the KV cache after the forward and written by a background thread. A
finished request's output ``kv_transfer_params`` holds ``{"dss": {"session_id",
"version_id", "num_tokens", "loaded_tokens"}}`` (``version_id`` of the version committed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dss_adapters.vllm_layout import engine_layout
from dss_adapters.vllm_meta import DssConnectorMetadata
from dss_adapters.vllm_scheduler import SchedulerSide
from dss_adapters.vllm_settings import Settings
from dss_adapters.vllm_worker import WorkerSide
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

import dss

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger("vllm.dss.connector")


class DssConnector(KVConnectorBase_V1):
    """The dss KV connector (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = Settings.from_extra_config(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a dss page that cannot be read fails "
                        "its request instead of being recomputed")
        self.layout = engine_layout(vllm_config, kv_cache_config, self.settings)
        self.store = dss.open(self.settings.store, **self.settings.store_options)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.settings, self.layout, self.store)
        else:
            self._worker = WorkerSide(self.settings, self.layout, self.store, kv_cache_config)
        log.info("dss connector (%s) on %s, layout %s", role.name.lower(), self.settings.store, self.layout)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a save that does not happen is a later miss, never an error."""
        return False

    def shutdown(self) -> None:
        """Write what the worker still holds, then close the store."""
        if self._worker is not None:
            self._worker.close()
        self.store.close()

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loads every layer before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: :meth:`wait_for_save` copies whole blocks of every layer."""

    def wait_for_save(self) -> None:
        self._worker_side().save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._worker_side().forget(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker_side().take_worker_meta()

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().on_worker_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler_side().finished(request)

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
