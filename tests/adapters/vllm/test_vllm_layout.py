"""Parts of the vLLM page layout that need no engine: the model fingerprint, the layer order,
the KV-cache kinds the connector accepts (on vLLM's own config objects) and the shards.

The layout of a running engine is checked in ``test_vllm_connector.py`` (it is what the
engine's first session is created with).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dss_adapters.vllm.layout import (
    PageLayer,
    Shards,
    attention_spec,
    group_kinds,
    layer_bytes,
    layer_names,
    model_fingerprint,
    page_layers,
    state_groups,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

import dss

FULL = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)


def kv_config(*groups: tuple[list[str], KVCacheSpec]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups]
    )


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


WINDOW = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)


def test_full_attention_and_sliding_window_groups_are_served() -> None:
    assert group_kinds(kv_config((["a"], FULL))) == ["full"]
    assert group_kinds(kv_config((["a", "c"], FULL), (["b", "d"], WINDOW))) == ["full", "sliding:64"]
    assert attention_spec(kv_config((["a"], FULL), (["b"], WINDOW))) is FULL
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    config = kv_config(([names[0], names[2]], FULL), ([names[3], names[1]], WINDOW))
    assert page_layers(config) == [
        PageLayer(names[0], 0),
        PageLayer(names[1], 1),
        PageLayer(names[2], 0),
        PageLayer(names[3], 1),
    ]
    assert page_layers(config, {names[1], names[2]}) == [PageLayer(names[1], 1), PageLayer(names[2], 0)]


STATE = MambaSpec(
    block_size=32,
    shapes=((3, 16), (2, 4, 8)),
    dtypes=(torch.float32, torch.float32),
    page_size_padded=FULL.page_size_bytes,
    mamba_cache_mode="align",
)


def test_state_space_groups_are_served_in_vllm_align_mode_with_their_state_unpadded() -> None:
    config = kv_config((["m0", "m2"], STATE), (["a1", "a3"], FULL))
    assert group_kinds(config) == ["state:mamba2", "full"]
    assert state_groups(config) == [0]
    assert attention_spec(config) is FULL  # the head shapes a layout records
    assert layer_bytes(STATE) == (3 * 16 + 2 * 4 * 8) * 4 < STATE.page_size_bytes == layer_bytes(FULL)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            replace(STATE, mamba_cache_mode="none"),
            (
                "serves hybrid models with state-space (Mamba / linear-attention) layers only with vLLM's prefix caching for "
                "them (enable_prefix_caching=True, mamba_cache_mode='align': vLLM then keeps the state at each block boundary); "
                "this engine runs mamba_cache_mode='none'"
            ),
        ),
        (
            replace(STATE, num_speculative_blocks=1),
            "does not support speculative decoding with state-space (Mamba) layers",
        ),
    ],
)
def test_state_space_groups_without_boundary_states_are_refused(spec: KVCacheSpec, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=re.escape(f"the dss connector {message}")):
        group_kinds(kv_config((["a"], FULL), (["b"], spec)))


@pytest.mark.parametrize(
    ("spec", "feature"),
    [
        (
            ChunkedLocalAttentionSpec(
                block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=128
            ),
            "chunked local attention",
        ),
        (
            CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32),
            "encoder-decoder models (cross or encoder-only attention)",
        ),
    ],
)
def test_other_kv_caches_are_refused_naming_the_model_feature(spec: KVCacheSpec, feature: str) -> None:
    with pytest.raises(dss.ConfigError, match=re.escape(f"the dss connector does not support {feature}")):
        group_kinds(kv_config((["a"], FULL), (["b"], spec)))


def test_groups_with_blocks_of_another_size_are_refused() -> None:
    other = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    with pytest.raises(dss.ConfigError, match="KV blocks of one size and token count in every KV cache group"):
        attention_spec(kv_config((["a"], FULL), (["b"], other)))


def test_shards_of_tensor_parallel_ranks_and_pipeline_stages() -> None:
    """TP 4 with KV replicated on pairs of ranks (2 shards per stage), 2 stages: ranks 0-1 hold
    shard 0, ranks 2-3 shard 1; stage 1's shards are 2 and 3; the first rank of a pair writes."""
    shards = Shards(tp_size=4, tp_shards=2, pp_size=2)
    assert shards.count == 4
    assert [shards.index(rank, 0) for rank in range(4)] == [0, 0, 1, 1]
    assert [shards.index(rank, 1) for rank in range(4)] == [2, 2, 3, 3]
    assert [shards.is_saver(rank) for rank in range(4)] == [True, False, True, False]
