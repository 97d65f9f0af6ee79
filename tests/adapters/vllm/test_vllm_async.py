"""Asynchronous loads: a request whose pages are on disk waits outside the batch while the
others keep decoding; pages the worker holds in RAM load synchronously; preempted requests
with loads and saves in flight keep their outputs.

Real engines on SmolLM2-135M-Instruct (real weights, in float32: the oracle is vLLM without
any cache, see :mod:`engines`), driven step by step through ``LLM.llm_engine`` in vLLM's
single-process mode, so that each assertion is about what one engine step did: which
requests produced a token, which one waits (``WAITING_FOR_REMOTE_KVS``). Prompts are chats
rendered by the model's chat template: short questions (the decoders, about 40 tokens),
and meeting notes with a question about them (a few hundred tokens). Outputs are compared
token for token with vLLM without dss. The tier of a load is read from the connector's
metrics (``loaded_tokens_host`` / ``loaded_tokens_disk``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dss_adapters.vllm.metrics import read_metrics

import dss
from tests.engines import BLOCK, chat_tokenizer, engine, generate, render, tokens_out

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}
F32 = {"dtype": "float32"}
NOTES = (
    "Notes from the Tuesday planning meeting of the Riverside community garden. Present: Ana, Bilal, Chen, Dora and"
    " Emeka. Ana opened the meeting by thanking everyone who helped with the spring clean-up, which filled eleven "
    "bags of weeds and cleared the path behind the tool shed. The water bill for March was higher than expected "
    "because the tap near the east beds had been dripping for two weeks; Bilal replaced the washer on Saturday and "
    "will check the meter again next month. Chen reported that the seed swap brought in forty-two packets, mostly "
    "tomatoes, beans and squash, and that the library has offered its hall for the next swap in September. The "
    "group agreed to keep a simple list of who takes which seeds, so that varieties that do well can be saved again"
    " next year. Dora raised the problem of slugs in the lettuce beds. After some discussion the group decided "
    "against pellets, because children play near the beds, and will try beer traps and copper tape for a month "
    "before deciding anything else. Emeka has built two new compost bins from old pallets; the old bin is full and "
    "should be turned every two weeks until it is ready in June. A rota for turning it was drawn up: Ana and Chen "
    "in April, Bilal and Dora in May. The committee discussed the request from the primary school to use one bed "
    "for a class project. Everyone was in favour, provided that a teacher is present during visits and that the "
    "class waters the bed on Fridays. Chen will show the teacher where the tools are kept and explain the rules "
    "about the shared wheelbarrow. The treasurer's report showed a balance of three hundred and ten pounds after "
    "paying for the new hose and the pallet screws. Membership fees are due in May, and Bilal suggested sending a "
    "reminder by text message as well as by email, since several members do not read their email often. The open "
    "day is planned for the second Saturday in June, with a plant sale, a tea stall and a short tour of the beds "
    "for new members. Dora will ask the bakery on the high street whether it would donate some bread for the tea "
    "stall. The next meeting will be on the first Tuesday of May, at seven in the evening, in the shed if the "
    "weather is dry and in the library otherwise."
)
SENTENCES = NOTES.split(". ")
SECRETARY = "You are a careful secretary. Summarise meeting notes in short bullet points."
QUESTIONS = [
    "What is the boiling point of water in Fahrenheit?",
    "Name three rivers in Africa and the seas they flow into.",
    "How many legs does a spider have, and why?",
]


def chat(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def notes(num_sentences: int, question: str) -> str:
    return ". ".join(SENTENCES[:num_sentences]) + ". " + question


CHATS = {
    # the decoders: 40, 42 and 41 tokens (the template's default system prompt), 40 tokens generated each
    **{f"d{i}": chat(None, question) for i, question in enumerate(QUESTIONS)},
    # 510 tokens: its KV of (510 - 1) // 32 = 15 pages (480 tokens) is loaded, the last 30 tokens computed
    "long": chat(SECRETARY, notes(len(SENTENCES), "Please list every decision and who is responsible for it.")),
    # 514 tokens, another system prompt: no page in common with "long"
    "fresh": chat(
        "You answer questions about a document. Quote the sentence that your answer comes from.",
        notes(len(SENTENCES), "Who will ask the bakery for bread, and for which event?"),
    ),
    # the preemption test's two requests: 201 tokens (100 generated) and 304 tokens (40 generated)
    "growing": chat(
        "You keep the minutes of a garden club. Answer in one short paragraph.",
        notes(6, "What did the group decide about the slugs?"),
    ),
    "loading": chat(SECRETARY, notes(10, "Please list every decision and who is responsible for it.")),
}
LENGTHS = {"d0": 40, "d1": 42, "d2": 41, "long": 510, "fresh": 514, "growing": 201, "loading": 304}
MAX_TOKENS = {"d0": 40, "d1": 40, "d2": 40, "long": 8, "fresh": 8, "growing": 100, "loading": 40}


@pytest.fixture(scope="module")
def prompts(smollm2_model: Path) -> dict[str, list[int]]:
    tokenizer = chat_tokenizer(smollm2_model)
    out = {name: render(tokenizer, messages) for name, messages in CHATS.items()}
    assert {name: len(tokens) for name, tokens in out.items()} == LENGTHS
    return out


@pytest.fixture(scope="module")
def ref(smollm2_model: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy outputs without dss nor vLLM's prefix cache, of every prompt (``MAX_TOKENS`` each),
    in one batch (in float32 greedy outputs do not depend on the batch; the tests run these
    requests in other batches and compare)."""
    from vllm.inputs import TokensPrompt

    with engine(smollm2_model, prefix_caching=False, max_num_seqs=len(CHATS), **F32) as llm:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=prompts[name]) for name in CHATS],
            [greedy(MAX_TOKENS[name]) for name in CHATS],
            use_tqdm=False,
        )
    return {name: tokens_out(out) for name, out in zip(CHATS, outs)}


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


def test_a_disk_load_waits_outside_the_batch_while_the_others_decode(
    smollm2_model: Path, store_path: Path, prompts: dict[str, list[int]], ref: dict[str, list[int]]
) -> None:
    with engine(smollm2_model, store=store_path, **F32) as llm:  # saves the long prompt's pages
        generate(llm, [prompts["long"]], params=[{"dss": SESSION}])
    with engine(smollm2_model, store=store_path, log_stats=True, **F32) as llm:  # a fresh worker: no page in RAM
        done: dict[str, Any] = {}
        for i in range(3):
            add(llm, f"d{i}", prompts[f"d{i}"], greedy(40))
        assert step(llm, done) == {"d0": 1, "d1": 1, "d2": 1}  # their prefills
        add(llm, "long", prompts["long"], greedy(8, SESSION))
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
        assert read_metrics(llm)["loaded_tokens_disk"] == 480
        while len(done) < 4:
            step(llm, done)
        # a prompt this worker computes and saves, then again with vLLM's own cache emptied: its
        # pages are in the worker's RAM, so the load is synchronous: the request runs in the step
        # that admits it (before, it only waits for its session's saves, never for a load)
        add(llm, "fresh", prompts["fresh"], greedy(8, {**SESSION, "session_id": "chat-2"}))
        while len(done) < 5:
            step(llm, done)
        assert llm.reset_prefix_cache()
        add(llm, "again", prompts["fresh"], greedy(8, {**SESSION, "session_id": "chat-2", "commit": False}))
        while "again" not in step(llm, done):
            assert status(llm, "again") == "WAITING"
        while len(done) < 6:
            step(llm, done)
        metrics = read_metrics(llm)
    assert [tokens_out(done[f"d{i}"]) for i in range(3)] == [ref["d0"], ref["d1"], ref["d2"]]
    assert tokens_out(done["long"]) == ref["long"]
    assert tokens_out(done["fresh"]) == tokens_out(done["again"]) == ref["fresh"]
    assert done["long"].kv_transfer_params["dss"]["loaded_tokens"] == 480
    # "fresh" saved (514 + 8 - 1) // 32 = 16 pages; the same prompt again is offered (514 - 1) // 32 = 16
    assert done["again"].kv_transfer_params["dss"]["loaded_tokens"] == 512
    assert (metrics["loaded_tokens_disk"], metrics["loaded_tokens_host"]) == (480, 512)
    assert (metrics["requests_hit"], metrics["requests_miss"]) == (2, 4)


def test_preempted_requests_with_loads_and_saves_in_flight_keep_their_outputs(
    smollm2_model: Path, store_path: Path, prompts: dict[str, list[int]], ref: dict[str, list[int]]
) -> None:
    """18 blocks of 32 tokens. ``growing`` (201 prompt tokens, 100 generated: 7 blocks, then
    up to 10) runs first and saves a page every 32 tokens; ``loading`` (304 tokens, 9 pages on
    disk, 40 generated: 10 blocks, then 11) waits for its asynchronous load, then runs beside
    it. When both need a new block the cache is full and vLLM preempts ``loading`` (the later
    arrival) with its pages being saved; it resumes when ``growing`` finishes, loads its own
    pages back and ends with the output of vLLM without dss."""
    with engine(smollm2_model, store=store_path, **F32) as llm:  # the loading prompt, sent before: 9 pages
        generate(llm, [prompts["loading"]], max_tokens=1, params=[{"dss": SESSION}])
    with engine(smollm2_model, store=store_path, num_blocks=18, max_model_len=400, log_stats=True, **F32) as llm:
        done: dict[str, Any] = {}
        add(llm, "growing", prompts["growing"], greedy(100, {"tenant_id": "t", "user_id": "v"}))
        assert step(llm, done) == {"growing": 1}
        add(llm, "loading", prompts["loading"], greedy(40, SESSION))
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
    # 288 tokens from disk at first; after the preemption, those again, plus the pages it had
    # saved meanwhile whose writes landed before it was admitted again (a race: the rest is
    # recomputed, never wrong)
    loaded = done["loading"].kv_transfer_params["dss"]["loaded_tokens"]
    assert loaded >= 288 and loaded % BLOCK == 0
    assert metrics["loaded_tokens_disk"] >= 288 and metrics.get("failed_pages", 0) == 0
    with dss.open(store_path) as store:
        assert store.check() == []
        history = prompts["loading"] + ref["loading"]
        assert store.resume("chat-1", history, tenant_id="t").matched_tokens == (len(history) - 1) // BLOCK * BLOCK
