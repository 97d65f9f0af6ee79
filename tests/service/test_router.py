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

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

import dss
from dss.service.backends import head_holdings, parse_backends
from dss.service.proxying import request_key, with_session
from dss.service.routing import ring_order
from tests.conftest import LAYOUT
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


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


def start(command: list[str], health: str, what: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``command`` and wait until ``health`` answers; its stderr goes to ``log`` (default: nowhere)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log or os.devnull, "wb") as stderr:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    wait_http(health, process, what)
    return process


@contextmanager
def running_fleet(
    tmp_path: Path, *router_args: str, home: Path | None = None, log: Path | None = None
) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]]]]:
    """Two stand-in backends ``a`` and ``b`` and ``dss route`` in front of them, on the store at
    ``home`` (default: a new one holding session ``chat-1`` with two pages); yields the router's
    URL and the processes by name (``a``, ``b`` and ``router``). The router's stderr goes to
    ``log`` (default: nowhere)."""
    if home is None:
        home = tmp_path / "store"
        with dss.open(home) as store:
            store.create_session("chat-1", layout=LAYOUT)
            store.commit("chat-1", list(range(9)), {0: b"a" * 16, 1: b"b" * 16})
    ports = {"a": free_port(), "b": free_port()}
    backends = {
        node: start(
            [sys.executable, "-m", "tests.fake_openai", node, str(port)],
            f"http://127.0.0.1:{port}/health",
            f"backend {node}",
        )
        for node, port in ports.items()
    }
    port = free_port()
    router = start(
        [
            sys.executable,
            "-m",
            "dss",
            "route",
            "--home",
            str(home),
            "--port",
            str(port),
            "--health-interval",
            "0.2",
            "--log-level",
            "warning",
            *router_args,
            *[f"--backend={node}=http://127.0.0.1:{p}" for node, p in ports.items()],
        ],
        f"http://127.0.0.1:{port}/healthz",
        "dss route",
        log,
    )
    try:
        yield f"http://127.0.0.1:{port}", {**backends, "router": router}
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
        got = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"X-Session-Id": "chat-1"},
            json={"model": "tiny", "messages": [{"role": "user", "content": f"turn {turn}"}]},
        )
        assert got.status_code == 200, got.text
        assert got.headers["x-dss-route"] == "kv"
        assert got.json()["node"] == got.headers["x-dss-node"]
        nodes.append(got.json()["node"])
        assert got.json()["body"]["kv_transfer_params"] == {"dss": {"session_id": "chat-1"}}
    assert nodes == [first_choice] * 4
    backends[first_choice].send_signal(signal.SIGKILL)
    backends[first_choice].wait()
    got = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "w1 w2", "kv_transfer_params": {"dss": {"session_id": "chat-1"}}},
    )
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
    fleet: tuple[str, dict[str, subprocess.Popen[bytes]]],
) -> None:
    url, _ = fleet
    arrivals = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "stream": True}
    ) as response:
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
    same = {
        httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello"}).json()["node"] for _ in range(3)
    }
    assert same == {node}
    bad = httpx.post(f"{url}/v1/completions", content=b"{not json")
    assert (bad.status_code, bad.json()["kind"]) == (400, "InvalidInput")
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_request_keys_and_holdings() -> None:
    body = {"prompt": "abc", "kv_transfer_params": {"dss": {"session_id": "s", "tenant_id": "t"}}}
    assert request_key(body, {}) == ("s", "t", request_key({"prompt": "abc"}, {})[2])
    assert request_key({"prompt": "abc"}, {"x-session-id": "h", "x-tenant-id": "acme"})[:2] == ("h", "acme")
    assert request_key({}, {}) == (None, None, None)
    assert with_session({"prompt": "x"}, {"x-session-id": "h", "x-tenant-id": "acme", "x-user-id": "u"}) == {
        "prompt": "x",
        "kv_transfer_params": {"dss": {"session_id": "h", "tenant_id": "acme", "user_id": "u"}},
    }
    assert with_session(body, {"x-session-id": "h"}) is None  # the body names its own session
    # pages 0-1 on a's disk, 2 on b's, 3 on the disk of a folder the backends share, 4 remote only
    assert head_holdings(["a", "a", "b", "shared", None], "b", ["a", "b"]) == {
        "a": {"disk": 3},
        "b": {"disk": 2, "device": 5},
    }
    assert head_holdings(["shared"] * 3, None, ["a", "b"]) == {"a": {"disk": 3}, "b": {"disk": 3}}
    assert head_holdings([], "b", ["a", "b"]) == {}
    assert parse_backends(["a=http://h:1/", "http://h:2"]) == (("a", "http://h:1"), ("node-1", "http://h:2"))
    with pytest.raises(dss.ConfigError, match="--backend 'a=ftp://x' is not NODE=http://host:port"):
        parse_backends(["a=ftp://x"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "ftp://x"], "error: ConfigError: --backend 'ftp://x' is not NODE=http://host:port\n"),
        (
            ["--backend", "a=http://h:1", "--backend", "a=http://h:2"],
            "error: ConfigError: invalid router configuration: backends: Value error, node ids must differ\n",
        ),
        (
            ["--backend", "a=http://h:1", "--load-factor", "0.5"],
            "error: ConfigError: invalid router configuration: load_factor: Input should be greater than or equal to 1\n",
        ),
        (
            ["--backend", "a=http://h:1", "--max-body-bytes", "lots"],
            (
                "error: ConfigError: invalid router configuration: max_body_bytes: Value error, not a size: 'lots' "
                "(use e.g. 1073741824, '512MiB' or '2GB')\n"
            ),
        ),
        (
            ["--backend", "a=http://h:1", "--max-body-bytes", "512"],
            (
                "error: ConfigError: invalid router configuration: max_body_bytes: Input should be greater than or equal to "
                "1024\n"
            ),
        ),
        (
            ["--backend", "a=http://h:1", "--graceful-timeout", "-1"],
            (
                "error: ConfigError: invalid router configuration: graceful_timeout_s: Input should be greater than or equal "
                "to 0\n"
            ),
        ),
    ],
)
def test_route_refuses_bad_settings(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from dss.cli.main import main

    result = CliRunner().invoke(main, ["route", *args])
    assert (result.exit_code, result.output) == (1, message)


def test_bodies_nested_too_deep_or_unreadable_are_refused_on_a_connection_that_stays_usable(
    fleet: tuple[str, dict[str, subprocess.Popen[bytes]]],
) -> None:
    """Bodies nest at most 128 arrays and objects (the top-level object is the first); one that
    nests deeper (well-formed or not, deep enough to exhaust a recursive parser) or has a number
    too long to read is 400 ``InvalidInput``, and the same keep-alive connection then carries a
    good request."""
    url, _ = fleet
    deep = "the request body nests deeper than 128 levels of arrays and objects"
    at_limit = {"prompt": "w1", "tools": json.loads("[" * 127 + "]" * 127)}
    over_limit = {"prompt": "w1", "tools": json.loads("[" * 128 + "]" * 128)}
    cases = [
        (b"[" * 100_000, 400, deep),
        (json.dumps(over_limit).encode(), 400, deep),
        (b'{"prompt": ' + b"1" * 5000 + b"}", 400, "the request body has a number with too many digits"),
        (b"{not json", 400, "the request body is not JSON"),
    ]
    connection = http.client.HTTPConnection(*urlsplit(url).netloc.split(":"), timeout=10)
    try:
        for raw, status, detail in cases:
            connection.request("POST", "/v1/completions", body=raw, headers={"Content-Type": "application/json"})
            answer = connection.getresponse()
            assert (answer.status, answer.getheader("content-type"), json.loads(answer.read())) == (
                status,
                "application/problem+json",
                {
                    "type": "urn:dss:problem:InvalidInput",
                    "title": "InvalidInput",
                    "status": 400,
                    "detail": detail,
                    "kind": "InvalidInput",
                },
            )
            assert answer.getheader("connection") is None
        sock = connection.sock
        assert sock is not None
        connection.request(
            "POST", "/v1/completions", body=json.dumps(at_limit), headers={"Content-Type": "application/json"}
        )
        answer = connection.getresponse()
        assert (answer.status, json.loads(answer.read())["body"]) == (200, at_limit)
        assert connection.sock is sock  # the same connection all along
    finally:
        connection.close()


def rss_bytes(process: subprocess.Popen[bytes]) -> int:
    """The resident memory of a running process (Linux)."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {process.pid}")


def test_bodies_over_max_body_bytes_are_refused_while_they_stream(tmp_path: Path) -> None:
    """With ``--max-body-bytes 1MiB`` a body of exactly 1 MiB is forwarded; one byte more is 413
    ``PayloadTooLarge``, declared by Content-Length or sent chunked without one; 64 MiB bodies
    are refused without the router buffering them (its resident memory grows far less)."""
    limit = 1 << 20

    def body(size: int) -> bytes:
        raw = json.dumps({"model": "tiny", "prompt": "x" * (size - 32)}).encode()
        return raw + b" " * (size - len(raw))

    def chunked(raw: bytes, size: int = 64 << 10) -> Iterator[bytes]:
        for at in range(0, len(raw), size):
            yield raw[at : at + size]

    too_large = {
        "type": "urn:dss:problem:PayloadTooLarge",
        "title": "PayloadTooLarge",
        "status": 413,
        "detail": f"request bodies are limited to {limit} bytes (max_body_bytes)",
        "kind": "PayloadTooLarge",
    }
    with running_fleet(tmp_path, "--no-store", "--max-body-bytes", "1MiB") as (url, processes):
        assert len(body(limit)) == limit
        got = httpx.post(f"{url}/v1/completions", content=body(limit))
        assert (got.status_code, len(got.json()["body"]["prompt"])) == (200, limit - 32)
        got = httpx.post(f"{url}/v1/completions", content=chunked(body(limit)))
        assert (got.status_code, len(got.json()["body"]["prompt"])) == (200, limit - 32)
        for content in (body(limit + 1), chunked(body(limit + 1))):
            got = httpx.post(f"{url}/v1/completions", content=content)
            assert (got.status_code, got.headers["content-type"], got.json()) == (
                413,
                "application/problem+json",
                too_large,
            )
        before = rss_bytes(processes["router"])
        huge = body(64 << 20)
        for content in (huge, chunked(huge, 1 << 20)):
            got = httpx.post(f"{url}/v1/completions", content=content, timeout=60)
            assert (got.status_code, got.json()) == (413, too_large)
        assert rss_bytes(processes["router"]) - before < 16 << 20
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "w1"}).status_code == 200


def test_a_backend_cut_off_mid_stream_is_one_log_line_and_a_cut_response(tmp_path: Path) -> None:
    """The backend drops the connection after the first event: the client gets that event, then
    the response ends without its closing chunk (an incomplete response, never a clean end); the
    router logs one line naming the backend and the cause, no traceback, and counts the request
    with ``status="broken"``."""
    log = tmp_path / "router.log"
    with running_fleet(tmp_path, "--no-store", log=log) as (url, _):
        lines = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "stream": True, "cut_after": 1}
        ) as response:
            assert response.status_code == 200
            node = response.headers["x-dss-node"]
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                for line in response.iter_lines():
                    lines.append(line)  # noqa: PERF402 (one by one: the lines before the error stay)
        assert [line for line in lines if line] == [f'data: {{"node": "{node}", "i": 0}}']
        metrics = httpx.get(f"{url}/metrics").text
        assert f'dss_router_requests_total{{node="{node}",reason="hash",status="broken"}} 1.0' in metrics
        got = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello"})
        assert (got.status_code, got.json()["node"]) == (200, node)
    logged = log.read_text().splitlines()
    assert len(logged) == 1, logged
    assert re.fullmatch(
        rf"\S+ \S+ WARNING dss\.service\.router: backend {node} failed mid-response "
        r"\(RemoteProtocolError\): the response was cut off",
        logged[0],
    ), logged


def test_sigterm_cancels_requests_to_a_hung_backend_after_the_graceful_timeout(tmp_path: Path) -> None:
    """Two requests in flight on SIGTERM, one to a backend that never answers, one whose stream
    stalls after its first event; with ``--graceful-timeout 1`` the router gives them 1 s, then
    cancels them: the first is answered 503 ``Unavailable``, the second is cut off; it logs one
    line for each and exits, killed by the SIGTERM it had deferred (exit status -15, as ``dss
    serve``), well before the backends would have answered."""
    log = tmp_path / "router.log"
    answers: dict[str, object] = {}

    def hung() -> None:
        answers["hung"] = httpx.post(f"{url}/v1/completions", json={"prompt": "w1", "hang": True}, timeout=30)

    def stalled() -> None:
        lines = []
        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", timeout=30, json={"prompt": "w2", "stream": True, "hang_after": 1}
            ) as response:
                for line in response.iter_lines():
                    lines.append(line)  # noqa: PERF402 (one by one: the lines before the error stay)
        except httpx.RemoteProtocolError as exc:
            answers["stalled"] = (lines, str(exc))

    with running_fleet(tmp_path, "--no-store", "--graceful-timeout", "1", log=log) as (url, processes):
        threads = [threading.Thread(target=hung), threading.Thread(target=stalled)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while sum(b["load"] for b in httpx.get(f"{url}/healthz").json()["backends"].values()) < 2:
            assert time.monotonic() < deadline, "the requests did not reach the backends"
            time.sleep(0.05)
        time.sleep(0.3)  # the stalled stream's first event has gone out
        router = processes["router"]
        signalled = time.monotonic()
        router.send_signal(signal.SIGTERM)
        rc = router.wait(20)
        elapsed = time.monotonic() - signalled
        for thread in threads:
            thread.join(10)
    assert rc == -signal.SIGTERM
    assert 1.0 <= elapsed < 5.0, elapsed
    hung_answer = answers["hung"]
    assert isinstance(hung_answer, httpx.Response)
    assert (hung_answer.status_code, hung_answer.headers["connection"], hung_answer.json()) == (
        503,
        "close",
        {
            "type": "urn:dss:problem:Unavailable",
            "title": "Unavailable",
            "status": 503,
            "detail": "the router is shutting down (graceful_timeout_s passed)",
            "kind": "Unavailable",
        },
    )
    stalled_lines, stalled_error = answers["stalled"]  # type: ignore[misc]
    assert [line[:16] for line in stalled_lines if line] == ['data: {"node": "']  # the first event, no more
    assert "incomplete chunked read" in stalled_error
    logged = log.read_text()
    assert "Traceback" not in logged, logged
    ours = [line for line in logged.splitlines() if "dss.service.router" in line]
    assert sorted(re.sub(r"^\S+ \S+ ", "", line).replace(" a ", " X ").replace(" b ", " X ") for line in ours) == [
        "WARNING dss.service.router: request to backend X cancelled: the router is shutting down",
        "WARNING dss.service.router: response of backend X cut off: the router is shutting down",
    ], logged
