"""Models with several KV cache groups (vLLM's hybrid KV cache manager) through the dss connector.

* A tiny Llama with alternating full and sliding-window (64 tokens) attention layers: vLLM
  keeps a full-attention group and a sliding-window group, each with its own block table. A
  page holds both groups' blocks of its tokens; loads copy only the sliding-window blocks
  inside the window (vLLM leaves the others unallocated). Outputs equal vLLM's without dss.
* A tiny Granite 4 style hybrid (Mamba-2 layers 0 and 2, attention layers 1 and 3): vLLM
  keeps a state-space group and an attention group, blocks of 128 tokens (vLLM's choice: a
  block's KV as large as a layer's state). A page holds the attention blocks of its tokens
  and each Mamba layer's state after its last token (the state vLLM keeps at that block
  boundary with its prefix caching, ``mamba_cache_mode="align"``). Outputs equal vLLM's
  without dss across engine restarts, for the session's next turn and for a prompt that
  leaves the stored conversation after its first page (the state of that page's end, not
  of a later one, is loaded); with ``tensor_parallel_size=2`` each rank's pages hold its
  share of the states. The model's Mamba layers keep a long memory, and a negative control
  (the same load without the states) changes the output.

The sliding-window conversation is the one of ``test_vllm_connector.py``
(:func:`engines.conversation`). The hybrid runs with ``max_num_batched_tokens`` = one block:
vLLM 0.32's CPU Mamba kernel cannot hand out the state inside a longer prefill chunk (its
own prefix caching fails with an ``IndexError`` in ``mamba_mixer2``, dss or not).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dss_adapters.vllm.loader import LoadOutcome, PageLoader
from dss_adapters.vllm.meta import NO_BLOCK, LoadJob

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


def test_sliding_window_layers_are_saved_and_loaded_with_identical_outputs(
    model: Path, store_path: Path, ref: dict[str, list[int]]
) -> None:
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


def test_a_failed_load_of_a_sliding_window_model_recomputes_the_request(
    model: Path, store_path: Path, ref: dict[str, list[int]]
) -> None:
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


HYBRID = {"max_model_len": 1024, "block_size": None, "max_num_batched_tokens": 128}
"""Engine arguments of the hybrid tests (blocks of 128 tokens: vLLM's choice for this model)."""


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hybrid(tmp_path_factory.mktemp("model") / "tiny-hybrid")


@pytest.fixture(scope="module")
def hybrid_ref(hybrid: Path) -> dict[str, list[int]]:
    """The hybrid's conversation without dss::

    h1  = 200 prompt tokens                       -> ho1: 100 tokens (page 1 ends while decoding)
    h2  = h1 + ho1 + 50 new tokens (350 tokens)   -> ho2: 8 tokens
    h2b = h1 + ho1[:40] + 30 other tokens (270)   -> ho2b: 8 tokens (shares page 0 only)
    """
    out: dict[str, list[int]] = {"h1": prompt(1, 200)}
    with engine(hybrid, **HYBRID) as llm:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert [type(g.kv_cache_spec).__name__ for g in groups] == ["MambaSpec", "FullAttentionSpec"]
        assert groups[0].kv_cache_spec.mamba_cache_mode == "align"
        out["ho1"] = tokens_out(generate(llm, [out["h1"]], max_tokens=100)[0])
        out["h2"] = out["h1"] + out["ho1"] + prompt(2, 50)
        out["h2b"] = out["h1"] + out["ho1"][:40] + prompt(3, 30)
        llm.reset_prefix_cache()
        out["ho2"] = tokens_out(generate(llm, [out["h2"]])[0])
        llm.reset_prefix_cache()
        out["ho2b"] = tokens_out(generate(llm, [out["h2b"]])[0])
    return out


def test_a_hybrid_state_space_model_resumes_from_stored_states_with_identical_outputs(
    hybrid: Path, store_path: Path, hybrid_ref: dict[str, list[int]]
) -> None:
    ref = hybrid_ref
    with engine(hybrid, store=store_path, **HYBRID) as llm:
        first = run(llm, ref["h1"], SESSION, max_tokens=100)
    assert tokens_out(first) == ref["ho1"]
    assert first.kv_transfer_params["dss"] == {
        "session_id": "chat-1",
        "version_id": 1,
        "loaded_tokens": 0,
        "num_tokens": 300,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    with dss.open(store_path) as store:
        layout = store.session("chat-1", tenant_id="t").layout
        assert (layout.page_tokens, layout.num_layers) == (128, 4)
        assert layout.attention == "state:mamba2,full,state:mamba2,full"
        assert layout.state == "mamba2[(3, 160):float32+(4, 32, 16):float32]"
        # two attention blocks (K and V of 2 heads of 32, fp32) and two states (conv 3x160, SSM 4x32x16, fp32)
        assert layout.page_bytes == 2 * (2 * 128 * 2 * 32 * 4) + 2 * (3 * 160 * 4 + 4 * 32 * 16 * 4)
        # page 0 (prompt) and page 1 (its boundary, token 256, was reached while decoding)
        assert store.resume("chat-1", ref["h2"], tenant_id="t").matched_tokens == 256

    with engine(hybrid, store=store_path, **HYBRID) as llm:  # a fresh engine: every page from dss
        second = run(llm, ref["h2"], SESSION)
    assert tokens_out(second) == ref["ho2"]
    assert second.num_cached_tokens == second.kv_transfer_params["dss"]["loaded_tokens"] == 256

    with engine(hybrid, store=store_path, **HYBRID) as llm:  # leaves the conversation inside page 1
        other = run(llm, ref["h2b"], SESSION)
    assert tokens_out(other) == ref["ho2b"]
    assert other.num_cached_tokens == other.kv_transfer_params["dss"]["loaded_tokens"] == 128
    with dss.open(store_path) as store:
        assert store.check() == []


def test_outputs_depend_on_the_loaded_states(
    hybrid: Path, store_path: Path, hybrid_ref: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control of the test above: the same load with the Mamba states left out
    (vLLM's zeroed state blocks, attention blocks loaded) changes the output, so identical
    outputs there show that the states were loaded, and were the right ones."""
    ref = hybrid_ref
    with engine(hybrid, store=store_path, **HYBRID) as llm:
        run(llm, ref["h1"], SESSION, max_tokens=100)
    load = PageLoader._do

    def without_states(loader: PageLoader, job: LoadJob) -> LoadOutcome:
        job.block_ids[0] = [NO_BLOCK] * len(job.block_ids[0])  # group 0: the Mamba layers
        return load(loader, job)

    monkeypatch.setattr(PageLoader, "_do", without_states)
    with engine(hybrid, store=store_path, **HYBRID) as llm:  # in this process: the loader thread is patched
        control = run(llm, ref["h2"], {**SESSION, "commit": False})
    assert control.kv_transfer_params["dss"]["loaded_tokens"] == 256
    assert tokens_out(control) != ref["ho2"]


def test_a_failed_load_of_a_hybrid_model_recomputes_the_request(
    hybrid: Path, store_path: Path, hybrid_ref: dict[str, list[int]]
) -> None:
    """Page 1 of the stored conversation fails its checksum: the whole (asynchronous) load
    fails and vLLM starts the request again; asked again, dss offers page 0 (with its own
    end state); page 1 is recomputed and saved again."""
    ref = hybrid_ref
    with engine(hybrid, store=store_path, **HYBRID) as llm:
        run(llm, ref["h1"], SESSION, max_tokens=100)
    with dss.open(store_path) as store:
        corrupt_page(store_path, store.resume("chat-1", ref["h2"], tenant_id="t").pages[1].page_id)
    with engine(hybrid, store=store_path, **HYBRID) as llm:
        out = run(llm, ref["h2"], SESSION)
        llm.reset_prefix_cache()
        again = run(llm, ref["h2"], {**SESSION, "commit": False})
    assert tokens_out(out) == tokens_out(again) == ref["ho2"]
    assert out.kv_transfer_params["dss"]["loaded_tokens"] == 128
    assert again.kv_transfer_params["dss"]["loaded_tokens"] == 256


def test_a_hybrid_model_without_vllm_prefix_caching_is_refused_naming_the_setting(hybrid: Path, tmp_path: Path) -> None:
    """Without prefix caching vLLM keeps one running state per request (``mamba_cache_mode="none"``),
    never the state at a page boundary."""
    refused = pytest.raises(
        dss.ConfigError,
        match=r"hybrid models with state-space \(Mamba / linear-attention\) "
        r"layers only with vLLM's prefix caching for them "
        r"\(enable_prefix_caching=True, mamba_cache_mode='align'.*"
        r"this engine runs mamba_cache_mode='none'",
    )
    with refused, engine(hybrid, store=tmp_path / "store", prefix_caching=False, **HYBRID):
        pass


@pytest.mark.slow
def test_tensor_parallel_ranks_save_and_load_their_own_states(hybrid: Path, tmp_path: Path) -> None:
    """``tensor_parallel_size=2``: each rank holds one KV head and half of each Mamba layer's
    heads, so its pages (shard 0 in the session, shard 1 in the namespace) hold its own share
    of the states; a fresh engine loads both shards' pages with outputs equal to the same
    parallel engine's without dss."""
    tp2 = {**HYBRID, "tensor_parallel_size": 2}
    h1 = prompt(1, 200)
    with engine(hybrid, **tp2) as llm:
        ho1 = tokens_out(generate(llm, [h1], max_tokens=100)[0])
        h2 = h1 + ho1 + prompt(2, 50)
        llm.reset_prefix_cache()
        ho2 = tokens_out(generate(llm, [h2])[0])
    store_path = tmp_path / "store"
    with engine(hybrid, store=store_path, **tp2) as llm:
        assert tokens_out(run(llm, h1, SESSION, max_tokens=100)) == ho1
    with engine(hybrid, store=store_path, **tp2) as llm:
        second = run(llm, h2, SESSION)
    assert tokens_out(second) == ho2
    assert second.num_cached_tokens == second.kv_transfer_params["dss"]["loaded_tokens"] == 256
    with dss.open(store_path) as store:
        layout = store.session("chat-1", tenant_id="t").layout
        assert (layout.tp_size, layout.tp_shard, layout.attention) == (2, 0, "state:mamba2,full,state:mamba2,full")
        shard1 = dss.Layout.from_dict({**layout.to_dict(), "tp_shard": 1})
        assert store.lookup(h2, layout=shard1, user_id="u", tenant_id="t").matched_tokens == 256
        assert store.check() == []
