"""The dss connector in the real vLLM CPU engine on SmolLM2-135M-Instruct (real weights): a
chat whose next turn runs in a fresh engine loads the previous turn's pages, and greedy
outputs stay exactly those of vLLM without dss.

Prompts are conversations rendered by the model's own chat template. Each dtype has its
oracle (see :mod:`engines`):

- bf16, the dtype a server runs: vLLM's own prefix cache, in one engine without dss holding
  everything (turn 1, then turn 2 with turn 1's blocks cached: the split into cached prefix
  and computed suffix that dss gives). Every bf16 engine here prefills in chunks of 64 tokens.
- float32 (vLLM casts the bf16 weights): vLLM without any cache. The tests of mechanisms
  (namespaces, a layout change, a corrupt page, requests without a session) run here.

``num_cached_tokens`` is vLLM's count of prompt tokens it did not compute (its own prefix
cache plus what the connector loaded); the connector's own count is
``kv_transfer_params["dss"]["loaded_tokens"]``. Engines are single-process unless a test
says otherwise. Each dtype's turn 1 runs once per module; every test starts from a copy of
its store.

The conversation (block = page = 32 tokens)::

    p1  = [system, user1]   (110 tokens)       -> o1: 24 tokens  (turn 1: KV of 133 tokens: pages 0-3)
    p2  = [system, user1, o1's reply, user2]   -> o2: 8 tokens   (starts with p1 + o1: reuses pages 0-3)
    p2b = [system, user1, o1's reply, user2b]  -> o2b: 8 tokens  (a regenerated turn 2; the same pages)
    q   = [system, question], no session (86)  -> oq: 8 tokens   (pages 0-1, saved and loaded in its namespace)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dss
from tests.engines import BLOCK, chat_tokenizer, corrupt_page, engine, generate, render, reply, run, tokens_out

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}
SYSTEM = {
    "role": "system",
    "content": "You are a friendly baking teacher at a community kitchen. The people who "
    "write to you are beginners who bake at home with ordinary equipment. Answer "
    "with clear numbered steps and a short reason for each step, give quantities "
    "in grams, and say which mistakes beginners make most often. Keep a warm, "
    "encouraging tone.",
}
USER1 = {
    "role": "user",
    "content": "I want to bake sourdough bread at home for the first time. What do I need, "
    "and how long does the whole process take, from the starter to the loaf?",
}
USER2 = {"role": "user", "content": "My kitchen is cold in winter. How should I change the timing?"}
USER2B = {"role": "user", "content": "Could you turn that into a short shopping list?"}
QUESTION = {"role": "user", "content": "Write a short poem about rain on a tin roof."}
TURN1 = 24
"""Tokens of turn 1's reply (its text renders back to the same tokens in the next turn's prompt)."""
N1 = 110 + TURN1
"""Turn 1's tokens (prompt and reply): 134, of which 133 have KV, in 4 full pages."""
BF16 = {"dtype": "bfloat16", "max_num_batched_tokens": 64}
F32 = {"dtype": "float32"}


def pages(num_tokens: int) -> int:
    """Full pages of KV a request of ``num_tokens`` tokens (prompt + output) leaves: its last
    token is never computed."""
    return (num_tokens - 1) // BLOCK


def prompts(tokenizer: Any, o1: list[int]) -> dict[str, list[int]]:
    """Turn 2 and its regenerated variant after turn 1's reply ``o1``; checks that both start
    with turn 1's tokens and share no page beyond turn 1's, as the module docstring says."""
    p1 = render(tokenizer, [SYSTEM, USER1])
    p2 = render(tokenizer, [SYSTEM, USER1, reply(tokenizer, o1), USER2])
    p2b = render(tokenizer, [SYSTEM, USER1, reply(tokenizer, o1), USER2B])
    turn1 = p1 + o1
    assert (len(p1), len(turn1)) == (110, N1)
    assert p2[: len(turn1)] == p2b[: len(turn1)] == turn1, "the reply did not render back to its tokens"
    shared = next(i for i, (a, b) in enumerate(zip(p2, p2b)) if a != b)
    assert shared // BLOCK == pages(len(turn1)), "p2 and p2b share a page beyond turn 1's"
    q = render(tokenizer, [SYSTEM, QUESTION])
    assert len(q) == 86
    return {"p1": p1, "o1": o1, "p2": p2, "p2b": p2b, "q": q}


def alone(llm: Any, tokens: list[int], max_tokens: int = 8) -> list[int]:
    """The greedy output of one request run by itself."""
    return tokens_out(generate(llm, [tokens], max_tokens=max_tokens)[0])


@pytest.fixture(scope="module")
def tokenizer(smollm2_model: Path) -> Any:
    return chat_tokenizer(smollm2_model)


@pytest.fixture(scope="module")
def bf16(smollm2_model: Path, tokenizer: Any) -> dict[str, list[int]]:
    """The conversation's prompts and the bf16 oracle's outputs: one engine with vLLM's prefix
    cache and no dss; each request alone, so its cached prefix is what dss would load.

    ``o2``/``o2b``: turn 1's 4 pages cached (p2b's blocks beyond them differ from p2's).
    """
    with engine(smollm2_model, **BF16) as llm:
        out = prompts(tokenizer, alone(llm, render(tokenizer, [SYSTEM, USER1]), max_tokens=TURN1))
        out["o2"], out["o2b"] = alone(llm, out["p2"]), alone(llm, out["p2b"])
    return out


@pytest.fixture(scope="module")
def f32(smollm2_model: Path, tokenizer: Any) -> dict[str, list[int]]:
    """The conversation's prompts and the float32 oracle's outputs: vLLM without any cache."""
    with engine(smollm2_model, prefix_caching=False, **F32) as llm:
        out = prompts(tokenizer, alone(llm, render(tokenizer, [SYSTEM, USER1]), max_tokens=TURN1))
        out["o2"], out["oq"] = alone(llm, out["p2"]), alone(llm, out["q"])
    return out


def first_turn(model: Path, store_path: Path, ref: dict[str, list[int]], options: dict[str, Any]) -> Path:
    """Turn 1 of chat-1 in an engine with dss on ``store_path``; checks it against ``ref``."""
    with engine(model, store=store_path, **options) as llm:
        out = run(llm, ref["p1"], SESSION, max_tokens=TURN1)
    assert tokens_out(out) == ref["o1"]
    assert out.num_cached_tokens == 0
    assert dss_params(out) == {
        "session_id": "chat-1",
        "version_id": 1,
        "num_tokens": N1,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    return store_path


@pytest.fixture(scope="module")
def bf16_turn1(smollm2_model: Path, bf16: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store where a bf16 engine ran turn 1 (its prompt prefilled in chunks of 64 tokens)."""
    return first_turn(smollm2_model, tmp_path_factory.mktemp("bf16") / "store", bf16, BF16)


@pytest.fixture(scope="module")
def f32_turn1(smollm2_model: Path, f32: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return first_turn(smollm2_model, tmp_path_factory.mktemp("f32") / "store", f32, F32)


def copy_of(store_path: Path, tmp_path: Path) -> Iterator[tuple[Path, dss.Store]]:
    copy = Path(shutil.copytree(store_path, tmp_path / "store"))
    with dss.open(copy, mover=False) as handle:
        yield copy, handle


@pytest.fixture
def bf16_store(bf16_turn1: Path, tmp_path: Path) -> Iterator[tuple[Path, dss.Store]]:
    """The test's own copy of the bf16 turn-1 store and a handle on it (engines open the same folder)."""
    yield from copy_of(bf16_turn1, tmp_path)


@pytest.fixture
def f32_store(f32_turn1: Path, tmp_path: Path) -> Iterator[tuple[Path, dss.Store]]:
    yield from copy_of(f32_turn1, tmp_path)


def dss_params(output: Any) -> dict[str, Any]:
    return output.kv_transfer_params["dss"]


def test_next_turn_on_a_fresh_engine_loads_the_first_turns_pages(
    smollm2_model: Path, bf16_store: Any, bf16: dict[str, list[int]]
) -> None:
    store_path, store = bf16_store
    with engine(smollm2_model, store=store_path, **BF16) as llm:
        out = run(llm, bf16["p2"], {**SESSION, "label": "turn 2"})
    assert tokens_out(out) == bf16["o2"]
    assert out.num_cached_tokens == 128
    history = bf16["p2"] + bf16["o2"]
    assert dss_params(out) == {
        "session_id": "chat-1",
        "version_id": 2,
        "num_tokens": len(history),
        "loaded_tokens": 128,
        "engine_cached_tokens": 0,
        "result": "hit",
    }
    versions = store.versions("chat-1", tenant_id="t")
    assert [(v.version_id, v.parent_id, v.num_tokens, v.is_head, v.label) for v in versions] == [
        (1, None, N1, False, None),
        (2, 1, len(history), True, "turn 2"),
    ]
    assert store.tokens("chat-1", tenant_id="t") == history
    # turn 2 saved its own full pages after turn 1's
    assert store.resume("chat-1", history, tenant_id="t").matched_tokens == pages(len(history)) * BLOCK
    assert store.check() == []
    fields = store.session("chat-1", tenant_id="t").layout.to_dict()
    assert fields.pop("backend").startswith("cpu:")  # the CPU attention ISA: vec, amx, neon, ...
    assert fields.pop("revision").startswith("local-")  # fingerprint of the model folder
    assert fields == {
        "name": "vllm",
        "page_tokens": 32,
        "page_bytes": 737_280,
        "model": str(smollm2_model),
        "dtype": "bfloat16",
        "kv_dtype": "bfloat16",
        "kv_cache_dtype": "auto",
        "num_layers": 30,
        "num_kv_heads": 3,
        "head_size": 64,
        "head_size_v": 64,
        "platform": "cpu",
        "vllm": "0.32.0",
        "attention": "full",
        "tp_size": 1,
        "tp_shard": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "format": "[layers][kv_heads][k,v]x[page_tokens*head_size]",
    }


def test_rollback_then_a_new_turn_reuses_the_pages_of_the_version_rolled_back_to(
    smollm2_model: Path, bf16_store: Any, bf16: dict[str, list[int]]
) -> None:
    """What a chat backend's "undo" does: turn 2, roll the session back to turn 1, send another turn 2."""
    store_path, store = bf16_store
    with engine(smollm2_model, store=store_path, **BF16) as llm:
        first = run(llm, bf16["p2"], SESSION)
        head = store.rollback("chat-1", 1, tenant_id="t")
        llm.reset_prefix_cache()
        out = run(llm, bf16["p2b"], SESSION)
    assert (tokens_out(first), tokens_out(out)) == (bf16["o2"], bf16["o2b"])
    assert (head.version_id, head.num_tokens, dss_params(first)["version_id"]) == (1, N1, 2)
    assert out.num_cached_tokens == dss_params(out)["loaded_tokens"] == 128
    assert dss_params(out) == {
        "session_id": "chat-1",
        "version_id": 3,
        "num_tokens": len(bf16["p2b"]) + 8,
        "loaded_tokens": 128,
        "engine_cached_tokens": 0,
        "result": "hit",
    }
    assert [(v.version_id, v.parent_id, v.is_head) for v in store.versions("chat-1", tenant_id="t")] == [
        (1, None, False),
        (2, 1, False),
        (3, 1, True),
    ]
    assert store.tokens("chat-1", tenant_id="t") == bf16["p2b"] + bf16["o2b"]
    assert store.check() == []


def test_a_branch_reuses_its_parents_pages(smollm2_model: Path, bf16_store: Any, bf16: dict[str, list[int]]) -> None:
    """What "regenerate in a new conversation" does: branch at turn 1, send the other turn 2 there."""
    store_path, store = bf16_store
    branch = store.branch("chat-1", 1, "chat-1-alt", tenant_id="t")
    assert branch.head_id is not None
    with engine(smollm2_model, store=store_path, **BF16) as llm:
        out = run(llm, bf16["p2b"], {**SESSION, "session_id": "chat-1-alt"})
    assert tokens_out(out) == bf16["o2b"]
    assert out.num_cached_tokens == 128
    start, turn2 = store.versions("chat-1-alt", tenant_id="t")
    assert (start.version_id, start.num_tokens, turn2.parent_id) == (branch.head_id, N1, branch.head_id)
    assert dss_params(out) == {
        "session_id": "chat-1-alt",
        "version_id": turn2.version_id,
        "num_tokens": len(bf16["p2b"]) + 8,
        "loaded_tokens": 128,
        "engine_cached_tokens": 0,
        "result": "hit",
    }
    assert store.tokens("chat-1-alt", tenant_id="t") == bf16["p2b"] + bf16["o2b"]
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [N1]
    assert store.check() == []


def test_default_multiprocess_mode(smollm2_model: Path, bf16_store: Any, bf16: dict[str, list[int]]) -> None:
    store_path, store = bf16_store
    with engine(smollm2_model, store=store_path, multiprocess=True, **BF16) as llm:
        out = run(llm, bf16["p2"], SESSION)
    assert tokens_out(out) == bf16["o2"]
    assert out.num_cached_tokens == dss_params(out)["loaded_tokens"] == 128
    assert dss_params(out)["version_id"] == 2
    # the worker process saved turn 2's pages and wrote them before the engine shut down
    history = bf16["p2"] + bf16["o2"]
    assert store.resume("chat-1", history, tenant_id="t").matched_tokens == pages(len(history)) * BLOCK


def test_an_engine_whose_pages_differ_from_the_configured_size_refuses_to_start(
    smollm2_model: Path, store_path: Path
) -> None:
    refused = pytest.raises(
        dss.ConfigError,
        match="pages of this model have 737280 bytes, but the dss connector is configured with page_bytes=4096",
    )
    with refused, engine(smollm2_model, store=store_path, page_bytes=4096, **BF16):
        pass


def test_another_namespace_gets_no_hit_and_the_same_outputs(
    smollm2_model: Path, f32_store: Any, f32: dict[str, list[int]]
) -> None:
    store_path, store = f32_store
    with engine(smollm2_model, store=store_path, **F32) as llm:
        intruder = run(llm, f32["p2"], {**SESSION, "user_id": "v"})  # names u's session from v's namespace
        llm.reset_prefix_cache()
        other_tenant = run(llm, f32["p2"], {**SESSION, "tenant_id": "t2"})
    assert tokens_out(intruder) == tokens_out(other_tenant) == f32["o2"]
    assert intruder.num_cached_tokens == other_tenant.num_cached_tokens == 0
    assert dss_params(intruder) == {
        "session_id": None,
        "version_id": None,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    # tenant t2 has no session chat-1: the request starts one there, with a fresh history
    (created,) = store.versions("chat-1", tenant_id="t2")
    assert dss_params(other_tenant) == {
        "session_id": "chat-1",
        "version_id": created.version_id,
        "num_tokens": len(f32["p2"]) + 8,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    assert (created.num_tokens, created.parent_id) == (len(f32["p2"]) + 8, None)
    assert store.session("chat-1", tenant_id="t2").user_id == "u"
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [N1]


def test_a_layout_change_is_a_miss_with_the_same_outputs(
    smollm2_model: Path, f32_store: Any, f32: dict[str, list[int]]
) -> None:
    store_path, store = f32_store
    with engine(smollm2_model, store=store_path, model_revision="retrained", **F32) as llm:
        out = run(llm, f32["p2"], SESSION)
        llm.reset_prefix_cache()
        again = run(llm, f32["p2"], SESSION)
    assert tokens_out(out) == tokens_out(again) == f32["o2"]
    assert out.num_cached_tokens == 0
    # the session keeps its dialogue (a version per turn); the new layout's pages live in
    # the namespace, outside the session, and the next request finds them there
    assert dss_params(out) == {
        "session_id": "chat-1",
        "version_id": 2,
        "num_tokens": len(f32["p2"]) + 8,
        "loaded_tokens": 0,
        "engine_cached_tokens": 0,
        "result": "miss",
    }
    assert again.num_cached_tokens == pages(len(f32["p2"])) * BLOCK
    assert store.session("chat-1", tenant_id="t").layout.revision != "retrained"


def test_corrupt_pages_are_recomputed_never_served(
    smollm2_model: Path, f32_store: Any, f32: dict[str, list[int]]
) -> None:
    store_path, store = f32_store
    turn1 = f32["p1"] + f32["o1"]
    corrupt_page(store_path, store.resume("chat-1", turn1, tenant_id="t").pages[3].page_id)
    with engine(smollm2_model, store=store_path, **F32) as llm:
        out = run(llm, f32["p2"], SESSION)
        llm.reset_prefix_cache()
        again = run(llm, f32["p2"], {**SESSION, "commit": False})
    assert tokens_out(out) == tokens_out(again) == f32["o2"]
    # vLLM counts the 128 tokens offered; pages 0-2 were loaded, page 3 failed its checksum
    assert (out.num_cached_tokens, dss_params(out)["loaded_tokens"]) == (128, 96)
    # page 3 was quarantined, recomputed and saved again (with turn 2's); nothing is missing now
    saved = pages(len(f32["p2"])) * BLOCK
    assert (again.num_cached_tokens, dss_params(again)["loaded_tokens"]) == (saved, saved)
    assert dss_params(again) == {
        "session_id": "chat-1",
        "version_id": None,
        "loaded_tokens": saved,  # not committed
        "engine_cached_tokens": 0,
        "result": "hit",
    }
    assert [v.num_tokens for v in store.versions("chat-1", tenant_id="t")] == [N1, len(f32["p2"]) + 8]
    assert store.check() == []


def test_requests_without_a_session_reuse_pages_within_their_namespace(
    smollm2_model: Path, store_path: Path, f32: dict[str, list[int]]
) -> None:
    with engine(smollm2_model, store=store_path, **F32) as llm:
        (out,) = generate(llm, [f32["q"]])
    assert out.kv_transfer_params == {
        "dss": {"session_id": None, "version_id": None, "loaded_tokens": 0, "engine_cached_tokens": 0, "result": "miss"}
    }
    with engine(smollm2_model, store=store_path, **F32) as llm:
        hit, other = generate(llm, [f32["q"], f32["q"]], params=[None, {"dss": {"user_id": "someone-else"}}])
    assert tokens_out(out) == tokens_out(hit) == tokens_out(other) == f32["oq"]
    assert hit.num_cached_tokens == dss_params(hit)["loaded_tokens"] == pages(len(f32["q"])) * BLOCK
    # the second request of the batch may share vLLM's blocks of the first, but dss gave it nothing
    assert dss_params(other)["loaded_tokens"] == 0


def first_token_logprobs(llm: Any, tokens: list[int], fields: dict[str, Any] | None) -> tuple[Any, dict[int, float]]:
    """One greedy request of 8 tokens (``kv_transfer_params`` ``{"dss": fields}``, none if
    ``None``): its output and the top-5 logprobs of its first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"dss": fields}} if fields is not None else None
    sampling = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=5, extra_args=extra
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], [sampling], use_tqdm=False)[0]
    return out, {token: float(lp.logprob) for token, lp in out.outputs[0].logprobs[0].items()}


def disk_only_turns(
    model: Path, store_path: Path, ref: dict[str, list[int]], precision: str, load_mode: str = "auto"
) -> dict[str, Any]:
    """Turn 1, then turn 2 with its pages read from disk (the store keeps no host copy: ``host_bytes``
    0; vLLM's prefix cache reset), then turn 2 again computed in full (no dss, reset again), on a
    bf16 engine whose store's disk keeps ``precision`` (the connector's ``load_mode``: ``auto``
    loads synchronously here, nothing else runs): the outputs, turn 2's first-token top-5
    logprobs, and the connector's metrics."""
    from dss_adapters.vllm.metrics import read_metrics

    options = {"store_options": {"disk_precision": precision, "host_bytes": 0}, "load_mode": load_mode}
    with engine(model, store=store_path, log_stats=True, **BF16, **options) as llm:
        assert tokens_out(run(llm, ref["p1"], SESSION, max_tokens=TURN1)) == ref["o1"]  # computed: exact
        assert llm.reset_prefix_cache()
        loaded, loaded_lp = first_token_logprobs(llm, ref["p2"], SESSION)
        assert llm.reset_prefix_cache()
        full, full_lp = first_token_logprobs(llm, ref["p2"], None)
        metrics = read_metrics(llm)
    return {"loaded": loaded, "loaded_lp": loaded_lp, "full": full, "full_lp": full_lp, "metrics": metrics}


def test_a_disk_kept_at_int8_serves_the_next_turn_dequantized_and_announced(
    smollm2_model: Path, bf16: dict[str, list[int]], tmp_path: Path
) -> None:
    """``disk_precision="int8"`` through ``store_options``: the pages vLLM saves (its CPU
    backend's blocks) are encoded on disk, and turn 2, loading them from disk, gets them
    dequantized into bf16 and says so in ``kv_transfer_params`` and the metrics.

    The oracle is the same run with an exact disk. int8 KV is not bit-exact, so the test asks
    what a user would notice: the same greedy tokens as the exact load's (``bf16["o2"]``,
    itself vLLM's own prefix-cache output), the same top-5 candidates for the first token, and
    their logprobs no further from the exact load's than bf16's own noise, measured in the same
    run: the exact load against the full computation of the prompt (a cached prefix and a
    computed one round differently). Loaded synchronously, and asynchronously (through the
    worker's reader process) with the same result."""
    exact = disk_only_turns(smollm2_model, tmp_path / "exact", bf16, "exact")
    int8 = disk_only_turns(smollm2_model, tmp_path / "int8", bf16, "int8")
    later = disk_only_turns(smollm2_model, tmp_path / "async", bf16, "int8", load_mode="async")
    assert dss_params(later["loaded"])["encodings"] == {"int8": 128} and later["metrics"]["lossy_tokens_int8"] == 128
    assert later["loaded_lp"] == int8["loaded_lp"] and tokens_out(later["loaded"]) == bf16["o2"]
    with dss.open(tmp_path / "int8", mover=False) as store:
        sizes = {row[0] for row in store.sql("SELECT size FROM pages").rows}
        assert sizes == {380_180}  # 737,280-byte pages, int8 on disk
    params = dss_params(int8["loaded"])
    assert (params["loaded_tokens"], params["encodings"], params["lossy_tokens"]) == (128, {"int8": 128}, 128)
    assert dss_params(exact["loaded"])["loaded_tokens"] == 128 and "lossy_tokens" not in dss_params(exact["loaded"])
    assert int8["loaded"].num_cached_tokens == 128 and int8["full"].num_cached_tokens == 0
    assert int8["metrics"]["lossy_tokens_int8"] == 128 == int8["metrics"]["loaded_tokens_disk"]
    assert "lossy_tokens_int8" not in exact["metrics"] or exact["metrics"]["lossy_tokens_int8"] == 0
    assert tokens_out(int8["loaded"]) == tokens_out(exact["loaded"]) == bf16["o2"]
    top = exact["loaded_lp"]
    assert set(int8["loaded_lp"]) == set(top) == set(exact["full_lp"])
    error = max(abs(int8["loaded_lp"][t] - top[t]) for t in top)
    floor = max(abs(exact["full_lp"][t] - top[t]) for t in top)
    print(f"first-token top-5 logprobs against the exact load: int8 {error:.4f} nats, full computation {floor:.4f}")
    assert error <= floor
