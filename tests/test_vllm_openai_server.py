"""vLLM's OpenAI-compatible server with the dss connector, started as users start it on the
CPU build (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails there, see
the vLLM guide), spoken to over real HTTP, on SmolLM2-135M-Instruct (real weights, its ChatML
template).

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

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import dss
from dss import nearest
from tests.engines import BLOCK, dss_config
from tests.real_chat import FOLLOW_UP, QUESTION, SYSTEM
from tests.servers import free_port

pytestmark = pytest.mark.slow

SESSION = {"session_id": "chat-1", "tenant_id": "acme", "user_id": "u1"}
START_TIMEOUT_S = 420
NAME = "smollm2"


def launch(model: Path, store: Path | None, logs: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on a free port, in float32 without
    vLLM's prefix cache, with the dss connector on ``store`` if given; return the process (its
    own process group), its base URL and its log file (in ``logs``), without waiting for it."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", NAME, "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
               "--block-size", str(BLOCK), "--max-num-seqs", "2", "--seed", "0", "--host", "127.0.0.1",
               "--port", str(port), "--no-enable-prefix-caching"]
    if store is not None:
        command += ["--kv-transfer-config", json.dumps(dss_config(store))]
    log = logs / f"server-{port}.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, f"http://127.0.0.1:{port}", log

def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Return once the server answers ``/health``; fail if it exits or takes too long."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, f"the server exited ({process.returncode}):\n{log.read_text()[-5000:]}"
        assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()[-5000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL of its process group after 60 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def api_server(model: Path, store: Path | None, logs: Path) -> Iterator[str]:
    """:func:`launch`, yield the base URL once ``/health`` answers, :func:`stop` on exit."""
    process, url, log = launch(model, store, logs)
    try:
        wait_ready(process, url, log)
        yield url
    finally:
        stop(process)


def chat(url: str, messages: list[dict[str, str]], max_tokens: int, dss_fields: dict[str, Any] | None) -> Any:
    """One greedy chat completion with its token ids (``return_token_ids``), answered 200; its JSON."""
    body: dict[str, Any] = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "return_token_ids": True}
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


def wait_for_pages(store: Path, count: int, timeout_s: float = 60) -> None:
    """Wait until the session's head resumes ``count`` pages (the connector writes pages in the
    background; the reply is sent before the last ones are on disk)."""
    deadline = time.monotonic() + timeout_s
    with dss.open(store) as handle:
        while True:
            history = handle.tokens(SESSION["session_id"], tenant_id=SESSION["tenant_id"])
            found = handle.resume(SESSION["session_id"], history, tenant_id=SESSION["tenant_id"]).matched_tokens
            if found >= count * BLOCK:
                return
            assert time.monotonic() < deadline, f"only {found} tokens of the first turn were saved"
            time.sleep(0.2)


def reply(response: Any) -> str:
    return response["choices"][0]["message"]["content"]


def test_a_chat_across_a_server_restart_loads_the_first_turns_pages(smollm2_model: Path, tmp_path: Path) -> None:
    with api_server(smollm2_model, None, tmp_path) as plain:
        ref1 = chat(plain, TURN1, 24, None)
        ref2 = chat(plain, turn2(ref1), 12, None)
    store = tmp_path / "store"
    with api_server(smollm2_model, store, tmp_path) as first:
        one = chat(first, TURN1, 24, SESSION)
        saved = (len(tokens(one)) - 1) // BLOCK  # the last token's KV is never computed
        wait_for_pages(store, saved)  # vLLM's default shutdown kills the workers: let the writes land first
    with api_server(smollm2_model, store, tmp_path) as second:
        two = chat(second, turn2(one), 12, SESSION)
    assert "Paris" in reply(ref1) and reply(ref2)
    assert (reply(one), reply(two)) == (reply(ref1), reply(ref2))
    assert (tokens(one), tokens(two)) == (tokens(ref1), tokens(ref2))
    repeated = min(common_prefix(tokens(one), two["prompt_token_ids"]), len(two["prompt_token_ids"]) - 1)
    assert saved >= 3 and repeated // BLOCK >= saved - 1
    assert one["kv_transfer_params"] == {"dss": {"session_id": "chat-1", "version_id": 1,
                                                 "num_tokens": len(tokens(one)), "loaded_tokens": 0,
                                                 "engine_cached_tokens": 0, "result": "miss"}}
    assert two["kv_transfer_params"] == {"dss": {"session_id": "chat-1", "version_id": 2,
                                                 "num_tokens": len(tokens(two)),
                                                 "loaded_tokens": min(saved, repeated // BLOCK) * BLOCK,
                                                 "engine_cached_tokens": 0, "result": "hit"}}
    assert ref2.get("kv_transfer_params") is None
