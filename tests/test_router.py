"""``dss route`` (dss/service/router.py) over real HTTP, in front of two stand-in OpenAI servers
(tests/fake_openai.py) that echo what they receive and which node they are.

The router opens the test's store folder, where session ``chat-1`` has two pages stored: it
counts them on every node's disk tier, and on the device tier of the node it last sent the
session to, so the session stays there; once that node is SIGKILLed, the session fails over
to the other node. Requests without a session are keyed by their prompt (bounded-load
hashing); a session given by header is written into the body's ``kv_transfer_params``;
streams pass through chunk by chunk; errors are problem details.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import dss
from dss.routing import ring_order
from dss.service.router import head_holdings, parse_backends, request_key, with_session
from tests.conftest import LAYOUT
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]


def wait_http(url: str, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, f"{what} exited ({process.returncode})"
        assert time.monotonic() < deadline, f"{what} did not start"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def start(command: list[str], health: str, what: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(health, process, what)
    return process


@contextmanager
def running_fleet(tmp_path: Path, *router_args: str,
                  home: Path | None = None) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]]]]:
    """Two stand-in backends ``a`` and ``b`` and ``dss route`` in front of them, on the store at
    ``home`` (default: a new one holding session ``chat-1`` with two pages)."""
    if home is None:
        home = tmp_path / "store"
        with dss.open(home) as store:
            store.create_session("chat-1", layout=LAYOUT)
            store.commit("chat-1", list(range(9)), {0: b"a" * 16, 1: b"b" * 16})
    ports = {"a": free_port(), "b": free_port()}
    backends = {node: start([sys.executable, "-m", "tests.fake_openai", node, str(port)],
                            f"http://127.0.0.1:{port}/health", f"backend {node}") for node, port in ports.items()}
    port = free_port()
    router = start([sys.executable, "-m", "dss", "route", "--home", str(home), "--port", str(port),
                    "--health-interval", "0.2", "--log-level", "warning", *router_args,
                    *[f"--backend={node}=http://127.0.0.1:{p}" for node, p in ports.items()]],
                   f"http://127.0.0.1:{port}/healthz", "dss route")
    try:
        yield f"http://127.0.0.1:{port}", backends
    finally:
        for process in (router, *backends.values()):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            process.wait(30)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]]]]:
    """:func:`running_fleet` with the default policy, kv."""
    with running_fleet(tmp_path) as running:
        yield running


def test_kv_goes_to_the_node_whose_disk_holds_the_pages(tmp_path: Path, pg_url: str) -> None:
    """Two nodes on one PostgreSQL catalog; chat-1's pages are on the disk of the node the ring
    would not pick, so the first request (nothing served yet) shows the catalog decides."""
    by_ring = ring_order(("a", "b"), "\0chat-1")[0]
    holder = "b" if by_ring == "a" else "a"
    for node in ("a", "b"):
        with dss.open(tmp_path / node, catalog_url=pg_url, node_id=node) as store:
            if node == holder:
                store.create_session("chat-1", layout=LAYOUT)
                store.commit("chat-1", list(range(9)), {0: b"a" * 16, 1: b"b" * 16})
    with running_fleet(tmp_path, "--catalog-url", pg_url, home=tmp_path / by_ring) as (url, _):
        got = httpx.post(f"{url}/v1/completions", headers={"X-Session-Id": "chat-1"}, json={"prompt": "w1"})
        assert (got.json()["node"], got.headers["x-dss-route"]) == (holder, "kv")
        got = httpx.post(f"{url}/v1/completions", headers={"X-Session-Id": "chat-2"}, json={"prompt": "w1"})
        assert (got.json()["node"], got.headers["x-dss-route"]) == (ring_order(("a", "b"), "\0chat-2")[0], "hash")


def test_round_robin_alternates_and_hash_sticks(tmp_path: Path) -> None:
    body = {"model": "tiny", "prompt": "w1", "kv_transfer_params": {"dss": {"session_id": "chat-1"}}}
    with running_fleet(tmp_path, "--policy", "round_robin", "--no-store") as (url, _):
        answers = [httpx.post(f"{url}/v1/completions", json=body) for _ in range(4)]
        assert [a.headers["x-dss-route"] for a in answers] == ["round_robin"] * 4
        nodes = [a.json()["node"] for a in answers]
        assert nodes in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    with running_fleet(tmp_path / "hash", "--policy", "hash") as (url, _):
        answers = [httpx.post(f"{url}/v1/completions", json=body) for _ in range(3)]
        expected = ring_order(("a", "b"), "\0chat-1")[0]
        assert [(a.json()["node"], a.headers["x-dss-route"]) for a in answers] == [(expected, "hash")] * 3


def test_sessions_stay_on_their_node_and_fail_over(fleet: tuple[str, dict[str, subprocess.Popen[bytes]]]) -> None:
    url, backends = fleet
    first_choice = ring_order(("a", "b"), "\0chat-1")[0]  # both hold the pages on disk: the ring breaks the tie
    other = "b" if first_choice == "a" else "a"
    nodes = []
    for turn in range(4):
        got = httpx.post(f"{url}/v1/chat/completions", headers={"X-Session-Id": "chat-1"},
                         json={"model": "tiny", "messages": [{"role": "user", "content": f"turn {turn}"}]})
        assert got.status_code == 200, got.text
        assert got.headers["x-dss-route"] == "kv"
        assert got.json()["node"] == got.headers["x-dss-node"]
        nodes.append(got.json()["node"])
        assert got.json()["body"]["kv_transfer_params"] == {"dss": {"session_id": "chat-1"}}
    assert nodes == [first_choice] * 4
    backends[first_choice].send_signal(signal.SIGKILL)
    backends[first_choice].wait()
    got = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w1 w2",
                                                    "kv_transfer_params": {"dss": {"session_id": "chat-1"}}})
    assert got.status_code == 200, got.text
    assert (got.json()["node"], got.headers["x-dss-route"]) == (other, "kv")
    assert got.json()["body"]["kv_transfer_params"] == {"dss": {"session_id": "chat-1"}}
    health = httpx.get(f"{url}/healthz").json()
    assert health["backends"][first_choice]["healthy"] is False and health["backends"][other]["healthy"] is True
    metrics = httpx.get(f"{url}/metrics").text
    assert f'dss_router_requests_total{{node="{first_choice}",reason="kv",status="200"}} 4.0' in metrics
    assert f'dss_router_requests_total{{node="{other}",reason="kv",status="200"}} 1.0' in metrics
    assert f'dss_router_backend_healthy{{node="{first_choice}"}} 0.0' in metrics
    backends[other].send_signal(signal.SIGKILL)
    backends[other].wait()
    got = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w1"})
    assert got.status_code == 503
    assert got.headers["content-type"] == "application/problem+json"
    assert got.json()["kind"] == "NoBackend"


def test_streams_pass_through_and_requests_without_a_session_hash(
        fleet: tuple[str, dict[str, subprocess.Popen[bytes]]]) -> None:
    url, _ = fleet
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/completions",
                      json={"model": "tiny", "prompt": "hello", "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["x-dss-route"] == "hash"
        node = response.headers["x-dss-node"]
        lines = []
        for line in response.iter_lines():
            if line:
                lines.append(line)
                arrivals.append(time.monotonic())
    assert lines == [f'data: {{"node": "{node}", "i": {i}}}' for i in range(3)] + ["data: [DONE]"]
    assert arrivals[-1] - arrivals[0] >= 0.5  # passed through as they came, not buffered
    same = {httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello"}).json()["node"]
            for _ in range(3)}
    assert same == {node}
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert (bad.status_code, bad.json()["kind"]) == (400, "InvalidInput")
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_request_keys_and_holdings() -> None:
    body = {"prompt": "abc", "kv_transfer_params": {"dss": {"session_id": "s", "tenant_id": "t"}}}
    assert request_key(body, {}) == ("s", "t", request_key({"prompt": "abc"}, {})[2])
    assert request_key({"prompt": "abc"}, {"x-session-id": "h", "x-tenant-id": "acme"})[:2] == ("h", "acme")
    assert request_key({}, {}) == (None, None, None)
    assert with_session({"prompt": "x"}, {"x-session-id": "h", "x-tenant-id": "acme", "x-user-id": "u"}) == \
        {"prompt": "x", "kv_transfer_params": {"dss": {"session_id": "h", "tenant_id": "acme", "user_id": "u"}}}
    assert with_session(body, {"x-session-id": "h"}) is None  # the body names its own session
    # pages 0-1 on a's disk, 2 on b's, 3 on the disk of a folder the backends share, 4 remote only
    assert head_holdings(["a", "a", "b", "shared", None], "b", ["a", "b"]) == \
        {"a": {"disk": 3}, "b": {"disk": 2, "device": 5}}
    assert head_holdings(["shared"] * 3, None, ["a", "b"]) == {"a": {"disk": 3}, "b": {"disk": 3}}
    assert head_holdings([], "b", ["a", "b"]) == {}
    assert parse_backends(["a=http://h:1/", "http://h:2"]) == (("a", "http://h:1"), ("node-1", "http://h:2"))
    with pytest.raises(dss.ConfigError, match="--backend 'a=ftp://x' is not NODE=http://host:port"):
        parse_backends(["a=ftp://x"])


@pytest.mark.parametrize("args, message", [
    (["--backend", "ftp://x"], "error: ConfigError: --backend 'ftp://x' is not NODE=http://host:port\n"),
    (["--backend", "a=http://h:1", "--backend", "a=http://h:2"],
     "error: ConfigError: invalid router configuration: backends: Value error, node ids must differ\n"),
    (["--backend", "a=http://h:1", "--load-factor", "0.5"],
     "error: ConfigError: invalid router configuration: load_factor: Input should be greater than or equal to 1\n"),
])
def test_route_refuses_bad_settings(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from dss.cli.main import main

    result = CliRunner().invoke(main, ["route", *args])
    assert (result.exit_code, result.output) == (1, message)
