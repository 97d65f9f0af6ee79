"""The documentation's blocks that need the real model or an engine (slow): the vLLM quick start
(the README's and the vLLM page's, one text), the offline ``vllm.LLM`` example, the
transformers adapter and the model helper. Each test reads its blocks by their ``run-by`` marker
and runs them as a reader would, in a fresh folder, with SmolLM2-135M-Instruct from the model
cache (the ``smollm2_model`` fixture converts it once). The blocks are scripts and shell text,
so they run in processes of their own rather than on the suite's in-process engines.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.docblocks import blocks_run_by
from tests.servers import free_port
from tests.test_docs_servers import page_env

pytestmark = pytest.mark.slow

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""A small KV cache for the CPU build (its default takes gigabytes)."""


def run_python(text: str, folder: Path, timeout_s: int = 900) -> str:
    (folder / "block.py").write_text(text)
    done = subprocess.run(
        [sys.executable, "block.py"],
        check=False,
        cwd=folder,
        env={**page_env(folder), **ENGINE_ENV},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_model_helper_block(tmp_path: Path, smollm2_model: Path) -> None:
    (block,) = blocks_run_by("test_the_model_helper_block")
    assert Path(run_python(block.text, tmp_path).strip()) == smollm2_model


@pytest.mark.timeout(900)
def test_the_transformers_block(tmp_path: Path, smollm2_model: Path) -> None:
    """The second turn loads the first turn's full pages (at least one) from dss."""
    (block,) = blocks_run_by("test_the_transformers_block")
    loaded, total = map(
        int,
        re.search(
            r"^(\d+) of (\d+) prompt tokens loaded from dss$", run_python(block.text, tmp_path), re.MULTILINE
        ).groups(),
    )  # type: ignore[union-attr]
    assert loaded >= 32 and loaded % 32 == 0 and loaded < total


@pytest.mark.timeout(900)
def test_the_offline_vllm_block(tmp_path: Path, smollm2_model: Path) -> None:
    """One chat request through ``vllm.LLM`` with the connector commits version 1 of ``chat-1``."""
    (block,) = blocks_run_by("test_the_offline_vllm_block")
    out = run_python(block.text, tmp_path)
    printed = [line for line in out.splitlines() if line.startswith("{'dss': ")]  # vLLM logs to stdout too
    params = ast.literal_eval(printed[-1])
    assert params["dss"]["session_id"] == "chat-1" and params["dss"]["loaded_tokens"] == 0
    assert params["dss"]["version_id"] is not None


def answers(output: str) -> list[dict[str, Any]]:
    """The ``kv_transfer_params["dss"]`` of each chat completion the block printed."""
    decoder = json.JSONDecoder()
    found, at = [], 0
    while (start := output.find('{"id"', at)) != -1:
        value, at = decoder.raw_decode(output, start)
        found.append(value["kv_transfer_params"]["dss"])
    return found


def run_quick_start(text: str, folder: Path, port: int) -> str:
    """The quick start as one shell script, then the server stopped (the pages of its last answer
    given a moment to reach the disk first, as a reader's next command would)."""
    script = text.replace("8000", str(port)) + "sleep 3\nkill -TERM $!\nwait\n"
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=folder,
        env={**page_env(folder), **ENGINE_ENV},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=900)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err[-4000:]
    return out


@pytest.mark.timeout(1800)
def test_the_vllm_quick_start(tmp_path: Path, smollm2_model: Path) -> None:
    """The README's quick start is the vLLM page's; on a warm server the repeated question is
    vLLM's own prefix-cache hit; after a restart the same question loads its pages from disk."""
    readme, page = blocks_run_by("test_the_vllm_quick_start")
    assert readme.page.name == "README.md" and readme.text == page.text
    port = free_port()
    warm = run_quick_start(page.text, tmp_path, port)
    first, again = answers(warm)
    assert (first["result"], first["loaded_tokens"], again["result"]) == ("miss", 0, "engine")
    assert first["session_id"] == "chat-1" and again["version_id"] > first["version_id"]
    restarted = run_quick_start(page.text, tmp_path, port)
    after, _ = answers(restarted)
    assert after["result"] == "hit" and after["loaded_tokens"] >= 32 and after["loaded_tokens"] % 32 == 0
    disk = re.search(r'^vllm:dss_loaded_tokens_total\{[^}]*tier="disk"[^}]*\} (\S+)$', restarted, re.MULTILINE)
    assert disk is not None and float(disk.group(1)) == after["loaded_tokens"]
