"""Asynchronous loads: a request whose pages are on disk waits outside the batch while the
others keep decoding; pages the worker holds in RAM load synchronously; preempted requests
with loads and saves in flight keep their outputs.

Real engines (:mod:`engines`), driven step by step through ``LLM.llm_engine`` in vLLM's
single-process mode, so that each assertion is about what one engine step did: which
requests produced a token, which one waits (``WAITING_FOR_REMOTE_KVS``). Outputs are compared
token for token with vLLM without dss. The tier of a load is read from the connector's
metrics (``loaded_tokens_host`` / ``loaded_tokens_disk``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dss_adapters.vllm_metrics import read_metrics

import dss
from tests.engines import engine, generate, make_tiny_llama, prompt, tokens_out

DECODERS = [prompt(10 + i, 40) for i in range(3)]
LONG = prompt(20, 600)
"""Its KV of (600 - 1) // 32 = 18 pages (576 tokens) is loaded; the last 24 tokens are computed."""
SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}
GROWING = prompt(30, 200)
FRESH = prompt(40, 600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def ref(model: Path) -> dict[str, list[int]]:
    """Greedy outputs without dss: the decoders (40 tokens each), the long prompt (8 tokens),
    and the preemption test's two requests."""
    with engine(model, prefix_caching=False) as llm:
        outs = (generate(llm, DECODERS, max_tokens=40) + generate(llm, [LONG]) + generate(llm, [GROWING], max_tokens=100)
                + generate(llm, [LONG[:300]], max_tokens=40) + generate(llm, [FRESH]))
    return {f"d{i}": tokens_out(outs[i]) for i in range(3)} | {
        "long": tokens_out(outs[3]), "growing": tokens_out(outs[4]), "loading": tokens_out(outs[5]),
        "fresh": tokens_out(outs[6])}


def greedy(max_tokens: int, fields: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"dss": fields}} if fields is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)


def add(llm: Any, req_id: str, tokens: list[int], params: Any) -> None:
    from vllm.inputs import TokensPrompt

    llm.llm_engine.add_request(req_id, TokensPrompt(prompt_token_ids=tokens), params)


def step(llm: Any, done: dict[str, Any]) -> dict[str, int]:
    """One engine step: request id -> tokens it has so far, for those that produced one now;
    finished outputs are kept in ``done``."""
    out = {}
    for output in llm.llm_engine.step():
        out[output.request_id] = len(output.outputs[0].token_ids)
        if output.finished:
            done[output.request_id] = output
    return out


def status(llm: Any, req_id: str) -> str:
    """The scheduler's status of a request (vLLM suffixes the ids it is given)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (request,) = [r for key, r in scheduler.requests.items() if key.startswith(f"{req_id}-")]
    return request.status.name


def test_a_disk_load_waits_outside_the_batch_while_the_others_decode(model: Path, store_path: Path,
                                                                     ref: dict[str, list[int]]) -> None:
    with engine(model, store=store_path) as llm:  # saves the long prompt's pages
        generate(llm, [LONG], params=[{"dss": SESSION}])
    with engine(model, store=store_path, log_stats=True) as llm:  # a fresh worker: its RAM holds no page
        done: dict[str, Any] = {}
        for i, tokens in enumerate(DECODERS):
            add(llm, f"d{i}", tokens, greedy(40))
        assert step(llm, done) == {"d0": 1, "d1": 1, "d2": 1}  # their prefills
        add(llm, "long", LONG, greedy(8, SESSION))
        # the long prompt's pages are on disk: it waits for them, the decoders run on
        assert step(llm, done) == {"d0": 2, "d1": 2, "d2": 2}
        assert status(llm, "long") == "WAITING_FOR_REMOTE_KVS"
        steps = [step(llm, done)]
        while "long" not in done:
            steps.append(step(llm, done))
        # every step until it finished, each decoder produced a token, until it had all 40 (a
        # slow load may outlast them: then the last steps are the long request's alone)
        produced = {"d0": 2, "d1": 2, "d2": 2}
        for s in steps:
            assert {d for d, n in produced.items() if n < 40} <= set(s), (produced, s)
            produced.update({d: n for d, n in s.items() if d in produced})
        assert [s["long"] for s in steps if "long" in s] == list(range(1, 9))
        assert read_metrics(llm)["loaded_tokens_disk"] == 576
        while len(done) < 4:
            step(llm, done)
        # a prompt this worker computes and saves, then again with vLLM's own cache emptied: its
        # pages are in the worker's RAM, so the load is synchronous: the request runs in the step
        # that admits it (before, it only waits for its session's saves, never for a load)
        add(llm, "fresh", FRESH, greedy(8, {**SESSION, "session_id": "chat-2"}))
        while len(done) < 5:
            step(llm, done)
        assert llm.reset_prefix_cache()
        add(llm, "again", FRESH, greedy(8, {**SESSION, "session_id": "chat-2", "commit": False}))
        while "again" not in step(llm, done):
            assert status(llm, "again") == "WAITING"
        while len(done) < 6:
            step(llm, done)
        metrics = read_metrics(llm)
    assert [tokens_out(done[f"d{i}"]) for i in range(3)] == [ref["d0"], ref["d1"], ref["d2"]]
    assert tokens_out(done["long"]) == ref["long"]
    assert tokens_out(done["fresh"]) == tokens_out(done["again"]) == ref["fresh"]
    assert done["long"].kv_transfer_params["dss"]["loaded_tokens"] == 576
    assert done["again"].kv_transfer_params["dss"]["loaded_tokens"] == 576
    assert (metrics["loaded_tokens_disk"], metrics["loaded_tokens_host"]) == (576, 576)
    assert (metrics["requests_hit"], metrics["requests_miss"]) == (2, 4)


def test_preempted_requests_with_loads_and_saves_in_flight_keep_their_outputs(model: Path, store_path: Path,
                                                                             ref: dict[str, list[int]]) -> None:
    """18 blocks of 32 tokens. ``growing`` (200 prompt tokens, 100 generated: 7 blocks, then
    up to 10) runs first and saves a page every 32 tokens; ``loading`` (300 tokens, 8 pages on
    disk, 40 generated: 10 blocks, then 11) waits for its asynchronous load, then runs beside
    it. When both need a new block the cache is full and vLLM preempts ``loading`` (the later
    arrival) with its pages being saved; it resumes when ``growing`` finishes, loads its own
    pages back and ends with the output of vLLM without dss."""
    with engine(model, store=store_path) as llm:
        generate(llm, [LONG[:256]], params=[{"dss": SESSION}])  # 8 pages of the loading prompt
    with engine(model, store=store_path, num_blocks=18, max_model_len=400, log_stats=True) as llm:
        done: dict[str, Any] = {}
        add(llm, "growing", GROWING, greedy(100, {"tenant_id": "t", "user_id": "v"}))
        assert step(llm, done) == {"growing": 1}
        add(llm, "loading", LONG[:300], greedy(40, SESSION))
        assert step(llm, done) == {"growing": 2}
        assert status(llm, "loading") == "WAITING_FOR_REMOTE_KVS"
        trace = []
        while len(done) < 2:
            trace.append(step(llm, done))
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        metrics = read_metrics(llm)
    assert preemptions >= 1
    # while preempted, ``loading`` produced nothing and ``growing`` went on
    paused = [i for i, s in enumerate(trace) if "loading" not in s and i and "loading" in trace[i - 1]]
    assert paused and all("growing" in trace[i] for i in paused)
    assert tokens_out(done["growing"]) == ref["growing"]
    assert tokens_out(done["loading"]) == ref["loading"]
    # 256 tokens from disk at first; after the preemption, those again, plus the pages it had
    # saved meanwhile whose writes landed before it was admitted again (a race: the rest is
    # recomputed, never wrong)
    loaded = done["loading"].kv_transfer_params["dss"]["loaded_tokens"]
    assert loaded >= 256 and loaded % 32 == 0
    assert metrics["loaded_tokens_disk"] >= 256 and metrics.get("failed_pages", 0) == 0
    with dss.open(store_path) as store:
        assert store.check() == []
        assert store.resume("chat-1", LONG[:300] + ref["loading"], tenant_id="t").matched_tokens == 320
