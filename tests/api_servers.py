"""vLLM's OpenAI-compatible server started as users start it on the CPU build
(``python -m vllm.entrypoints.openai.api_server``: ``vllm serve`` fails there, see the vLLM
guide), for the tests that speak to it over real HTTP (:mod:`test_vllm_openai_server`,
:mod:`test_vllm_router`). Imported by them, not a conftest.
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

import dss
from tests.engines import BLOCK, dss_config
from tests.servers import free_port

START_TIMEOUT_S = 420
SESSION = {"session_id": "chat-1", "tenant_id": "acme", "user_id": "u1"}
"""The session the server tests' chats carry in ``kv_transfer_params["dss"]``."""


def launch(
    model: Path, store: Path | None, logs: Path, *, name: str, max_model_len: int = 1024
) -> tuple[subprocess.Popen[bytes], str, Path]:
    """Start the server on ``model`` (served as ``name``) on a free port, in float32 without
    vLLM's prefix cache, eager, block 32, with the dss connector on ``store`` if given; return
    the process (its own process group), its base URL and its log file (in ``logs``), without
    waiting for it."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(BLOCK),
        "--max-num-seqs",
        "2",
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-enable-prefix-caching",
    ]
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
def api_server(model: Path, store: Path | None, logs: Path, *, name: str, max_model_len: int = 1024) -> Iterator[str]:
    """:func:`launch`, yield the base URL once ``/health`` answers, :func:`stop` on exit."""
    process, url, log = launch(model, store, logs, name=name, max_model_len=max_model_len)
    try:
        wait_ready(process, url, log)
        yield url
    finally:
        stop(process)


def wait_for_pages(store: Path, count: int, timeout_s: float = 60) -> None:
    """Wait until :data:`SESSION`'s head resumes ``count`` pages of 32 tokens (the connector
    writes pages in the background; the reply is sent before the last ones are on disk)."""
    deadline = time.monotonic() + timeout_s
    with dss.open(store) as handle:
        while True:
            history = handle.tokens(SESSION["session_id"], tenant_id=SESSION["tenant_id"])
            found = handle.resume(SESSION["session_id"], history, tenant_id=SESSION["tenant_id"]).matched_tokens
            if found >= count * BLOCK:
                return
            assert time.monotonic() < deadline, f"only {found} tokens of the session's head were saved"
            time.sleep(0.1)


def reply(response: dict[str, Any]) -> str:
    """The text of a chat completion's first choice."""
    return response["choices"][0]["message"]["content"]
