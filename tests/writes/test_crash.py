"""Crash safety: a process committing in a loop is SIGKILLed at random moments, again and again.

After every kill the store is reopened: ``check()`` must be empty, every acknowledged
commit must be there with its exact tokens, and its pages must resume and read back
byte-exact. Unacknowledged commits may or may not have landed; nothing may be half there.
The victim also erases users between commits; once it has finished its first erasure, this
process opens and closes the store while the victim goes on committing (an erasure once made
the victim's later commits vanish when another process closed the store), and every user
whose erasure was acknowledged must be gone.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import dss
from tests.conftest import _pg_schema
from tests.crash_child import LAYOUT, digest, payload
from tests.victims import kill_after


def run_and_kill(folder: Path, url: str, seed: int, delay: float) -> tuple[list[tuple[int, int, str]], list[str]]:
    """Start the victim; once it has erased a user, open and close the store here; SIGKILL the
    victim ``delay`` seconds later; return its acknowledged commits and erased users."""
    lines = kill_after(
        "crash_child",
        [str(folder), url, str(seed)],
        "forgot ",
        delay,
        before=lambda: dss.open(folder, catalog_url=None if url == "-" else url).close(),
    )
    acks, forgotten = [], []
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and parts[0] == "ack":
            acks.append((int(parts[1]), int(parts[2]), parts[3]))
        if len(parts) == 2 and parts[0] == "forgot":
            forgotten.append(parts[1])
    return acks, forgotten


def verify(folder: Path, url: str | None, acked: dict[int, tuple[int, str]], forgotten: list[str]) -> None:
    store = dss.open(folder, catalog_url=url)
    try:
        assert store.check() == []
        assert [user for user in forgotten if store.sessions(user_id=user)] == []
        versions = {v.version_id: v for v in store.versions("victim")}
        for version_id, (num_tokens, expected) in acked.items():
            assert version_id in versions, f"acknowledged version {version_id} is lost"
            tokens = store.tokens("victim", version_id)
            assert (len(tokens), digest(tokens)) == (num_tokens, expected)
        last = max(acked, default=None)
        if last is not None:
            tokens = store.tokens("victim", last)
            result = store.resume("victim", tokens + [1])
            full = len(tokens) // LAYOUT.page_tokens
            assert result.matched_tokens == full * LAYOUT.page_tokens
            assert store.read_pages(result.pages) == [payload(tokens, i) for i in range(full)]
    finally:
        store.close()


@pytest.mark.parametrize("catalog, kills", [("sqlite", 25), ("postgresql", 10)])
def test_sigkill_loses_no_acknowledged_commit(tmp_path: Path, catalog: str, kills: int) -> None:
    urls = _pg_schema() if catalog == "postgresql" else None
    url = next(urls) if urls else None
    rng = random.Random(1234)
    acked: dict[int, tuple[int, str]] = {}
    forgotten: list[str] = []
    try:
        for round_ in range(kills):
            acks, erased = run_and_kill(tmp_path, url or "-", round_, rng.uniform(0, 0.4))
            for version_id, num_tokens, expected in acks:
                acked[version_id] = (num_tokens, expected)
            forgotten += erased
            verify(tmp_path, url, acked, forgotten)
        assert len(acked) >= kills, "the victim should have acknowledged commits before most kills"
        assert len(forgotten) >= kills, "every round erases a user before the kill"
    finally:
        if urls:
            for _ in urls:
                pass
