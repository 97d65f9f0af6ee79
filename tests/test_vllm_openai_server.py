"""vLLM's OpenAI-compatible server with the dss connector, started as users start it on the
CPU build (``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails there, see
the README), spoken to over real HTTP.

A two-turn chat across a server restart: the second server loads the first turn's pages
(``kv_transfer_params`` in the response says how many tokens), and both replies are exactly
those of the same server without dss. The model is the tiny random Llama of :mod:`engines`
with a word-level tokenizer (token ``i`` is the word ``w<i>``) and a chat template that joins
the messages' contents, so the conversation's token ids are known exactly::

    turn 1: user1 = 100 words                         -> reply1: 30 words   (KV of 129 tokens: pages 0-3 saved)
    turn 2: user1 + reply1 + user2 (40 words) = 170   -> reply2: 8 words    (pages 0-3 = 128 tokens loaded)

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
import pytest

from tests.engines import BLOCK, VOCAB, dss_config, make_tiny_llama, prompt
from tests.servers import free_port

pytestmark = pytest.mark.slow

SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2}
SESSION = {"session_id": "chat-1", "tenant_id": "acme", "user_id": "u1"}
START_TIMEOUT_S = 420


def make_chat_model(path: Path) -> Path:
    """The tiny Llama plus a word-level tokenizer and a chat template that joins the messages."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_tiny_llama(path)
    vocab = {**SPECIAL, **{f"w{i}": i for i in range(len(SPECIAL), VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    return path


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def launch(model: Path, store: Path | None) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start ``python -m vllm.entrypoints.openai.api_server`` on a free port, with the dss
    connector on ``store`` if given; return the process (its own process group), its base URL
    and its log file, without waiting for it."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--block-size", str(BLOCK), "--max-num-seqs", "2", "--seed", "0", "--host", "127.0.0.1",
               "--port", str(port), "--no-enable-prefix-caching"]
    if store is not None:
        command += ["--kv-transfer-config", json.dumps(dss_config(store))]
    log = (store or model).parent / f"server-{port}.log"
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
def api_server(model: Path, store: Path | None) -> Iterator[str]:
    """:func:`launch`, yield the base URL once ``/health`` answers, :func:`stop` on exit."""
    process, url, log = launch(model, store)
    try:
        wait_ready(process, url, log)
        yield url
    finally:
        stop(process)


def chat_response(url: str, messages: list[dict[str, str]], max_tokens: int,
                  dss_fields: dict[str, Any] | None) -> httpx.Response:
    """One greedy chat completion (special tokens barred, so replies are plain words), answered 200."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logit_bias": {str(i): -100 for i in SPECIAL.values()}}
    if dss_fields is not None:
        body["kv_transfer_params"] = {"dss": dss_fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response


def chat(url: str, messages: list[dict[str, str]], max_tokens: int, dss_fields: dict[str, Any] | None) -> Any:
    """:func:`chat_response`'s JSON."""
    return chat_response(url, messages, max_tokens, dss_fields).json()


USER1 = {"role": "user", "content": words(prompt(1, 100))}
USER2 = {"role": "user", "content": words(prompt(2, 40))}


def wait_for_pages(store: Path, count: int, timeout_s: float = 60) -> None:
    """Wait until the session's head resumes ``count`` pages (the connector writes pages in the
    background; the reply is sent before the last ones are on disk)."""
    import dss

    deadline = time.monotonic() + timeout_s
    with dss.open(store) as handle:
        while True:
            tokens = handle.tokens(SESSION["session_id"], tenant_id=SESSION["tenant_id"])
            found = handle.resume(SESSION["session_id"], tokens, tenant_id=SESSION["tenant_id"]).matched_tokens
            if found >= count * BLOCK:
                return
            assert time.monotonic() < deadline, f"only {found} tokens of the first turn were saved"
            time.sleep(0.2)


def reply(response: Any) -> str:
    return response["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")


def test_a_chat_across_a_server_restart_loads_the_first_turns_pages(model: Path, tmp_path: Path) -> None:
    with api_server(model, None) as plain:
        ref1 = chat(plain, [USER1], 30, None)
        ref2 = chat(plain, [USER1, {"role": "assistant", "content": reply(ref1)}, USER2], 8, None)
    store = tmp_path / "store"
    with api_server(model, store) as first:
        turn1 = chat(first, [USER1], 30, SESSION)
        wait_for_pages(store, 4)  # vLLM's default shutdown kills the workers: let the writes land first
    with api_server(model, store) as second:
        turn2 = chat(second, [USER1, {"role": "assistant", "content": reply(turn1)}, USER2], 8, SESSION)
    assert len(reply(ref1).split()) == 30 and len(reply(ref2).split()) == 8
    assert (reply(turn1), reply(turn2)) == (reply(ref1), reply(ref2))
    assert (turn1["usage"]["prompt_tokens"], turn2["usage"]["prompt_tokens"]) == (100, 170)
    assert turn1["kv_transfer_params"] == {"dss": {"session_id": "chat-1", "version_id": 1, "num_tokens": 130,
                                                   "loaded_tokens": 0, "engine_cached_tokens": 0, "result": "miss"}}
    assert turn2["kv_transfer_params"] == {"dss": {"session_id": "chat-1", "version_id": 2, "num_tokens": 178,
                                                   "loaded_tokens": 128, "engine_cached_tokens": 0, "result": "hit"}}
    assert ref2.get("kv_transfer_params") is None
