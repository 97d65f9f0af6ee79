"""vLLM's OpenAI-compatible server with the dss connector (:mod:`api_servers`: started as users
start it on the CPU build), spoken to over real HTTP, on SmolLM2-135M-Instruct (real weights,
its ChatML template).

A two-turn chat across a server restart: the second server loads the first turn's pages
(``kv_transfer_params`` in the response says how many tokens), and both replies are exactly
those of the same server without dss. The servers run in float32, so the oracle is no cache at
all (in bf16 a prefix computed in another step rounds differently; see the SmolLM2 notes). The
token counts come from the responses (``return_token_ids``): turn 2 loads every full page of
turn 1 that its prompt repeats.

Three server starts (with dss, with dss again after a restart, without dss), each about 30-60 s
on two cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from dss.approx import nearest
from tests.api_servers import SESSION, api_server, reply, wait_for_pages
from tests.engines import BLOCK
from tests.real_chat import FOLLOW_UP, QUESTION, SYSTEM

pytestmark = pytest.mark.slow

NAME = "smollm2"


def chat(url: str, messages: list[dict[str, str]], max_tokens: int, dss_fields: dict[str, Any] | None) -> Any:
    """One greedy chat completion with its token ids (``return_token_ids``), answered 200; its JSON."""
    body: dict[str, Any] = {
        "model": NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    if dss_fields is not None:
        body["kv_transfer_params"] = {"dss": dss_fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def turn2(first: Any) -> list[dict[str, str]]:
    """The second turn's messages: turn 1's, its reply, the follow-up question."""
    return [*TURN1, {"role": "assistant", "content": reply(first)}, {"role": "user", "content": FOLLOW_UP}]


def tokens(response: Any) -> list[int]:
    """The prompt's token ids, then the reply's: what the connector commits for the turn."""
    return [*response["prompt_token_ids"], *response["choices"][0]["token_ids"]]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids two lists share."""
    return nearest.common_prefix(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def test_a_chat_across_a_server_restart_loads_the_first_turns_pages(smollm2_model: Path, tmp_path: Path) -> None:
    with api_server(smollm2_model, None, tmp_path, name=NAME) as plain:
        ref1 = chat(plain, TURN1, 24, None)
        ref2 = chat(plain, turn2(ref1), 12, None)
    store = tmp_path / "store"
    with api_server(smollm2_model, store, tmp_path, name=NAME) as first:
        one = chat(first, TURN1, 24, SESSION)
        saved = (len(tokens(one)) - 1) // BLOCK  # the last token's KV is never computed
        wait_for_pages(store, saved)  # vLLM's default shutdown kills the workers: let the writes land first
    with api_server(smollm2_model, store, tmp_path, name=NAME) as second:
        two = chat(second, turn2(one), 12, SESSION)
    assert "Paris" in reply(ref1) and reply(ref2)
    assert (reply(one), reply(two)) == (reply(ref1), reply(ref2))
    assert (tokens(one), tokens(two)) == (tokens(ref1), tokens(ref2))
    repeated = min(common_prefix(tokens(one), two["prompt_token_ids"]), len(two["prompt_token_ids"]) - 1)
    assert saved >= 3 and repeated // BLOCK >= saved - 1
    assert one["kv_transfer_params"] == {
        "dss": {
            "session_id": "chat-1",
            "version_id": 1,
            "num_tokens": len(tokens(one)),
            "loaded_tokens": 0,
            "engine_cached_tokens": 0,
            "result": "miss",
        }
    }
    assert two["kv_transfer_params"] == {
        "dss": {
            "session_id": "chat-1",
            "version_id": 2,
            "num_tokens": len(tokens(two)),
            "loaded_tokens": min(saved, repeated // BLOCK) * BLOCK,
            "engine_cached_tokens": 0,
            "result": "hit",
        }
    }
    assert ref2.get("kv_transfer_params") is None
