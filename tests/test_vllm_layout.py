"""Parts of the vLLM page layout that need no engine: the model fingerprint, the layer order
and the KV-cache kinds the connector accepts (on vLLM's own config objects).

The layout of a running engine is checked in ``test_vllm_connector.py`` (it is what the
engine's first session is created with).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dss_adapters.vllm_layout import attention_spec, layer_names, model_fingerprint
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

import dss

FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)


def kv_config(*groups: tuple[list[str], KVCacheSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def write_model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 2}')
    (folder / "model.safetensors").write_bytes(b"weights v1")
    (folder / "README.md").write_text("anything")
    return folder


def test_the_fingerprint_follows_config_and_weights_but_not_other_files(tmp_path: Path) -> None:
    folder = write_model(tmp_path / "m")
    first = model_fingerprint(str(folder))
    assert first.startswith("local-") and len(first) == len("local-") + 24
    assert model_fingerprint(str(folder)) == first
    (folder / "README.md").write_text("changed")
    assert model_fingerprint(str(folder)) == first
    (folder / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 128}')  # same config, other order
    assert model_fingerprint(str(folder)) == first
    (folder / "config.json").write_text('{"hidden_size": 128, "num_hidden_layers": 3}')
    second = model_fingerprint(str(folder))
    assert second != first
    stat = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # new weights, same size
    assert model_fingerprint(str(folder)) not in (first, second)


def test_a_model_that_is_not_a_local_folder_is_unpinned(tmp_path: Path) -> None:
    assert model_fingerprint("meta-llama/Llama-3.1-8B-Instruct") == "unpinned"
    assert model_fingerprint(str(tmp_path / "missing")) == "unpinned"


def test_layers_are_in_model_order_by_index_not_as_text() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0, 11)]
    assert layer_names(kv_config((names, FULL))) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10, 11)]


def test_only_one_group_of_full_attention_is_accepted() -> None:
    assert attention_spec(kv_config((["a"], FULL))) is FULL
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    with pytest.raises(dss.ConfigError, match="this model has 1 group\\(s\\) of SlidingWindowSpec"):
        attention_spec(kv_config((["a"], window)))
    with pytest.raises(dss.ConfigError, match="this model has 2 group\\(s\\) of FullAttentionSpec, SlidingWindowSpec"):
        attention_spec(kv_config((["a"], FULL), (["b"], window)))
