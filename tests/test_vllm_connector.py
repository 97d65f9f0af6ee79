"""The dss connector in the real vLLM CPU engine: pages saved by one engine are loaded by a
fresh one, and greedy outputs stay exactly those of vLLM without dss.

Every engine is a real ``vllm.LLM`` on a tiny random Llama (:mod:`engines`), single-process
unless a test says otherwise. ``num_cached_tokens`` is vLLM's count of prompt tokens it did
not compute (its own prefix cache plus what the connector loaded); the connector's own count
is ``kv_transfer_params["dss"]["loaded_tokens"]``.

The conversation used throughout (block = page = 32 tokens)::

    p1  = 100 prompt tokens                      -> o1: 40 tokens   (turn 1: 140 tokens, KV of 139: pages 0-3)
    p2  = p1 + o1 + 30 new tokens  (170 tokens)  -> o2: 8 tokens    (turn 2 reuses pages 0-3 = 128 tokens)
    p2b = p1 + o1 + 25 other tokens (165 tokens) -> o2b: 8 tokens   (a regenerated turn 2)
    q   = 70 tokens, no session                  -> oq: 8 tokens    (pages 0-1 = 64 tokens)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import dss
from tests.engines import conversation, corrupt_page, engine, generate, make_tiny_llama, run, tokens_out

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def ref(model: Path) -> dict[str, list[int]]:
    """Prompts and their greedy outputs from vLLM without dss (and without its prefix cache)."""
    with engine(model, prefix_caching=False) as llm:
        return conversation(llm)


@pytest.fixture
def store(sqlite_store: dss.Store) -> dss.Store:
    """The test's own handle on the store (SQLite: the engines open the same folder)."""
    return sqlite_store


def dss_params(output: Any) -> dict[str, Any]:
    return output.kv_transfer_params["dss"]


def first_turn(model: Path, store_path: Path, ref: dict[str, list[int]], **options: Any) -> None:
    with engine(model, store=store_path, **options) as llm:
        out = run(llm, ref["p1"], SESSION, max_tokens=40)
    assert tokens_out(out) == ref["o1"]
    assert out.num_cached_tokens == 0
    assert dss_params(out) == {"session_id": "chat-1", "version_id": 1, "num_tokens": 140, "loaded_tokens": 0,
                               "engine_cached_tokens": 0, "result": "miss"}


def test_next_turn_on_a_fresh_engine_loads_the_first_turns_pages(model: Path, store_path: Path, store: dss.Store,
                                                                ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref, max_num_batched_tokens=64)  # chunked prefill: 64 + 36 tokens
    with engine(model, store=store_path) as llm:
        out = run(llm, ref["p2"], {**SESSION, "label": "turn 2"})
    assert tokens_out(out) == ref["o2"]
    assert out.num_cached_tokens == 128
    assert dss_params(out) == {"session_id": "chat-1", "version_id": 2, "num_tokens": 178, "loaded_tokens": 128,
                               "engine_cached_tokens": 0, "result": "hit"}
    versions = store.versions("chat-1", tenant_id="t")
    assert [(v.version_id, v.parent_id, v.num_tokens, v.is_head, v.label) for v in versions] == [
        (1, None, 140, False, None), (2, 1, 178, True, "turn 2")]
    history = ref["p2"] + ref["o2"]
    assert store.tokens("chat-1", tenant_id="t") == history
    # turn 2 saved page 4 (tokens 128-159; 177 tokens have KV, so page 5 is not full)
    assert store.resume("chat-1", history, tenant_id="t").matched_tokens == 160
    assert store.check() == []
    layout = store.session("chat-1", tenant_id="t").layout
    fields = layout.to_dict()
    assert fields.pop("backend").startswith("cpu:")  # the CPU attention ISA: vec, amx, neon, ...
    assert fields.pop("revision").startswith("local-")  # fingerprint of the model folder
    assert fields == {"name": "vllm", "page_tokens": 32, "page_bytes": 2 * 2 * 32 * 64 * 4, "model": str(model),
                      "dtype": "float32", "kv_dtype": "float32", "kv_cache_dtype": "auto", "num_layers": 2,
                      "num_kv_heads": 2, "head_size": 32, "head_size_v": 32, "platform": "cpu", "vllm": "0.32.0",
                      "attention": "full", "tp_size": 1, "tp_shard": 0, "pp_size": 1, "pp_rank": 0}


def test_another_namespace_gets_no_hit_and_the_same_outputs(model: Path, store_path: Path, store: dss.Store,
                                                            ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    with engine(model, store=store_path) as llm:
        intruder = run(llm, ref["p2"], {**SESSION, "user_id": "v"})  # names u's session from v's namespace
        llm.reset_prefix_cache()
        other_tenant = run(llm, ref["p2"], {**SESSION, "tenant_id": "t2"})
    assert tokens_out(intruder) == tokens_out(other_tenant) == ref["o2"]
    assert intruder.num_cached_tokens == other_tenant.num_cached_tokens == 0
    assert dss_params(intruder) == {"session_id": None, "version_id": None, "loaded_tokens": 0,
                                    "engine_cached_tokens": 0, "result": "miss"}
    # tenant t2 has no session chat-1: the request starts one there, with a fresh history
    (created,) = store.versions("chat-1", tenant_id="t2")
    assert dss_params(other_tenant) == {"session_id": "chat-1", "version_id": created.version_id,
                                        "num_tokens": 178, "loaded_tokens": 0, "engine_cached_tokens": 0,
                                        "result": "miss"}
    assert (created.num_tokens, created.parent_id) == (178, None)
    assert store.session("chat-1", tenant_id="t2").user_id == "u"
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [140]


def test_a_layout_change_is_a_miss_with_the_same_outputs(model: Path, store_path: Path, store: dss.Store,
                                                         ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    with engine(model, store=store_path, model_revision="retrained") as llm:
        out = run(llm, ref["p2"], SESSION)
        llm.reset_prefix_cache()
        again = run(llm, ref["p2"], SESSION)
    assert tokens_out(out) == tokens_out(again) == ref["o2"]
    assert out.num_cached_tokens == 0
    # the session keeps its dialogue (a version per turn); the new layout's pages live in
    # the namespace, outside the session, and the next request finds them there
    assert dss_params(out) == {"session_id": "chat-1", "version_id": 2, "num_tokens": 178, "loaded_tokens": 0,
                               "engine_cached_tokens": 0, "result": "miss"}
    assert again.num_cached_tokens == 160
    assert store.session("chat-1", tenant_id="t").layout.revision != "retrained"


def test_requests_without_a_session_reuse_pages_within_their_namespace(model: Path, store_path: Path,
                                                                      ref: dict[str, list[int]]) -> None:
    with engine(model, store=store_path) as llm:
        (out,) = generate(llm, [ref["q"]])
    assert out.kv_transfer_params == {"dss": {"session_id": None, "version_id": None, "loaded_tokens": 0,
                                              "engine_cached_tokens": 0, "result": "miss"}}
    with engine(model, store=store_path) as llm:
        hit, other = generate(llm, [ref["q"], ref["q"]], params=[None, {"dss": {"user_id": "someone-else"}}])
    assert tokens_out(out) == tokens_out(hit) == tokens_out(other) == ref["oq"]
    assert hit.num_cached_tokens == 64
    assert dss_params(hit)["loaded_tokens"] == 64
    # the second request of the batch shares vLLM's blocks of the first, but dss gave it nothing
    assert dss_params(other)["loaded_tokens"] == 0


def test_corrupt_pages_are_recomputed_never_served(model: Path, store_path: Path, store: dss.Store,
                                                   ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    turn1 = ref["p1"] + ref["o1"]
    page3 = store.resume("chat-1", turn1, tenant_id="t").pages[3].page_id
    corrupt_page(store_path, page3)
    with engine(model, store=store_path) as llm:
        out = run(llm, ref["p2"], SESSION)
        llm.reset_prefix_cache()
        again = run(llm, ref["p2"], {**SESSION, "commit": False})
    assert tokens_out(out) == tokens_out(again) == ref["o2"]
    # vLLM counts the 128 tokens offered; pages 0-2 were loaded, page 3 failed its checksum
    assert (out.num_cached_tokens, dss_params(out)["loaded_tokens"]) == (128, 96)
    # page 3 was quarantined, recomputed and saved again (with page 4); nothing is missing now
    assert (again.num_cached_tokens, dss_params(again)["loaded_tokens"]) == (160, 160)
    assert dss_params(again) == {"session_id": "chat-1", "version_id": None, "loaded_tokens": 160,  # not committed
                                 "engine_cached_tokens": 0, "result": "hit"}
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [140, 178]
    assert store.check() == []


def test_rollback_then_a_new_turn_reuses_the_pages_of_the_version_rolled_back_to(
        model: Path, store_path: Path, store: dss.Store, ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    with engine(model, store=store_path) as llm:
        run(llm, ref["p2"], SESSION)
        store.rollback("chat-1", 1, tenant_id="t")
        llm.reset_prefix_cache()
        out = run(llm, ref["p2b"], SESSION)
    assert tokens_out(out) == ref["o2b"]
    assert out.num_cached_tokens == dss_params(out)["loaded_tokens"] == 128
    assert dss_params(out)["version_id"] == 3
    assert [(v.version_id, v.parent_id, v.is_head) for v in store.versions("chat-1", tenant_id="t")] == [
        (1, None, False), (2, 1, False), (3, 1, True)]


def test_a_branch_reuses_its_parents_pages(model: Path, store_path: Path, store: dss.Store,
                                           ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    branch = store.branch("chat-1", 1, "chat-1-alt", tenant_id="t")
    assert branch.head_id is not None
    with engine(model, store=store_path) as llm:
        out = run(llm, ref["p2b"], {**SESSION, "session_id": "chat-1-alt"})
    assert tokens_out(out) == ref["o2b"]
    assert out.num_cached_tokens == dss_params(out)["loaded_tokens"] == 128
    versions = store.versions("chat-1-alt", tenant_id="t")
    assert [(v.num_tokens, v.is_head) for v in versions] == [(140, False), (173, True)]
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [140]


def test_default_multiprocess_mode(model: Path, store_path: Path, store: dss.Store, ref: dict[str, list[int]]) -> None:
    first_turn(model, store_path, ref)
    with engine(model, store=store_path, multiprocess=True) as llm:
        out = run(llm, ref["p2"], SESSION)
    assert tokens_out(out) == ref["o2"]
    assert out.num_cached_tokens == dss_params(out)["loaded_tokens"] == 128
    assert dss_params(out)["version_id"] == 2
    # the worker process saved page 4 and wrote it before the engine shut down
    assert store.resume("chat-1", ref["p2"] + ref["o2"], tenant_id="t").matched_tokens == 160


def test_an_engine_whose_pages_differ_from_the_configured_size_refuses_to_start(model: Path, store_path: Path) -> None:
    refused = pytest.raises(dss.ConfigError, match="pages of this model have 32768 bytes, but the dss connector is "
                                                   "configured with page_bytes=4096")
    with refused, engine(model, store=store_path, page_bytes=4096):
        pass
