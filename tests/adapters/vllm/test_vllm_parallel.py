"""The dss connector with tensor and pipeline parallelism on the vLLM CPU build.

Every engine is a real ``vllm.LLM`` on the tiny Llama of :mod:`engines` (4 attention heads and
2 KV heads, so each of 2 tensor-parallel ranks holds one KV head), in vLLM's multi-process
mode with one worker process per rank (the machine's two cores), in float32: outputs are
compared token for token with the same parallel engine without dss. Not SmolLM2: its 9
attention heads cannot be split over 2 ranks, and vLLM refuses to start ("Total number of
attention heads (9) must be divisible by tensor parallel size (2)"); 3 ranks would fit its 3
KV heads, but not two cores.

Each rank saves and loads its own shard: shard 0's pages live in the session, shard 1's in
the namespace under a layout that differs in ``tp_shard`` only. The scheduler offers a page
only when every shard has it; a shard that fails to load on one rank makes vLLM recompute.
Pipeline stages are shards too (``pp_rank``), each with its own layers.

The conversation (block = page = 32 tokens)::

    p1 = 100 prompt tokens                     -> o1: 40 tokens  (KV of 139 tokens: pages 0-3)
    p2 = p1 + o1 + 30 new tokens (170 tokens)  -> o2: 8 tokens   (pages 0-3 = 128 tokens reused)
    q  = 70 tokens, no session, saved by a TP=1 engine           (never loaded by TP=2)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from dss_adapters.vllm.metrics import read_metrics

import dss
from tests.engines import (
    conversation,
    corrupt_page,
    engine,
    generate,
    make_tiny_llama,
    run,
    tokens_out,
    turn_two_twice,
    two_turns,
)

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}
TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def ref(model: Path) -> dict[str, list[int]]:
    """Prompts and their greedy outputs from the TP=2 engine without dss (nor its prefix cache)."""
    with engine(model, prefix_caching=False, **TP2) as llm:
        return conversation(llm)


@pytest.fixture(scope="module")
def first_turn(model: Path, ref: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store where a TP=1 engine saved q (no session) and a TP=2 engine ran turn 1 of chat-1."""
    store_path = tmp_path_factory.mktemp("first-turn") / "store"
    with engine(model, store=store_path) as llm:
        generate(llm, [ref["q"]])
    with engine(model, store=store_path, **TP2) as llm:
        out = run(llm, ref["p1"], SESSION, max_tokens=40)
    assert tokens_out(out) == ref["o1"]
    assert out.kv_transfer_params == {
        "dss": {
            "session_id": "chat-1",
            "version_id": 1,
            "num_tokens": 140,
            "loaded_tokens": 0,
            "engine_cached_tokens": 0,
            "result": "miss",
        }
    }
    return store_path


@pytest.fixture
def store_path(first_turn: Path, tmp_path: Path) -> Path:
    """The test's own copy of the first-turn store."""
    return Path(shutil.copytree(first_turn, tmp_path / "store"))


@pytest.fixture
def store(store_path: Path) -> Any:
    with dss.open(store_path) as handle:
        yield handle


def shard_layouts(store: dss.Store) -> tuple[dss.Layout, dss.Layout]:
    layout = store.session("chat-1", tenant_id="t").layout
    return layout, dss.Layout.from_dict({**layout.to_dict(), "tp_shard": 1})


def test_each_rank_saves_and_loads_its_own_shard_and_only_pages_every_shard_has_are_offered(
    model: Path, store_path: Path, store: dss.Store, ref: dict[str, list[int]]
) -> None:
    shard0, shard1 = shard_layouts(store)
    assert (shard0.tp_size, shard0.tp_shard, shard0.num_kv_heads, shard0.pp_size) == (2, 0, 1, 1)
    turn1 = ref["p1"] + ref["o1"]
    saved0 = store.resume("chat-1", turn1, tenant_id="t")
    saved1 = store.lookup(turn1, layout=shard1, user_id="u", tenant_id="t")
    assert saved0.matched_tokens == saved1.matched_tokens == 128
    pages0, pages1 = store.read_pages(saved0.pages), store.read_pages(saved1.pages)
    assert all(len(a) == len(b) == shard0.page_bytes and a != b for a, b in zip(pages0, pages1))
    # shard 0 alone gets page 4 of turn 2, all zeros: loading it would change the output
    store.save_pages("chat-1", ref["p2"][:160], {4: bytes(shard0.page_bytes)}, tenant_id="t")
    assert store.resume("chat-1", ref["p2"], tenant_id="t").matched_tokens == 160
    with engine(model, store=store_path, **TP2) as llm:
        out = run(llm, ref["p2"], {**SESSION, "label": "turn 2"})
        other = run(llm, ref["q"], None)
    assert tokens_out(out) == ref["o2"]
    assert out.num_cached_tokens == 128
    assert out.kv_transfer_params == {
        "dss": {
            "session_id": "chat-1",
            "version_id": 2,
            "num_tokens": 178,
            "loaded_tokens": 128,
            "engine_cached_tokens": 0,
            "result": "hit",
        }
    }
    # q's pages were saved by a TP=1 engine: another layout, never loaded by this one
    assert tokens_out(other) == ref["oq"]
    assert other.num_cached_tokens == other.kv_transfer_params["dss"]["loaded_tokens"] == 0
    assert store.check() == []


def test_a_shard_that_fails_to_load_on_one_rank_is_recomputed(
    model: Path, store_path: Path, store: dss.Store, ref: dict[str, list[int]]
) -> None:
    _, shard1 = shard_layouts(store)
    turn1 = ref["p1"] + ref["o1"]
    corrupt_page(store_path, store.lookup(turn1, layout=shard1, user_id="u", tenant_id="t").pages[3].page_id)
    with engine(model, store=store_path, **TP2) as llm:
        out, again = turn_two_twice(llm, ref, SESSION)
    assert tokens_out(out) == tokens_out(again) == ref["o2"]
    # rank 1's page 3 failed its checksum: vLLM recomputed from block 3 on both ranks
    assert out.kv_transfer_params["dss"]["loaded_tokens"] == 96
    # page 3 was saved again by both ranks once recomputed (and page 4 with it)
    assert again.kv_transfer_params["dss"]["loaded_tokens"] == 160
    assert store.lookup(ref["p2"], layout=shard1, user_id="u", tenant_id="t").matched_tokens == 160
    assert store.check() == []


def test_ranks_load_their_ram_synchronously_and_hold_that_steps_saves_until_every_rank_loaded(
    model: Path, tmp_path: Path, ref: dict[str, list[int]]
) -> None:
    """Turn 1 is saved by the ranks of this engine (so its pages are in their RAM); turn 2 loads
    them synchronously. Page 4 is computed in the step with that load: the ranks hold its
    copies until the scheduler has seen the step's outcome on both, then write them."""
    store_path = tmp_path / "store"
    # a generous session_wait_s: on two cores each rank's writer thread shares its core with the
    # rank's busy loop (turn 1's last save once took longer than the default 5 s to report)
    with engine(model, store=store_path, log_stats=True, session_wait_s=60, **TP2) as llm:
        first = run(llm, ref["p1"], SESSION, max_tokens=40)
        assert llm.reset_prefix_cache()
        out = run(llm, ref["p2"], SESSION)  # waits for turn 1's pages to be written on both ranks
        metrics = read_metrics(llm)
    assert tokens_out(first) == ref["o1"]
    assert tokens_out(out) == ref["o2"]
    assert out.kv_transfer_params["dss"]["loaded_tokens"] == 128
    assert (metrics["loaded_tokens_host"], metrics["loaded_tokens_disk"], metrics["failed_pages"]) == (128, 0, 0)
    with dss.open(store_path) as store:
        _, shard1 = shard_layouts(store)
        history = ref["p2"] + ref["o2"]
        assert store.resume("chat-1", history, tenant_id="t").matched_tokens == 160
        assert store.lookup(history, layout=shard1, user_id="u", tenant_id="t").matched_tokens == 160


@pytest.mark.slow
def test_pipeline_stages_save_and_load_their_own_layers(model: Path, tmp_path: Path) -> None:
    """Two pipeline stages, one layer each: every stage saves its layer's KV under its own layout
    (``pp_rank`` 0 and 1), the scheduler learns stage 1's layout from its worker at start, and
    the next turn loads both stages' pages. (Compiled: the CPU build's eager mode cannot run
    pipeline parallelism, see :func:`engines.engine`.)"""
    pp2 = {"pipeline_parallel_size": 2}
    with engine(model, prefix_caching=False, **pp2) as llm:
        want = conversation(llm)
    store_path = tmp_path / "store"
    first, out = two_turns(model, store_path, want, SESSION, **pp2)
    assert tokens_out(first) == want["o1"]
    assert tokens_out(out) == want["o2"]
    assert out.num_cached_tokens == out.kv_transfer_params["dss"]["loaded_tokens"] == 128
    with dss.open(store_path) as store:
        stage0 = store.session("chat-1", tenant_id="t").layout
        stage1 = dss.Layout.from_dict({**stage0.to_dict(), "pp_rank": 1})
        assert (stage0.pp_size, stage0.num_layers, stage0.tp_size) == (2, 1, 1)
        history = want["p2"] + want["o2"]
        assert store.resume("chat-1", history, tenant_id="t").matched_tokens == 160
        assert store.lookup(history, layout=stage1, user_id="u", tenant_id="t").matched_tokens == 160
        assert store.check() == []
