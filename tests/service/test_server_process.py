"""A real ``dss serve`` process: kill -9 loses no acknowledged commit; SIGTERM lets in-flight
commits finish and closes the store cleanly."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import dss
from dss.service.problems import Unavailable
from dss.service.process import ServiceProcess

LAYOUT = dss.Layout(name="proc", page_tokens=4, page_bytes=64)


class Writers:
    """Threads committing growing token lists to their own sessions, recording what was acknowledged."""

    def __init__(self, client: dss.Store, num_threads: int) -> None:
        self.client = client
        self.acked: list[tuple[str, int, list[int]]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        for i in range(num_threads):
            client.create_session(f"w{i}", user_id="u", layout=LAYOUT)
        self.threads = [threading.Thread(target=self._run, args=(f"w{i}",)) for i in range(num_threads)]

    def _run(self, session_id: str) -> None:
        tokens: list[int] = []
        while not self.stop.is_set():
            tokens = tokens + [len(tokens) % 50_000] * 4
            try:
                version = self.client.commit(session_id, tokens, {len(tokens) // 4 - 1: bytes(64)})
            except Unavailable as exc:  # the service died or is shutting down
                self.errors.append(exc)
                return
            with self.lock:
                self.acked.append((session_id, version.version_id, tokens))

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def assert_all_present(store: dss.Store, acked: list[tuple[str, int, list[int]]]) -> None:
    for session_id, version_id, tokens in acked:
        assert store.tokens(session_id, version_id, tenant_id="t") == tokens
    assert store.check() == []


@pytest.mark.slow
def test_kill_9_loses_no_acknowledged_commit(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "home").start()
    key = service.add_key("t", is_admin=True)
    client = dss.connect(service.url, api_key=key)
    with Writers(client, 4) as writers:
        deadline = time.monotonic() + 20
        while len(writers.acked) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.kill() == -9
        for t in writers.threads:
            t.join(30)
    client.close()
    acked = writers.acked
    assert len(acked) >= 40
    assert all(isinstance(e, Unavailable) for e in writers.errors)
    with dss.open(tmp_path / "home") as store:
        assert_all_present(store, acked)
    with ServiceProcess(tmp_path / "home") as again, dss.connect(again.url, api_key=key) as client:
        for session_id, version_id, tokens in acked[-8:]:  # and the service starts again on it
            assert client.tokens(session_id, version_id) == tokens
        assert client.check() == []


@pytest.mark.slow
def test_sigterm_finishes_in_flight_commits_then_exits_cleanly(tmp_path: Path) -> None:
    service = ServiceProcess(tmp_path / "home").start()
    key = service.add_key("t", is_admin=True)
    client = dss.connect(service.url, api_key=key)
    big = dss.Layout(name="big", page_tokens=1, page_bytes=1 << 20)
    client.create_session("big", user_id="u", layout=big)
    outcome: dict[str, object] = {}

    def slow_commit() -> None:  # 16 MiB of pages (21 MiB of JSON): parsed, checksummed, fsynced
        try:
            outcome["version"] = client.commit("big", list(range(16)), {i: bytes([i]) * (1 << 20) for i in range(16)})
        except dss.DssError as exc:
            outcome["error"] = exc

    committer = threading.Thread(target=slow_commit)
    committer.start()
    deadline = time.monotonic() + 20
    while "version" not in outcome and time.monotonic() < deadline:  # until the big commit is being answered
        text = httpx.get(f"{service.url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
        gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        if gauges["dss_http_requests_in_flight"] >= 2:  # this scrape and the commit
            break
    assert "version" not in outcome  # else the test proves nothing
    with Writers(client, 2) as writers:
        assert service.stop() == -15  # uvicorn re-raises SIGTERM once shut down (exit status 143)
        committer.join(60)
    client.close()
    assert "error" not in outcome, outcome
    version = outcome["version"]
    assert isinstance(version, dss.Version) and version.num_tokens == 16
    assert all(isinstance(e, Unavailable) for e in writers.errors)
    log = service.log_path.read_text()
    assert "store closed" in log and "Finished server process" in log
    with dss.open(tmp_path / "home") as store:
        assert_all_present(store, writers.acked)
        pages = store.read_pages(store.resume("big", list(range(16)), tenant_id="t").pages)
        assert pages == [bytes([i]) * (1 << 20) for i in range(16)]


@pytest.mark.slow
def test_commits_after_an_erasure_and_a_cli_command_are_kept(tmp_path: Path) -> None:
    """The service commits, erases a user, an operator runs a CLI command (which opens and
    closes the store in its own process), the service commits again: every acknowledged commit
    is seen by a fresh process and survives kill -9 of the service. (The erasure's raw-byte
    scan once dropped the service's SQLite locks, and the CLI then deleted the WAL under it.)"""
    home = tmp_path / "home"
    service = ServiceProcess(home).start()
    try:
        key = service.add_key("t", is_admin=True)
        client = dss.connect(service.url, api_key=key)
        client.create_session("s", user_id="u", layout=LAYOUT)
        client.create_session("gone", user_id="gone", layout=LAYOUT)
        client.commit("gone", [9] * 8, {0: bytes(64), 1: bytes(64)})
        acked = []
        for n in range(1, 5):
            tokens = list(range(4 * n))
            acked.append(("s", client.commit("s", tokens, {n - 1: bytes([n]) * 64}).version_id, tokens))
            if n == 1:
                assert client.forget_user("gone", tenant_id="t").removed.sessions == 1
                cli = subprocess.run(
                    [sys.executable, "-m", "dss", "--home", str(home), "sessions"],
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert cli.returncode == 0 and "\ns " in cli.stdout, cli.stderr
        with dss.open(home) as store:
            assert_all_present(store, acked)
        assert service.kill() == -9
        client.close()
    finally:
        service.kill()
    with dss.open(home) as store:
        assert_all_present(store, acked)
        assert [s.session_id for s in store.sessions()] == ["s"]
