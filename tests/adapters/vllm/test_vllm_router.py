"""``dss route`` in front of two vLLM CPU OpenAI servers with the dss connector: a three-turn
chat goes where its KV is, fails over when that server dies, and answers exactly what a
server without dss answers.

Both servers open one store folder (and its SQLite catalog): the disk tier is shared, so the
server that takes over reads the pages the dead one wrote. (Separate folders on separate
hosts share pages through the remote tier instead.) The router opens the same folder to ask
which pages of a session's head are stored. The model is the tiny random Llama of
:mod:`engines` with a word-level tokenizer (token ``i`` is the word ``w<i>``) and a chat
template that joins the messages' contents, so the conversation's token ids are known exactly
(pages of 32 tokens)::

    turn 1: user1 (100)                            -> reply1 (30)  new session: hashed to node X
    turn 2: + reply1 + user2 (40) = 170 tokens     -> reply2 (8)   kv: X (it served turn 1), loads 128
    X is SIGKILLed
    turn 3: + reply2 + user3 (20) = 198 tokens     -> reply3 (8)   kv fails over to Y, loads 160
                                                                   (turn 2 committed 178 tokens: 5 pages)

Three vLLM server starts (one without dss for the reference, then two with it at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_servers import SESSION, api_server, launch, reply, stop, wait_for_pages, wait_ready
from tests.engines import VOCAB, make_tiny_llama, prompt
from tests.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2}
NAME = "tiny"


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


USER1 = {"role": "user", "content": words(prompt(1, 100))}
USER2 = {"role": "user", "content": words(prompt(2, 40))}
USER3 = {"role": "user", "content": words(prompt(3, 20))}


def chat(
    url: str, messages: list[dict[str, str]], max_tokens: int, dss_fields: dict[str, Any] | None
) -> tuple[Any, httpx.Headers]:
    """One greedy chat completion (special tokens barred, so replies are plain words), answered
    200; the answer and the response headers."""
    body: dict[str, Any] = {
        "model": NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(i): -100 for i in SPECIAL.values()},
    }
    if dss_fields is not None:
        body["kv_transfer_params"] = {"dss": dss_fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json(), response.headers


def conversation(url: str, dss_fields: dict[str, Any] | None, between: Any = None) -> list[tuple[Any, httpx.Headers]]:
    """The three turns; ``between(turns)`` runs after turn 2."""
    turn1 = chat(url, [USER1], 30, dss_fields)
    history = [USER1, {"role": "assistant", "content": reply(turn1[0])}, USER2]
    turn2 = chat(url, history, 8, dss_fields)
    if between is not None:
        between([turn1, turn2])
    history += [{"role": "assistant", "content": reply(turn2[0])}, USER3]
    return [turn1, turn2, chat(url, history, 8, dss_fields)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("model") / "tiny-chat")


def test_the_router_follows_the_kv_and_fails_over(model: Path, tmp_path: Path) -> None:
    with api_server(model, None, tmp_path, name=NAME, max_model_len=512) as plain:
        reference = [r for r, _ in conversation(plain, None)]
    store = tmp_path / "store"
    servers = {node: launch(model, store, tmp_path, name=NAME, max_model_len=512) for node in ("a", "b")}
    router = None
    try:
        for process, url, log in servers.values():
            wait_ready(process, url, log)
        port = free_port()
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dss",
                "route",
                "--home",
                str(store),
                "--port",
                str(port),
                "--health-interval",
                "0.5",
                *[f"--backend={node}={url}" for node, (_, url, _) in servers.items()],
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        proxy = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < deadline, "dss route did not start"
            try:
                if httpx.get(f"{proxy}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        def kill_the_first(turns: list[tuple[Any, httpx.Headers]]) -> None:
            # the engine's pages reach the store after its answer (a background writer): wait
            # for turn 2's five pages, so the kill tests fail-over, not a save still in flight
            wait_for_pages(store, 5)
            process = servers[turns[0][1]["x-dss-node"]][0]
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

        turns = conversation(proxy, SESSION, between=kill_the_first)
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        for process, _, _ in servers.values():
            stop(process)
    (turn1, h1), (turn2, h2), (turn3, h3) = turns
    first, other = h1["x-dss-node"], ("b" if h1["x-dss-node"] == "a" else "a")
    assert [(h["x-dss-node"], h["x-dss-route"]) for h in (h1, h2, h3)] == [
        (first, "hash"),
        (first, "kv"),
        (other, "kv"),
    ]
    assert [reply(r) for r in (turn1, turn2, turn3)] == [reply(r) for r in reference]
    assert [r["usage"]["prompt_tokens"] for r in (turn1, turn2, turn3)] == [100, 170, 198]
    assert [r["kv_transfer_params"]["dss"]["loaded_tokens"] for r in (turn1, turn2, turn3)] == [0, 128, 160]
