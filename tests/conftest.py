"""Shared fixtures: stores on every catalog dss supports (SQLite embedded, PostgreSQL).

PostgreSQL tests use the server at ``DSS_TEST_PG_URL`` (default 127.0.0.1:5432, database
``test``, trust auth), each in a schema of its own that is dropped afterwards; where nothing
answers there, the run starts a throwaway server of its own (:mod:`tests.servers`). They run,
never skip, and the run's summary says which server they used.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import dss
from dss.catalog.reader import reader_role
from tests import servers

PG_URL = os.environ.get("DSS_TEST_PG_URL", servers.PG_DEFAULT)
"""The PostgreSQL the tests use; :func:`pytest_configure` replaces it by a throwaway server's if none answers."""
SERVERS: dict[str, servers.Server | servers.RedisCluster] = {}


def pytest_configure(config: pytest.Config) -> None:
    """One master key for the whole run, outside every store folder, and a PostgreSQL (children inherit both)."""
    import tempfile

    global PG_URL
    if "DSS_MASTER_KEY_FILE" not in os.environ:
        os.environ["DSS_MASTER_KEY_FILE"] = os.path.join(tempfile.mkdtemp(prefix="dss-test-keys-"), "master.key")
    SERVERS["PostgreSQL"] = servers.postgres(PG_URL)
    PG_URL = os.environ["DSS_TEST_PG_URL"] = SERVERS["PostgreSQL"].url


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the servers this run started (a server that was already running is left alone)."""
    for server in SERVERS.values():
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which servers the run used, so a bare machine's throwaway server is never a surprise."""
    terminalreporter.section("servers")
    for kind in ("PostgreSQL", "Redis", "Redis Cluster"):
        line = SERVERS[kind].describe() if kind in SERVERS else f"{kind}: not used by these tests"
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The URL of the Redis the tests use: the one at ``DSS_TEST_REDIS_URL`` or a throwaway one."""
    if "Redis" not in SERVERS:
        SERVERS["Redis"] = servers.redis()
        os.environ["DSS_TEST_REDIS_URL"] = SERVERS["Redis"].url
    return SERVERS["Redis"].url


@pytest.fixture(scope="session")
def redis_cluster() -> servers.RedisCluster:
    """A throwaway Redis Cluster of three masters (:func:`tests.servers.start_redis_cluster`),
    started on first use and stopped when the run ends. A test that stops one of its masters
    starts it again and waits for ``cluster_state:ok`` before it returns."""
    if "Redis Cluster" not in SERVERS:
        SERVERS["Redis Cluster"] = servers.start_redis_cluster()
    cluster = SERVERS["Redis Cluster"]
    assert isinstance(cluster, servers.RedisCluster)
    return cluster


@pytest.fixture(params=["redis", "cluster"])
def remote_url(request: pytest.FixtureRequest) -> str:
    """The remote tier's Redis: the suite's single Redis (:func:`redis_url`), then the Redis Cluster."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("redis_cluster").url


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The folder of SmolLM2-135M-Instruct in bf16 (real weights; converted once into the model
    cache by :func:`dss_adapters.models.smollm2`, about a minute the first time)."""
    from dss_adapters.models import smollm2

    return smollm2()


LAYOUT = dss.Layout(name="test", page_tokens=4, page_bytes=16, model="tiny", dtype="int8")


def _pg_schema() -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
            conn.execute(sa.text(f'DROP ROLE IF EXISTS "{reader_role(engine.url.database, schema)}"'))
        engine.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """The URL of a fresh PostgreSQL schema (for tests about PostgreSQL itself)."""
    yield from _pg_schema()


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """``None`` (SQLite in the store folder) or the URL of a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield None
    else:
        yield from _pg_schema()


@pytest.fixture
def open_store(tmp_path: Path, catalog_url: str | None) -> Iterator[Callable[..., dss.Store]]:
    """Open stores on one folder and catalog (each call opens another handle); all closed at the end."""
    opened: list[dss.Store] = []

    def make(**options: object) -> dss.Store:
        options.setdefault("mover", False)  # tests run the mover with store.run_mover() unless they test its thread
        store = dss.open(tmp_path / "store", catalog_url=catalog_url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(open_store: Callable[..., dss.Store]) -> dss.Store:
    return open_store()


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    """The folder of a test's embedded store."""
    return tmp_path / "store"


@pytest.fixture
def sqlite_store(store_path: Path) -> Iterator[dss.Store]:
    """A store on the embedded default only (for tests about files, SQLite and engines)."""
    store = dss.open(store_path, mover=False)
    yield store
    store.close()


def page(tag: int, layout: dss.Layout = LAYOUT) -> bytes:
    """A recognisable payload of the layout's size."""
    return bytes([tag % 256]) * layout.page_bytes


def pages_for(tokens: list[int], layout: dss.Layout = LAYOUT, tag: int = 0) -> dict[int, bytes]:
    """One payload per full page of ``tokens``, distinct per page and tag."""
    return {i: page(tag * 31 + i + 1, layout) for i in range(len(tokens) // layout.page_tokens)}
