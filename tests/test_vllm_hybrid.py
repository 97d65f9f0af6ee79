"""Models with several KV cache groups (vLLM's hybrid KV cache manager) through the dss connector.

* A tiny Llama with alternating full and sliding-window (64 tokens) attention layers: vLLM
  keeps a full-attention group and a sliding-window group, each with its own block table. A
  page holds both groups' blocks of its tokens; loads copy only the sliding-window blocks
  inside the window (vLLM leaves the others unallocated). Outputs equal vLLM's without dss.
* A tiny Granite 4 style hybrid (Mamba-2 and attention layers), which the CPU build runs:
  state-space layers are refused at start with a message naming the feature.

The conversation is the one of ``test_vllm_connector.py`` (:func:`engines.conversation`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import dss
from tests.engines import (
    conversation,
    corrupt_page,
    engine,
    generate,
    make_tiny_hybrid,
    make_tiny_llama,
    prompt,
    run,
    tokens_out,
    turn_two_twice,
    two_turns,
)

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "sliding-llama", sliding_window=64)


@pytest.fixture(scope="module")
def ref(model: Path) -> dict[str, list[int]]:
    with engine(model, prefix_caching=False) as llm:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == ["FullAttentionSpec", "SlidingWindowSpec"]
        return conversation(llm)


def test_sliding_window_layers_are_saved_and_loaded_with_identical_outputs(model: Path, store_path: Path,
                                                                           ref: dict[str, list[int]]) -> None:
    first, out = two_turns(model, store_path, ref, SESSION, {"max_num_batched_tokens": 64})  # chunked: 64 + 36
    assert tokens_out(first) == ref["o1"]
    assert tokens_out(out) == ref["o2"]
    assert out.num_cached_tokens == out.kv_transfer_params["dss"]["loaded_tokens"] == 128
    with dss.open(store_path) as store:
        layout = store.session("chat-1", tenant_id="t").layout
        assert (layout.attention, layout.num_layers) == ("full,sliding:64,full,sliding:64", 4)
        assert layout.page_bytes == 4 * 2 * 32 * 64 * 4
        assert store.resume("chat-1", ref["p2"] + ref["o2"], tenant_id="t").matched_tokens == 160
        assert store.check() == []


def test_a_failed_load_of_a_sliding_window_model_recomputes_the_request(model: Path, store_path: Path,
                                                                        ref: dict[str, list[int]]) -> None:
    """vLLM takes block-level load failures from one KV cache group only: the connector fails
    the whole (asynchronous) load instead, and vLLM starts the request again; asked again,
    dss offers the pages still readable (0-2; page 3 failed its checksum and is gone)."""
    with engine(model, store=store_path) as llm:
        run(llm, ref["p1"], SESSION, max_tokens=40)
    with dss.open(store_path) as store:
        corrupt_page(store_path, store.resume("chat-1", ref["p1"] + ref["o1"], tenant_id="t").pages[3].page_id)
    with engine(model, store=store_path) as llm:
        out, again = turn_two_twice(llm, ref, SESSION)
    assert tokens_out(out) == tokens_out(again) == ref["o2"]
    assert out.kv_transfer_params["dss"]["loaded_tokens"] == 96
    # page 3 was recomputed and saved again, with page 4
    assert again.kv_transfer_params["dss"]["loaded_tokens"] == 160


def test_hybrid_state_space_models_are_refused_at_start_naming_the_feature(tmp_path: Path) -> None:
    hybrid = make_tiny_hybrid(tmp_path / "tiny-hybrid")
    with engine(hybrid, max_model_len=1024, block_size=None) as llm:  # the CPU build runs it without dss
        assert len(tokens_out(generate(llm, [prompt(1, 100)])[0])) == 8
    refused = pytest.raises(dss.ConfigError, match=r"the dss connector does not support hybrid models with "
                                                   r"state-space \(Mamba / linear-attention\) layers")
    with refused, engine(hybrid, store=tmp_path / "store", max_model_len=1024, block_size=None):
        pass
