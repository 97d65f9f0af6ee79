"""Faults under the mover: a process whose tiers are small (so pages are demoted and segments
evicted all the time) is SIGKILLed in the middle of moves, again and again; a page file is
deleted under the mover. Nothing acknowledged is lost — every acknowledged commit's tokens are
there, the pinned version's pages read back byte-exact, no read returns wrong bytes — and
``check()`` is empty after reopening.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.conftest import _pg_schema
from tests.mover_child import LAYOUT, digest, open_store, payload
from tests.victims import kill_after


def run_and_kill(folder: Path, url: str, seed: int, delay: float) -> list[tuple[str, int, str]]:
    acks = []
    for line in kill_after("mover_child", [str(folder), url, str(seed)], "ready", delay):
        parts = line.split()
        if len(parts) == 4 and parts[0] == "ack":
            acks.append((parts[1], int(parts[2]), parts[3]))
    return acks


def verify(folder: Path, url: str | None, acked: dict[str, tuple[int, str]]) -> None:
    store = open_store(str(folder), url, mover=False)
    try:
        assert store.check() == []
        for session, (num_tokens, expected) in acked.items():
            tokens = store.tokens(session)
            # the session's head is its last acknowledged commit, or one made after it that
            # the kill left unacknowledged (which extends it)
            assert len(tokens) >= num_tokens and digest(tokens[:num_tokens]) == expected, session
            refs = store.resume(session, tokens).pages
            for ref, got in zip(refs, store.read_pages(refs)):
                assert got is None or got == payload(tokens, ref.index), "a read returned wrong bytes"
        pinned = [7000 + i for i in range(16)]
        refs = store.resume("pinned", pinned).pages
        assert store.read_pages(refs) == [payload(pinned, i) for i in range(4)]
        assert store.check() == []
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("catalog, kills", [("sqlite", 12), ("postgresql", 4)])
def test_sigkill_during_moves_loses_nothing_acknowledged(tmp_path: Path, catalog: str, kills: int) -> None:
    urls = _pg_schema() if catalog == "postgresql" else None
    url = next(urls) if urls else None
    rng = random.Random(99)
    acked: dict[str, tuple[int, str]] = {}
    try:
        for round_ in range(kills):
            for session, num_tokens, expected in run_and_kill(tmp_path, url or "-", round_, rng.uniform(0.2, 1.0)):
                acked[session] = (num_tokens, expected)
            verify(tmp_path, url, acked)
        assert len(acked) >= kills
    finally:
        if urls:
            for _ in urls:
                pass


def toks(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def pages(tokens: list[int]) -> dict[int, bytes]:
    return {i: bytes([(tokens[0] + i) % 256]) * 1024 for i in range(len(tokens) // 4)}


def test_a_page_file_deleted_under_the_mover_loses_nothing_acknowledged(open_store) -> None:
    segment = 32 + 4 * (32 + 28 + 1024)
    store = open_store(disk_bytes=10 * segment, host_bytes=8 * 1024)
    for n in range(9):  # 90 % of the disk: past its high mark
        store.create_session(f"s{n}", layout=LAYOUT)
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    by_session = {}
    for n in range(9):
        ref = store.resume(f"s{n}", toks(n)).pages[0]
        by_session[n] = store.index.entries[ref.page_id].disk.segment
    for n in (0, 5):  # s0's file: the mover would demote it; s5's: it keeps it
        (store.disk.segments_dir / by_session[n]).unlink()
    store.host.discard(store.host.ids())
    moved = store.run_mover()  # demotes s0 and s1 (two segments): 70 % active
    assert moved == {"host": 0, "disk": 8}
    store.create_session("s9", layout=LAYOUT)  # a write that needs their room: both go
    store.commit("s9", toks(9, 48), pages(toks(9, 48)))
    assert store.stats()["disk"]["evictions"] == 8
    assert store.read_pages(store.resume("s5", toks(5)).pages) == [None] * 4  # gone, quarantined: a miss
    for n in (2, 3, 4, 6, 7, 8):
        refs = store.resume(f"s{n}", toks(n)).pages
        assert store.read_pages(refs) == [pages(toks(n))[i] for i in range(4)]
    assert [store.tokens(f"s{n}") for n in range(9)] == [toks(n) for n in range(9)]  # dialogue state intact
    assert store.check() == []
    store.close()
    again = open_store(disk_bytes=10 * segment, host_bytes=8 * 1024)
    assert again.check() == []
    assert [again.resume(f"s{n}", toks(n)).matched_tokens for n in range(9)] == [0, 0, 16, 16, 16, 0, 16, 16, 16]
