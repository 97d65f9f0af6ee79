"""The documentation's blocks that need a server: ``dss serve`` with a client, and a fleet node on
PostgreSQL and Redis. Each test reads its blocks out of the page by their ``run-by`` marker
(:func:`tests.docblocks.blocks_run_by`) and runs them as written; the only changes are the
addresses (a free port for the service; the suite's own PostgreSQL schema and Redis for the
fleet's ``db.internal`` and ``cache.internal``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.docblocks import blocks_run_by
from tests.servers import free_port
from tests.test_docs import BIN, logical_lines


def page_env(folder: Path) -> dict[str, str]:
    """The environment a reader's shell would have in ``folder``: the venv's ``dss`` first, the
    store and the master key in the folder, no store settings of the test run's own."""
    env = {
        **os.environ,
        "DSS_HOME": str(folder / "dss-data"),
        "DSS_MASTER_KEY_FILE": str(folder / "master.key"),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
    }
    for name in ("DSS_CONFIG", "DSS_CATALOG_URL", "DSS_API_KEY", "DSS_SERVER_CONFIG", "DSS_REMOTE_URL", "DSS_NODE_ID"):
        env.pop(name, None)
    return env


def wait_healthy(url: str, process: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} never answered")


def test_the_service_blocks(tmp_path: Path) -> None:
    """The keys, ``dss serve`` and the client of the HTTP API page, in that order: the client
    creates a session, commits and resumes through the service with the key ``dss keys add``
    printed (given as ``DSS_API_KEY``)."""
    shell, client = blocks_run_by("test_the_service_blocks")
    assert (shell.language, client.language) == ("bash", "python")
    port = str(free_port())
    env = page_env(tmp_path)
    server = None
    key = None
    try:
        for line in logical_lines(shell.text.replace("8077", port)):
            if shlex.split(line, comments=True)[:2] == ["dss", "serve"]:
                server = subprocess.Popen(
                    ["bash", "-c", f"exec {line}"],
                    cwd=tmp_path,
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                wait_healthy(f"http://127.0.0.1:{port}/healthz", server)
                continue
            done = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, done.stderr
            key = key or re.search(r"^dss_\S+$", done.stdout, re.MULTILINE).group(0)  # type: ignore[union-attr]
        assert server is not None and key is not None
        (tmp_path / "client.py").write_text(client.text.replace("8077", port))
        done = subprocess.run(
            [sys.executable, "client.py"],
            cwd=tmp_path,
            env={**env, "DSS_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["32", "{'host':", "32}"]
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


def test_the_fleet_node_block(tmp_path: Path, pg_url: str, redis_url: str) -> None:
    """A node's set-up on the fleet page: its master key, its environment, ``dss db upgrade`` and
    ``dss check`` against the shared catalog and Redis."""
    (block,) = blocks_run_by("test_the_fleet_node_block")
    text = block.text.replace("postgresql+psycopg://dss@db.internal/dss", shlex.quote(pg_url)).replace(
        "redis://cache.internal:6379/0", redis_url
    )
    assert "db.internal" not in text and "cache.internal" not in text
    done = subprocess.run(
        ["bash", "-e", "-c", text], cwd=tmp_path, env=page_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "master.key").stat().st_size == 32
    assert (tmp_path / "node-1").is_dir()
