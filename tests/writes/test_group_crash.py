"""Crash safety of group commit: 16 threads of one process commit at once (their commits
share transactions) and the process is SIGKILLed at a random moment, again and again.

After every kill the store is reopened: ``check()`` must be empty, and every acknowledged
commit of every round so far must be there with its exact tokens and pages.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import dss
from tests.conftest import _pg_schema
from tests.crash_child import LAYOUT, digest, payload
from tests.victims import kill_after

THREADS = 16


def run_and_kill(folder: Path, url: str, round_: int, delay: float) -> list[tuple[str, int, int, str]]:
    """Start the victim, SIGKILL it ``delay`` seconds after it is ready; return its acknowledged commits."""
    acks = []
    for line in kill_after("group_crash_child", [str(folder), url, str(round_), str(THREADS)], "ready", delay):
        parts = line.split()
        if len(parts) == 5 and parts[0] == "ack":
            acks.append((parts[1], int(parts[2]), int(parts[3]), parts[4]))
    return acks


def verify(folder: Path, url: str | None, acked: dict[tuple[str, int], tuple[int, str]]) -> None:
    with dss.open(folder, catalog_url=url) as store:
        assert store.check() == []
        last: dict[str, int] = {}
        for (session, version_id), (num_tokens, expected) in acked.items():
            tokens = store.tokens(session, version_id)  # NotFound: an acknowledged commit is lost
            assert (len(tokens), digest(tokens)) == (num_tokens, expected)
            last[session] = max(last.get(session, 0), version_id)
        for session, version_id in last.items():
            tokens = store.tokens(session, version_id)
            result = store.resume(session, tokens + [1])
            full = len(tokens) // LAYOUT.page_tokens
            assert result.matched_tokens == full * LAYOUT.page_tokens
            assert store.read_pages(result.pages) == [payload(tokens, i) for i in range(full)]


@pytest.mark.parametrize("catalog, kills", [("sqlite", 12), ("postgresql", 6)])
def test_sigkill_loses_no_acknowledged_group_commit(tmp_path: Path, catalog: str, kills: int) -> None:
    urls = _pg_schema() if catalog == "postgresql" else None
    url = next(urls) if urls else None
    rng = random.Random(4321)
    acked: dict[tuple[str, int], tuple[int, str]] = {}
    try:
        for round_ in range(kills):
            for session, version_id, num_tokens, expected in run_and_kill(
                tmp_path, url or "-", round_, rng.uniform(0.2, 0.8)
            ):
                acked[(session, version_id)] = (num_tokens, expected)
            verify(tmp_path, url, acked)
        assert len(acked) >= 4 * kills, "the victim's threads should acknowledge commits before most kills"
    finally:
        if urls:
            for _ in urls:
                pass
