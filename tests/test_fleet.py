"""A fleet: three nodes (three store folders, three processes) on one PostgreSQL catalog and one Redis.

Every test runs real servers: the suite's PostgreSQL (a fresh schema per test) and Redis (a
key prefix of its own per test; the restart test starts a Redis of its own on a free port, so
stopping it disturbs nobody). Tests of the remote tier run twice: on the single Redis and on
a three-master Redis Cluster (``remote_url``, see ``tests/conftest.py``). Nodes are
:mod:`tests.fleet_child` processes; where a test needs to look inside a node, the node is a
store opened in this process.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

import dss
from tests import servers
from tests.conftest import _pg_schema
from tests.crash_child import LAYOUT, payload

ROOT = Path(__file__).resolve().parents[1]
PAGE_TOKENS = LAYOUT.page_tokens


class Node:
    """A :mod:`tests.fleet_child` process: one command a line, one answer a line."""

    def __init__(self, folder: Path, url: str, remote_url: str, prefix: str, node_id: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_child", str(folder), url, remote_url, prefix, node_id],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.read() == "ready"

    def read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise AssertionError(f"the node died: {self.process.stderr.read() if self.process.stderr else ''}")
        return line.strip()

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.read()

    def resume(self, session_id: str) -> tuple[int, dict[str, int], int, int]:
        """``(matched tokens, tokens per tier, pages read byte-exact, pages missed)``."""
        kind, matched, tiers, exact, missed = self.ask(f"resume {session_id}").split()
        assert kind == "resumed"
        return int(matched), json.loads(tiers), int(exact), int(missed)

    def check(self) -> list[str]:
        kind, _, problems = self.ask("check").partition(" ")
        assert kind == "checked"
        return json.loads(problems)

    def close(self) -> None:
        if self.process.poll() is None:
            self.send("exit")
            self.process.wait(30)


@pytest.fixture
def fleet_url() -> Iterator[str]:
    """A fresh PostgreSQL schema: the fleet's catalog."""
    yield from _pg_schema()


@pytest.fixture
def prefix(remote_url: str) -> Iterator[str]:
    """A key prefix of this test's own in the test's Redis (its keys are deleted afterwards)."""
    value = f"t{uuid.uuid4().hex[:10]}:"
    yield value
    servers.delete_prefix(remote_url, value)


ON_REDIS_ONLY = pytest.mark.parametrize("remote_url", ["redis"], indirect=True)
"""For tests about the catalog rather than the remote tier: the single Redis is enough."""


@pytest.fixture
def nodes(tmp_path: Path, fleet_url: str, remote_url: str, prefix: str) -> Iterator[list[Node]]:
    """Three nodes on the test's catalog and Redis prefix (closed at the end)."""
    started: list[Node] = []
    try:
        for name in ("a", "b", "c"):
            started.append(Node(tmp_path / name, fleet_url, remote_url, prefix, f"node-{name}"))
        yield started
    finally:
        for node in started:
            node.close()


def keys_of(remote_url: str, prefix: str) -> list[bytes]:
    """Every key under ``prefix`` (on every master of a cluster)."""
    client = servers.redis_client(remote_url)
    try:
        return sorted(client.scan_iter(match=f"{prefix}*"))
    finally:
        client.close()


def test_a_session_committed_on_one_node_resumes_on_another_from_the_remote_tier(
    nodes: list[Node], remote_url: str, prefix: str
) -> None:
    a, b, c = nodes
    assert a.ask("commit chat-1 alice 40") == "ack 1 40"
    assert a.ask("flush") == "flushed True"
    assert a.resume("chat-1") == (40, {"host": 40}, 5, 0)  # the writer keeps them in host
    assert b.resume("chat-1") == (40, {"remote": 40}, 5, 0)
    assert b.resume("chat-1") == (40, {"host": 40}, 5, 0)  # promoted to host by the read
    assert c.resume("chat-1") == (40, {"remote": 40}, 5, 0)
    keys = keys_of(remote_url, prefix)
    assert len(keys) == 5
    assert not any(b"alice" in k or b"chat-1" in k for k in keys)  # no user or session id in a key name
    client = servers.redis_client(remote_url)
    tokens = [i % 1000 for i in range(40)]
    values = [client.get(k) for k in keys]
    client.close()
    assert all(v is not None and v.startswith(b"dssr v1") for v in values)
    assert not any(payload(tokens, i)[:64] in v for i in range(5) for v in values)  # sealed, as on disk
    assert [n.check() for n in nodes] == [[], [], []]


@ON_REDIS_ONLY
def test_a_node_killed_mid_write_loses_no_acknowledged_commit(
    tmp_path: Path, fleet_url: str, redis_url: str, prefix: str
) -> None:
    a = Node(tmp_path / "a", fleet_url, redis_url, prefix, "node-a")
    b = Node(tmp_path / "b", fleet_url, redis_url, prefix, "node-b")
    try:
        a.send("loop victim bob")
        acks = [a.read() for _ in range(12)]
        os.kill(a.process.pid, signal.SIGKILL)
        a.process.wait(10)
        assert a.process.returncode == -signal.SIGKILL
        last = int(acks[-1].split()[2])
        matched, tiers, exact, missed = b.resume("victim")
        assert b.check() == []
    finally:
        b.close()
        a.close()
    with dss.open(
        tmp_path / "b", catalog_url=fleet_url, remote_url=redis_url, remote_prefix=prefix, node_id="node-b"
    ) as store:
        tokens = store.tokens("victim")
        assert len(tokens) >= last and tokens[:last] == [i % 1000 for i in range(last)]
        versions = {v.version_id: v.num_tokens for v in store.versions("victim")}
        for ack in acks:
            _, version_id, num_tokens = ack.split()
            assert versions[int(version_id)] == int(num_tokens)
    # every page B read is byte-exact; the last pages may miss (A died before writing them through)
    assert exact + missed == matched // PAGE_TOKENS and exact > 0 and set(tiers) <= {"remote"}
    with dss.open(
        tmp_path / "a", catalog_url=fleet_url, remote_url=redis_url, remote_prefix=prefix, node_id="node-a"
    ) as store:  # node A comes back: every acknowledged page is on its disk
        tokens = store.tokens("victim")
        result = store.resume("victim", tokens)
        assert result.matched_tokens == len(tokens) // PAGE_TOKENS * PAGE_TOKENS
        assert store.read_pages(result.pages) == [payload(tokens, i) for i in range(len(tokens) // PAGE_TOKENS)]
        assert store.check() == []


def test_forget_user_leaves_none_of_their_keys_in_redis(
    nodes: list[Node], tmp_path: Path, remote_url: str, prefix: str
) -> None:
    a, b, _ = nodes
    assert a.ask("commit erin-1 erin 40") == "ack 1 40"
    assert a.ask("commit frank-1 frank 24") == "ack 2 24"
    assert b.ask("commit erin-2 erin 16 500").startswith("ack ")
    assert a.ask("flush") == "flushed True" and b.ask("flush") == "flushed True"
    assert b.resume("erin-1") == (40, {"remote": 40}, 5, 0)
    assert len(keys_of(remote_url, prefix)) == 5 + 3 + 2
    assert len(os.listdir(tmp_path / "b" / "segments")) == 1
    assert a.ask("forget erin") == "forgot 7 verified"
    assert len(page_keys_of(remote_url, prefix)) == 3  # frank's pages only (and erin's fence)
    # Node B answers from the catalog at once, and hears of the erasure within the bound (NOTIFY,
    # else its poll): its next call after that catches up and drops its file of erin.
    deadline = time.monotonic() + 5
    while not (
        b.ask("resume erin-1").startswith("error UnknownSession") and os.listdir(tmp_path / "b" / "segments") == []
    ):
        assert time.monotonic() < deadline, "node B did not drop its file of erin within 5 s"
        time.sleep(0.05)
    assert b.resume("frank-1") == (24, {"remote": 24}, 3, 0)
    assert [n.check() for n in nodes] == [[], [], []]


def page_keys_of(remote_url: str, prefix: str) -> list[bytes]:
    """The page keys under ``prefix`` (an erasure's fence, ``...:fence``, holds no page)."""
    return [k for k in keys_of(remote_url, prefix) if not k.endswith(b":fence")]


def test_an_erasure_fences_the_namespace_while_another_node_commits_in_a_loop(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    """Node B commits to a session of ``bea`` in a loop (each write-through racing to Redis)
    while node A erases ``bea``, pausing 0.5 s before each step (so the fence stands 0.5 s
    while the key still exists, then 0.5 s more with the key destroyed): A's erasure ends
    verified at the first try; once it began, no write of B succeeds again (``ErasureInProgress``
    while B's session exists, ``UnknownSession`` once it is purged); no page key of the
    namespace is left in Redis (only its fence, which holds no data); the catalog has one job,
    ``done``, and no row of ``bea``."""
    a = Node(tmp_path / "a", fleet_url, remote_url, prefix, "node-a")
    b = Node(tmp_path / "b", fleet_url, remote_url, prefix, "node-b")
    lines: list[str] = []
    arrived: list[float] = []
    began = tmp_path / "began"

    def read_b() -> None:
        assert b.process.stdout is not None
        for line in b.process.stdout:
            arrived.append(time.time())
            lines.append(line.strip())

    try:
        b.send("loop chat bea")
        threading.Thread(target=read_b, daemon=True).start()
        assert wait_for(lambda: sum(line.startswith("ack ") for line in lines) >= 3, 20.0), lines
        answer = a.ask(f"forget bea 0.5 {began}")
        kind, removed, status = answer.split()
        assert (kind, status) == ("forgot", "verified") and int(removed) > 0
        assert wait_for(lambda: "error UnknownSession" in lines, 10.0), lines[-5:]
        os.kill(b.process.pid, signal.SIGKILL)  # B stops: nothing it queued can land later
        b.process.wait(10)
    finally:
        b.close()
        a.close()
    first_error = next(i for i, line in enumerate(lines) if line.startswith("error "))
    assert all(line.startswith("ack ") for line in lines[:first_error])
    # a commit that was in its transaction when the job was recorded answers within ms; none later
    assert arrived[first_error - 1] < float(began.read_text()) + 0.2, (arrived[first_error - 1], began.read_text())
    after = lines[first_error:]
    assert set(after) <= {"error ErasureInProgress", "error UnknownSession"}, sorted(set(after))
    assert after.count("error ErasureInProgress") >= 10  # the fence held for 0.5 s at least, B retrying every 10 ms
    assert after.index("error UnknownSession") > after.index("error ErasureInProgress")
    time.sleep(0.3)
    assert page_keys_of(remote_url, prefix) == []
    fences = [k for k in keys_of(remote_url, prefix) if k.endswith(b":fence")]
    client = servers.redis_client(remote_url)
    assert len(fences) == 1 and client.get(fences[0]) == b"1"
    client.close()
    engine = sa.create_engine(fleet_url)
    with engine.connect() as conn:
        jobs = [tuple(r) for r in conn.execute(sa.text("SELECT user_id, state, finished_at IS NOT NULL FROM erasures"))]
        users = conn.execute(sa.text("SELECT user_id FROM users")).all()
    engine.dispose()
    assert (jobs, users) == ([("bea", "done", True)], [])


@ON_REDIS_ONLY
def test_another_nodes_commit_arrives_by_notification_within_the_bound(
    tmp_path: Path, fleet_url: str, redis_url: str, prefix: str
) -> None:
    """With polling every 60 s, only a notification can tell node C of A's commit in under 2 s."""
    a = Node(tmp_path / "a", fleet_url, redis_url, prefix, "node-a")
    try:
        with dss.open(
            tmp_path / "c",
            catalog_url=fleet_url,
            remote_url=redis_url,
            remote_prefix=prefix,
            node_id="node-c",
            feed_poll_s=60,
        ) as c:
            assert a.ask("commit chat dana 16") == "ack 1 16"
            assert c.resume("chat", [i % 1000 for i in range(16)]).matched_tokens == 16  # C caches the session now
            time.sleep(0.5)  # the poll C makes right after connecting is behind it
            assert a.ask("commit chat dana 16") == "ack 2 32"
            acked = time.monotonic()
            tokens = [i % 1000 for i in range(32)]
            while c.resume("chat", tokens).matched_tokens < 32:
                assert time.monotonic() - acked < 2.0, "node C did not hear of node A's commit within 2 s"
                time.sleep(0.01)
            assert c.listener is not None and c.listener.heard >= 1
            assert c.check() == []
    finally:
        a.close()


def test_without_a_notification_a_node_polls_the_catalog_within_feed_poll_s(tmp_path: Path, fleet_url: str) -> None:
    """A write that sends no NOTIFY (as if it were lost) reaches the node's epoch by polling."""
    with dss.open(tmp_path / "c", catalog_url=fleet_url, feed_poll_s=0.3) as c:
        engine = sa.create_engine(fleet_url)
        with engine.begin() as conn:
            seq = conn.execute(sa.text("UPDATE catalog_seq SET seq = seq + 1 WHERE id = 1 RETURNING seq")).scalar_one()
        engine.dispose()
        assert c.listener is not None
        heard = c.listener.heard
        assert wait_for(lambda: c._epoch.read() == seq, 1.5)
        assert c.listener.heard == heard
        assert c.check() == []


# -- Redis and PostgreSQL failing ---------------------------------------------------------------


class OwnRedis:
    """A redis-server of this test's own (persistence off), stopped and started at will."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = servers.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                servers.redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def shutdown(self) -> None:
        """``redis-cli shutdown nosave`` (the same command through redis-py where there is no redis-cli)."""
        if shutil.which("redis-cli"):
            subprocess.run(
                ["redis-cli", "-p", str(self.port), "shutdown", "nosave"],
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            try:
                redis.Redis(port=self.port).shutdown(nosave=True)
            except redis.ConnectionError:
                pass  # it closes the connection as it goes
        assert self.process is not None
        self.process.wait(20)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.shutdown()


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_connections(url: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection of the nodes (those with ``application_name``:
    nobody else's, the server is shared); how many."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            return len(
                conn.execute(
                    sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :name"),
                    {"name": application_name},
                ).all()
            )
    finally:
        engine.dispose()


@pytest.mark.slow
def test_redis_restarted_and_catalog_connections_killed_degrade_and_recover(
    tmp_path: Path, fleet_url: str, own_redis: OwnRedis
) -> None:
    prefix = "dss:"
    name = f"dss-test-{uuid.uuid4().hex[:8]}"
    url = f"{fleet_url}&application_name={name}"
    a = Node(tmp_path / "a", url, own_redis.url, prefix, "node-a")
    b = Node(tmp_path / "b", url, own_redis.url, prefix, "node-b")
    try:
        assert a.ask("commit chat gil 16") == "ack 1 16"
        assert a.ask("flush") == "flushed True"
        assert b.resume("chat") == (16, {"remote": 16}, 2, 0)
        own_redis.shutdown()
        assert a.ask("commit chat gil 16") == "ack 2 32"  # no error: the pages wait for the remote tier
        assert a.ask("flush") == "flushed False"
        assert b.resume("chat") == (32, {"host": 16, "remote": 16}, 2, 2)  # degraded: the new pages miss
        assert a.resume("chat") == (32, {"host": 32}, 4, 0)  # the writer still serves its own
        assert kill_connections(fleet_url, name) >= 4  # two nodes' pools and listeners
        assert a.ask("commit chat gil 16") == "ack 3 48"
        assert wait_for(lambda: b.resume("chat")[0] == 48, 3.0)  # B's listener reconnected and caught up
        assert b.resume("chat") == (48, {"host": 16, "remote": 32}, 2, 4)
        own_redis.start()
        assert a.ask("flush") == "flushed True"  # what waited is written now
        assert wait_for(lambda: b.resume("chat")[2] == 6, 3.0)  # recovered (its breaker lets a probe through)
        assert b.resume("chat") == (48, {"host": 48}, 6, 0)
        assert a.check() == [] and b.check() == []
    finally:
        a.close()
        b.close()


# -- the remote tier alone ----------------------------------------------------------------------


def test_an_unreachable_remote_tier_misses_counts_and_opens_its_breaker() -> None:
    from dss.tiers.remote import BREAKER_FAILURES, RemoteTier

    tier = RemoteTier(f"redis://127.0.0.1:{servers.free_port()}/0", prefix="x:", timeout_s=0.2, max_pending_bytes=100)
    try:
        assert tier.is_up
        for _ in range(BREAKER_FAILURES):
            assert tier.get(["x:{00}:01", "x:{00}:02"]) == [None, None]
        assert not tier.is_up and tier.errors["get"] == BREAKER_FAILURES
        started = time.monotonic()
        assert tier.get(["x:{00}:01"]) == [None]  # the breaker is open: no connection attempt
        assert time.monotonic() - started < 0.05 and tier.errors["get"] == BREAKER_FAILURES
        tier.put([("x:{00}:01", b"a" * 60), ("x:{00}:02", b"b" * 60)])  # over 100 bytes: the oldest goes
        assert tier.pending_bytes == 60
        assert not tier.flush(0.3)
    finally:
        tier.close()


def test_a_remote_value_that_is_not_the_page_is_a_miss(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    options = {"catalog_url": fleet_url, "remote_url": remote_url, "remote_prefix": prefix}
    tokens = list(range(16))
    with dss.open(tmp_path / "a", node_id="node-a", **options) as a:
        a.create_session("s", user_id="hal", layout=LAYOUT)
        a.commit("s", tokens, {i: payload(tokens, i) for i in range(2)})
        assert a.remote is not None and a.remote.flush()
    client = servers.redis_client(remote_url)
    first, second = sorted(client.scan_iter(match=f"{prefix}*"))
    value = bytearray(client.get(first))
    value[-1] ^= 1
    client.set(first, bytes(value))  # a flipped bit
    client.delete(second)  # evicted
    client.close()
    with dss.open(tmp_path / "b", node_id="node-b", **options) as b:
        result = b.resume("s", tokens)
        assert result.tiers == {"remote": 16}
        assert b.read_pages(result.pages) == [None, None]
        assert b.remote is not None and b.remote.errors["verify"] == 1
        assert b.check() == []


def test_a_folder_joins_a_fleet_only_when_named(tmp_path: Path, fleet_url: str) -> None:
    with dss.open(tmp_path / "a", catalog_url=fleet_url) as a:
        assert a.node.ref == 1
    with pytest.raises(dss.ConfigError, match="set node_id to join it as another node"):
        dss.open(tmp_path / "b", catalog_url=fleet_url)
    with dss.open(tmp_path / "b", catalog_url=fleet_url, node_id="node-b") as b:
        assert b.node == (2, "node-b")
    with pytest.raises(dss.ConfigError, match="node id 'node-b' is taken by another store folder"):
        dss.open(tmp_path / "c", catalog_url=fleet_url, node_id="node-b")
    with pytest.raises(dss.ConfigError, match="is node 'node-b' of its catalog, not 'other'"):
        dss.open(tmp_path / "b", catalog_url=fleet_url, node_id="other")


def test_each_node_evicts_and_counts_only_its_own_files(tmp_path: Path, fleet_url: str) -> None:
    """Two nodes with disks of 3 segments each: node A overflowing its disk drops only its own
    oldest segments; node B's files, pages and byte count are untouched."""

    def tokens_of(k: int) -> list[int]:
        return [k * 100 + i for i in range(16)]

    with dss.open(tmp_path / "b", catalog_url=fleet_url, node_id="node-b", host_bytes=0) as b:
        b.create_session("b", user_id="ivy", layout=LAYOUT)
        b.commit("b", tokens_of(0), {i: payload(tokens_of(0), i) for i in range(2)})
        segment = b.stats()["disk"]["bytes"]
        assert segment > 0
    with (
        dss.open(
            tmp_path / "a", catalog_url=fleet_url, node_id="node-a", host_bytes=0, disk_bytes=3 * segment, mover=False
        ) as a,
        dss.open(tmp_path / "b", catalog_url=fleet_url, node_id="node-b", host_bytes=0) as b,
    ):
        for k in range(1, 6):
            a.create_session(f"a{k}", user_id="ivy", layout=LAYOUT)
            a.commit(f"a{k}", tokens_of(k), {i: payload(tokens_of(k), i) for i in range(2)})
        disk = a.stats()["disk"]
        assert (disk["pages"], disk["bytes"], disk["capacity"], disk["evictions"]) == (6, 3 * segment, 3 * segment, 4)
        assert b.stats()["disk"]["pages"] == 2 and b.stats()["disk"]["bytes"] == segment
        assert [a.resume(f"a{k}", tokens_of(k)).matched_tokens for k in range(1, 6)] == [0, 0, 16, 16, 16]
        result = b.resume("b", tokens_of(0))
        assert result.tiers == {"disk": 16}
        assert b.read_pages(result.pages) == [payload(tokens_of(0), i) for i in range(2)]
        assert len(os.listdir(tmp_path / "a" / "segments")) == 3 and len(os.listdir(tmp_path / "b" / "segments")) == 1
        assert a.check() == [] and b.check() == []


def test_an_erasure_with_redis_down_stays_open_until_it_can_delete_the_keys(
    tmp_path: Path, fleet_url: str, own_redis: OwnRedis
) -> None:
    tokens = list(range(24))
    with dss.open(
        tmp_path / "a", catalog_url=fleet_url, remote_url=own_redis.url, node_id="node-a", remote_timeout_s=0.3
    ) as a:
        a.create_session("s", user_id="jo", layout=LAYOUT)
        a.commit("s", tokens, {i: payload(tokens, i) for i in range(3)})
        assert a.remote is not None and a.remote.flush()
        own_redis.shutdown()
        with pytest.raises(dss.ErasureIncomplete, match="the remote tier cannot be reached"):
            a.forget_user("jo", tenant_id="default")
        with pytest.raises(dss.ErasureInProgress):
            a.resume("s", tokens)
        own_redis.start()
        client = redis.Redis(port=own_redis.port)
        client.set(b"dss:{" + b"ab" * 12 + b"}:" + b"cd" * 16, b"x")  # another namespace's key stays
        receipt = a.forget_user("jo", tenant_id="default")
        assert isinstance(receipt, dss.Receipt) and receipt.verification.ok
        assert receipt.removed.tiers["remote"].pages == 0  # the restarted Redis kept nothing (nosave)
        check = next(c for c in receipt.verification.checks if c.name == "remote tier")
        assert check.ok and check.detail.startswith("0 of 3 sampled page ids and 0 keys of the user's namespace")
        assert "AOF/RDB files hold only pages sealed under the destroyed key" in check.detail
        assert client.dbsize() == 2 and len(client.keys("dss:*:fence")) == 1  # the other key, jo's fence
        client.close()
        assert a.check() == []


def test_the_receipt_counts_the_remote_keys_it_deleted(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    tokens = list(range(24))
    with dss.open(
        tmp_path / "a", catalog_url=fleet_url, remote_url=remote_url, remote_prefix=prefix, node_id="node-a"
    ) as a:
        a.create_session("s", user_id="kim", layout=LAYOUT)
        a.commit("s", tokens, {i: payload(tokens, i) for i in range(3)})
        assert a.remote is not None and a.remote.flush()
        assert len(keys_of(remote_url, prefix)) == 3
        receipt = a.forget_user("kim", tenant_id="default")
        assert isinstance(receipt, dss.Receipt) and receipt.verification.ok
        assert receipt.removed.tiers["remote"].pages == 3
        assert page_keys_of(remote_url, prefix) == [] and len(keys_of(remote_url, prefix)) == 1  # the fence


# -- remote keys of pages gone from every tier --------------------------------------------------


def key_hexes(remote_url: str, prefix: str) -> set[str]:
    """The page ids (hex) of the keys under ``prefix``."""
    return {k.decode().rsplit(":", 1)[1] for k in keys_of(remote_url, prefix)}


def test_a_deleted_sessions_pages_leave_the_remote_tier_and_shared_ones_stay(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    tokens, other = list(range(24)), [*range(16), *[999] * 8]  # "t" shares pages 0 and 1 with "s"
    with dss.open(
        tmp_path / "a", catalog_url=fleet_url, remote_url=remote_url, remote_prefix=prefix, node_id="node-a"
    ) as a:
        for session_id, user_id, these in (("s", "lee", tokens), ("t", "lee", other), ("u", "mo", tokens)):
            a.create_session(session_id, user_id=user_id, layout=LAYOUT)
            a.commit(session_id, these, {i: payload(these, i) for i in range(3)})
        assert a.remote is not None and a.remote.flush()
        ids = {
            name: [p.page_id.hex() for p in a.resume(name, these).pages]
            for name, these in (("s", tokens), ("t", other), ("u", tokens))
        }
        assert ids["s"][:2] == ids["t"][:2] and not set(ids["u"]) & set(ids["s"])
        assert key_hexes(remote_url, prefix) == {*ids["s"], *ids["t"], *ids["u"]}
        assert a.delete_session("s") == 1  # pages 0 and 1 stay: "t" holds them
        assert a.remote.flush()
        assert key_hexes(remote_url, prefix) == {*ids["t"], *ids["u"]}
        assert a.delete_session("t") == 3
        assert a.remote.flush()
        assert key_hexes(remote_url, prefix) == set(ids["u"])
        assert a.remote.errors == dict.fromkeys(a.remote.errors, 0)
        assert a.check() == []


def test_a_quarantined_pages_remote_key_is_deleted(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    tokens = list(range(24))
    with dss.open(
        tmp_path / "a",
        catalog_url=fleet_url,
        remote_url=remote_url,
        remote_prefix=prefix,
        node_id="node-a",
        host_bytes=0,
    ) as a:
        a.create_session("s", user_id="nia", layout=LAYOUT)
        a.commit("s", tokens, {i: payload(tokens, i) for i in range(3)})
        assert a.remote is not None and a.remote.flush()
        ids = [p.page_id.hex() for p in a.resume("s", tokens).pages]
        assert key_hexes(remote_url, prefix) == set(ids)
        ((offset, length),) = a.sql(
            'SELECT l."offset", l.length FROM page_locations l JOIN pages p '
            "ON p.page_id = l.page_id WHERE p.page_index = 1"
        ).rows
        (segment,) = (tmp_path / "a" / "segments").iterdir()
        data = bytearray(segment.read_bytes())
        data[offset + length - 1] ^= 0x40  # the last byte of page 1's record
        segment.write_bytes(bytes(data))
        assert a.read_pages(a.resume("s", tokens).pages) == [payload(tokens, 0), None, payload(tokens, 2)]
        assert a.remote.flush()
        assert key_hexes(remote_url, prefix) == {ids[0], ids[2]}
        assert a.check() == []


def test_pages_a_full_disk_evicted_keep_their_remote_keys(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str
) -> None:
    """Eviction is one node's disk making room: its pages' keys are left to Redis's own
    eviction. (The catalog keeps one disk copy of a page in the fleet, so it drops an evicted
    page: no node asks for that key again.)"""

    def tokens_of(k: int) -> list[int]:
        return [k * 100 + i for i in range(16)]

    options = {"catalog_url": fleet_url, "remote_url": remote_url, "remote_prefix": prefix, "host_bytes": 0}
    with dss.open(tmp_path / "a", node_id="node-a", **options) as a:
        a.create_session("a0", user_id="oz", layout=LAYOUT)
        a.commit("a0", tokens_of(0), {i: payload(tokens_of(0), i) for i in range(2)})
        segment = a.stats()["disk"]["bytes"]
    with dss.open(tmp_path / "a", node_id="node-a", disk_bytes=2 * segment, mover=False, **options) as a:
        for k in range(1, 4):
            a.create_session(f"a{k}", user_id="oz", layout=LAYOUT)
            a.commit(f"a{k}", tokens_of(k), {i: payload(tokens_of(k), i) for i in range(2)})
        assert a.stats()["disk"]["evictions"] == 4
        assert [a.resume(f"a{k}", tokens_of(k)).matched_tokens for k in range(4)] == [0, 0, 16, 16]
        assert a.remote is not None and a.remote.flush()
        assert len(key_hexes(remote_url, prefix)) == 8
        assert a.check() == []


def test_a_deletion_redis_cannot_take_now_never_fails_the_write(
    tmp_path: Path, fleet_url: str, own_redis: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis paused for writes (``CLIENT PAUSE``): deleting the session succeeds at once; the
    deletion of its keys fails, is counted and logged, and is done once Redis takes writes again."""
    tokens = list(range(24))
    caplog.set_level(logging.WARNING, logger="dss.tiers.remote")
    with dss.open(
        tmp_path / "a", catalog_url=fleet_url, remote_url=own_redis.url, node_id="node-a", remote_timeout_s=0.3
    ) as a:
        a.create_session("s", user_id="pat", layout=LAYOUT)
        a.commit("s", tokens, {i: payload(tokens, i) for i in range(3)})
        assert a.remote is not None and a.remote.flush()
        client = redis.Redis(port=own_redis.port)
        assert client.dbsize() == 3
        client.client_pause(3000, all=False)  # writes wait 3 s; reads go on
        assert a.delete_session("s") == 3
        assert wait_for(lambda: a.remote is not None and a.remote.errors["delete"] >= 1, 3.0)
        assert client.dbsize() == 3 and a.remote.errors["put"] == 0
        assert any("remote tier unreachable (delete" in r.getMessage() for r in caplog.records)
        assert a.remote.flush(15)
        assert client.dbsize() == 0
        client.close()
        assert a.check() == []


@pytest.mark.parametrize("remote_url", ["cluster"], indirect=True)
def test_a_stopped_cluster_master_degrades_resumes_and_never_fails_a_request(
    tmp_path: Path, fleet_url: str, remote_url: str, prefix: str, redis_cluster: servers.RedisCluster
) -> None:
    """The master holding the user's slot stops (its keys are lost: no persistence): node B's
    reads miss, node A's commits go on; once it is back, what A wrote meanwhile reaches it."""
    options = {"catalog_url": fleet_url, "remote_url": remote_url, "remote_prefix": prefix, "remote_timeout_s": 0.3}
    tokens = [i % 1000 for i in range(32)]
    with (
        dss.open(tmp_path / "a", node_id="node-a", **options) as a,
        dss.open(tmp_path / "b", node_id="node-b", **options) as b,
    ):
        a.create_session("chat", user_id="quin", layout=LAYOUT)
        a.commit("chat", tokens[:16], {i: payload(tokens, i) for i in range(2)})
        assert a.remote is not None and a.remote.flush()
        client = servers.redis_client(remote_url)
        port = client.get_node_from_key(keys_of(remote_url, prefix)[0]).port
        client.close()
        stopped = redis_cluster.ports.index(port)
        redis_cluster.stop_node(stopped)
        try:
            result = b.resume("chat", tokens[:16])
            assert result.tiers == {"remote": 16}
            assert b.read_pages(result.pages) == [None, None]  # degraded: a miss, no error
            a.commit("chat", tokens, {i: payload(tokens, i) for i in range(2, 4)})
            assert not a.remote.flush(0.5)
            assert b.remote is not None and not b.remote.is_up and b.remote.errors["get"] >= 1
        finally:
            redis_cluster.start_node(stopped)
            redis_cluster.wait_ok()
        assert a.remote.flush(20)
        expected = [None, None, payload(tokens, 2), payload(tokens, 3)]  # pages 0 and 1 went with the master
        assert wait_for(lambda: b.read_pages(b.resume("chat", tokens).pages) == expected, 10.0)
        assert b.remote.is_up
        assert a.check() == [] and b.check() == []
