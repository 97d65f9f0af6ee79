"""The test servers (:mod:`tests.servers`): a bare machine's run starts real throwaway servers,
uses them, says so, and leaves nothing behind; a machine with servers running keeps them.

These start real PostgreSQL and Redis processes on free loopback ports, beside the machine's
own servers, which they never touch.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import dss
from tests import servers
from tests.conftest import LAYOUT, pages_for

ROOT = Path(__file__).resolve().parents[1]


def test_throwaway_postgresql_holds_a_store_and_leaves_nothing(tmp_path: Path) -> None:
    server = servers.start_postgres(user="postgres", database="dsstest")
    assert server.is_throwaway
    assert server.url.startswith("postgresql+psycopg://postgres@127.0.0.1:") and server.url.endswith("/dsstest")
    assert server.version.startswith("18.")
    assert server.folder is not None and server.folder.is_dir()
    try:
        assert servers.answers(server.url, 0)
        running = servers.postgres(server.url)  # what a later run finds there: a server already running
        assert (running.url, running.version, running.is_throwaway) == (server.url, server.version, False)
        running.stop()  # leaves a server this run did not start alone
        assert servers.answers(server.url, 0)
        tokens = list(range(12))
        with dss.open(tmp_path / "store", catalog_url=server.url) as store:
            store.create_session("chat", user_id="u", tenant_id="t", layout=LAYOUT)
            store.commit("chat", tokens, pages_for(tokens), tenant_id="t")
        with dss.open(tmp_path / "store", catalog_url=server.url) as store:
            assert store.resume("chat", tokens + [99], tenant_id="t").matched_tokens == 12
            assert store.check() == []
    finally:
        server.stop()
    assert server.process is not None and server.process.returncode is not None
    assert not servers.answers(server.url, 0)
    assert not server.folder.exists()


def test_a_run_with_nothing_at_the_test_url_starts_a_throwaway_postgresql_and_says_so() -> None:
    unused = servers.free_port()
    env = {**os.environ, "DSS_TEST_PG_URL": f"postgresql+psycopg://postgres@127.0.0.1:{unused}/test"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/catalog/test_catalog.py::test_fresh_catalog_is_at_the_current_revision[postgresql]",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.search(
        r"^PostgreSQL 18\.\S+: a throwaway server this run started at "
        r"postgresql\+psycopg://postgres@127\.0\.0\.1:(\d+)/test \(in (\S+); stopped and removed\)$",
        run.stdout,
        re.MULTILINE,
    )
    assert found, run.stdout
    assert int(found[1]) != unused
    assert "1 passed" in run.stdout.splitlines()[-1]
    assert not servers.answers(f"postgresql://127.0.0.1:{found[1]}", 0)
    assert not Path(found[2]).exists()


def test_throwaway_redis_answers_and_leaves_nothing() -> None:
    server = servers.start_redis()
    assert server.is_throwaway and server.url.startswith("redis://127.0.0.1:")
    assert re.fullmatch(r"\d+\.\d+\.\d+", server.version)
    try:
        running = servers.redis(server.url)
        assert (running.url, running.is_throwaway) == (server.url, False)
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\nv1\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n")
            reply = b""
            while not reply.endswith(b"v1\r\n"):
                reply += sock.recv(100)
        assert reply == b"+OK\r\n$2\r\nv1\r\n"
    finally:
        server.stop()
    assert not servers.answers(server.url, 0)
    assert server.folder is not None and not server.folder.exists()


def test_throwaway_redis_cluster_has_three_masters_and_leaves_nothing() -> None:
    cluster = servers.start_redis_cluster()
    assert cluster.url.startswith("redis+cluster://127.0.0.1:") and len(cluster.ports) == 3
    try:
        client = servers.redis_client(cluster.url)
        masters = {f"127.0.0.1:{port}" for port in cluster.ports}
        assert {node.name for node in client.get_primaries()} == masters and client.get_replicas() == []
        assert client.cluster_info()["cluster_state"] == "ok"
        keys = [f"k{i}" for i in range(30)]
        client.mset_nonatomic({key: key for key in keys})
        assert {client.get_node_from_key(key).name for key in keys} == masters
        assert client.mget_nonatomic(keys) == [key.encode() for key in keys]
        client.close()
    finally:
        cluster.stop()
    assert all(node.process is not None and node.process.returncode is not None for node in cluster.nodes)
    assert not any(servers.answers(f"redis://127.0.0.1:{port}", 0) for port in cluster.ports)
    assert not cluster.folder.exists()


def test_the_run_summary_names_the_postgresql_it_used(pytestconfig) -> None:
    """This very run: the conftest chose a server and every PostgreSQL test uses its URL."""
    from tests import conftest

    chosen = conftest.SERVERS["PostgreSQL"]
    assert conftest.PG_URL == chosen.url == os.environ["DSS_TEST_PG_URL"]
    assert chosen.describe().startswith(f"PostgreSQL {chosen.version}: ")
    assert servers.answers(chosen.url, 5432)


def test_postgresql_tools_are_copied_where_another_user_can_reach_them() -> None:
    """Under root the server runs as ``nobody``; a wheel installed in a private folder is copied out."""
    with tempfile.TemporaryDirectory() as top:
        Path(top).chmod(0o755)  # /tmp and this folder let others through; "home" does not
        private = Path(top) / "home"
        install = private / "site" / "pkg" / "pginstall"
        (install / "bin").mkdir(parents=True)
        (private / "site" / "pkg.libs").mkdir()
        (private / "site" / "pkg.libs" / "libpq-1234.so.5").write_bytes(b"libpq")
        (install / "lib").mkdir()
        (install / "bin" / "postgres").write_bytes(b"#!/bin/sh\n")
        (install / "bin" / "postgres").chmod(0o700)
        (install / "lib" / "libpq.so").write_bytes(b"lib")
        (install / "lib" / "libpq.so").chmod(0o600)
        private.chmod(0o700)
        dest = Path(top) / "run"
        dest.mkdir()
        copy = servers._reachable_by_others(install, dest)
        assert copy == dest / "site" / "pkg" / "pginstall"
        assert (dest / "site" / "pkg.libs" / "libpq-1234.so.5").read_bytes() == b"libpq"
        assert (copy / "lib" / "libpq.so").read_bytes() == b"lib"
        assert stat.S_IMODE((copy / "bin" / "postgres").stat().st_mode) == 0o705
        assert stat.S_IMODE((copy / "lib" / "libpq.so").stat().st_mode) == 0o604
        assert stat.S_IMODE((copy / "bin").stat().st_mode) & 0o005 == 0o005
        private.chmod(0o755)
        assert servers._reachable_by_others(install, Path(top) / "unused") == install
