"""Approximate matching in the real vLLM CPU engine: a re-rendered multi-turn chat whose requests
each carry a new session id, with a per-request line (a timestamp) the template puts at
position 40 of every prompt. Greedy outputs stay exactly those of vLLM without dss; dss
reuses only the exact prefix (the first page), the connector logs the near-duplicate it
found, and ``explain`` names position 40 and the reuse the line costs.

    prompt i = SYSTEM[:40] + line(i) (6 tokens) + SYSTEM[40:] + (user j + answer j for j < i) + user i
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import dss
from tests.engines import engine, generate, make_tiny_llama, prompt, tokens_out

pytestmark = pytest.mark.slow

SPLIT = 40
SYSTEM = prompt(10, 64)
TURNS = 4
FIELDS = {"tenant_id": "t", "user_id": "u"}
OPTIONS = {"approximate": True, "lsh_window_tokens": 32}
"""Windows of one page: from turn 1 on, a window of the prompt after the line repeats one of the
previous version exactly, so LSH proposes it with certainty (short prompts' whole-version
Jaccard, about 0.7-0.85 here, would make the proposal a matter of chance)."""


def line(i: int) -> list[int]:
    return prompt(100 + i, 6)


def build(i: int, answers: list[list[int]]) -> list[int]:
    out = SYSTEM[:SPLIT] + line(i) + SYSTEM[SPLIT:]
    for j in range(i):
        out += prompt(20 + j, 24) + answers[j]
    return out + prompt(20 + i, 24)


def chat(llm, params) -> tuple[list[list[int]], list]:  # type: ignore[no-untyped-def]
    """The turns in order, each prompt re-rendered from the answers so far."""
    answers: list[list[int]] = []
    outputs = []
    for i in range(TURNS):
        (out,) = generate(llm, [build(i, answers)], max_tokens=16, params=[params(i)] if params is not None else None)
        answers.append(tokens_out(out))
        outputs.append(out)
    return answers, outputs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_rerendered_chat_outputs_match_vllm_and_explain_names_the_line(tmp_path: Path, store_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny-llama")
    with engine(model, prefix_caching=False) as llm:
        reference, _ = chat(llm, None)
    records = _Records()
    logger = logging.getLogger("vllm.dss.scheduler")
    logger.addHandler(records)
    try:
        with engine(model, store=store_path, prefix_caching=False, store_options=OPTIONS) as llm:
            answers, outputs = chat(llm, lambda i: {"dss": {"session_id": f"req{i}", **FIELDS}})
    finally:
        logger.removeHandler(records)
    assert answers == reference
    loaded = [out.kv_transfer_params["dss"]["loaded_tokens"] for out in outputs]
    assert loaded == [0, 32, 32, 32]  # the exact prefix: 40 tokens, one full page of 32
    near = [m for m in records.messages if "nearest stored version" in m]
    assert near and all("diverges at token 40" in m for m in near)
    with dss.open(store_path, **OPTIONS) as store:
        prompt_next = build(TURNS, answers)
        store.create_session("next", layout=store.session("req0", tenant_id="t").layout, **FIELDS)
        why = store.explain("next", prompt_next, tenant_id="t")
        assert why.nearest is not None and why.nearest.session_id == f"req{TURNS - 1}"
        assert (why.divergence, why.matched_tokens) == (SPLIT, 32)
        assert why.prompt_window[8:14] == line(TURNS)[:6] and why.stored_window[8:14] == line(TURNS - 1)[:6]
        assert (why.resync_prompt, why.resync_stored) == (SPLIT + 6, SPLIT + 6)
        stored = store.tokens(f"req{TURNS - 1}", tenant_id="t")
        kv = store.resume(f"req{TURNS - 1}", stored, tenant_id="t").matched_tokens  # the version's own pages
        assert why.would_reuse_tokens == kv > 32 and why.lost_tokens == kv - 32
        assert store.check() == []
