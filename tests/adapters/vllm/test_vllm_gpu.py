"""The dss connector on a CUDA build of vLLM: layer-by-layer loads and saves through pinned
host buffers on streams of their own, and asynchronous loads on the loader's stream.

Run on a machine with a GPU and vLLM's CUDA build (``pip install -e .[vllm]``) with
``pytest -m gpu``; without CUDA every test here is skipped. The copy paths alone (no engine)
are checked on CUDA by the ``cuda`` cases of ``tests/adapters/vllm/test_vllm_worker.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.engines import conversation, engine, make_tiny_llama, run, tokens_out


def _cuda_vllm() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_vllm(), reason="needs a CUDA device and vLLM's CUDA build")]
SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}
GPU = {"gpu_memory_utilization": 0.3}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.mark.parametrize(
    "tensor_parallel_size",
    [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"))],
)
def test_pages_move_through_cuda_streams_with_identical_outputs(
    model: Path, tmp_path: Path, tensor_parallel_size: int
) -> None:
    """Turn 1 saves layer by layer (save stream); turn 2 in the same engine loads those pages
    from the worker's RAM synchronously, layer by layer (load stream, one event per layer);
    a fresh engine loads them from disk asynchronously (loader stream)."""
    from dss_adapters.vllm.metrics import read_metrics

    parallel = {"tensor_parallel_size": tensor_parallel_size}
    with engine(model, prefix_caching=False, **parallel, **GPU) as llm:
        ref = conversation(llm)
    store_path = tmp_path / "store"
    with engine(model, store=store_path, log_stats=True, **parallel, **GPU) as llm:
        first = run(llm, ref["p1"], SESSION, max_tokens=40)
        llm.reset_prefix_cache()
        out = run(llm, ref["p2"], SESSION)  # waits for turn 1's pages to be written
        warm = read_metrics(llm)
    with engine(model, store=store_path, log_stats=True, **parallel, **GPU) as llm:
        again = run(llm, ref["p2"], {**SESSION, "commit": False})
        cold = read_metrics(llm)
    assert tokens_out(first) == ref["o1"]
    assert tokens_out(out) == tokens_out(again) == ref["o2"]
    assert out.kv_transfer_params["dss"]["loaded_tokens"] == 128
    assert again.kv_transfer_params["dss"]["loaded_tokens"] == 160
    assert (cold["loaded_tokens_disk"], cold["failed_pages"]) == (160, 0)
    if tensor_parallel_size == 1:  # one worker: pages in its RAM load synchronously
        assert (warm["loaded_tokens_host"], warm["failed_pages"]) == (128, 0)
