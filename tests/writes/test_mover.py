"""The mover on an injected clock: no thread; the store steps it after its reads and writes, on
the clock's time, so a replay moves the same pages on any machine however fast."""

from __future__ import annotations

import time
from pathlib import Path

import dss

LAYOUT = dss.Layout(name="steps", page_tokens=4, page_bytes=1024)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def pages(tokens: list[int]) -> dict[int, bytes]:
    return {i: bytes([(tokens[0] + i) % 256]) * 1024 for i in range(len(tokens) // 4)}


def test_passes_come_on_the_clocks_time_not_the_wall_clocks(open_store) -> None:
    # interval 10 s of the clock. t=0: the first call runs a pass; wall time passing (0.2 s,
    # four intervals of a 0.05 s mover on a wall clock) runs none; t=9.9 none either; t=10
    # one; a host past its high mark (20 pages of 20: 85 % is 17) one at once, at t=10.5.
    clock = Clock()
    store = open_store(mover=True, mover_interval_s=10.0, clock=clock, host_bytes=20 * 1024)
    assert store.mover._thread is None  # the store steps it
    store.create_session("s", layout=LAYOUT)
    store.commit("s", toks(1), pages(toks(1)))
    assert store.stats()["policy"]["mover_passes"] == 1
    time.sleep(0.2)
    store.read_pages(store.resume("s", toks(1)).pages)
    clock.t = 9.9
    store.read_pages(store.resume("s", toks(1)).pages)
    assert store.stats()["policy"]["mover_passes"] == 1
    clock.t = 10.0
    store.read_pages(store.resume("s", toks(1)).pages)
    assert store.stats()["policy"]["mover_passes"] == 2
    clock.t = 10.5
    t = toks(2, 64)
    store.commit("s", toks(1) + t, pages(toks(1) + t))  # 16 more pages: host is full
    assert store.stats()["policy"]["mover_passes"] == 3
    assert store.host.active_bytes == 14 * 1024  # demoted to the 70 % mark by that pass
    assert store.check() == []


def replay(store: dss.Store, clock: Clock, pause_s: float) -> list[dict[str, int]]:
    """Forty turns of four users, two seconds apart on the clock (``pause_s`` of wall time
    after each); the tiers each turn's prompt was found on."""
    found = []
    for n in range(40):
        clock.t = 2.0 * n
        session = f"s{n % 4}"
        if n < 4:
            store.create_session(session, user_id=f"u{n}", layout=LAYOUT)
        history = store.tokens(session) if n >= 4 else []
        prompt = history + toks(n, 8)
        result = store.resume(session, prompt)
        found.append(dict(result.tiers))
        store.read_pages(result.pages)
        store.commit(session, prompt, pages(prompt))
        time.sleep(pause_s)
    return found


def test_the_same_replay_moves_the_same_pages_on_a_fast_and_a_slow_machine(tmp_path: Path) -> None:
    # A 12-page host and a disk of 24 pages' segments: both tiers pass their marks again and
    # again. The slow replay sleeps a wall-clock mover interval after every turn (a thread
    # on the wall clock would run a pass each time); the figures match.
    runs = []
    for pause_s in (0.0, 0.06):
        clock = Clock()
        with dss.open(
            tmp_path / f"paused-{pause_s}",
            mover_interval_s=0.05,
            clock=clock,
            host_bytes=12 * 1024,
            disk_bytes=24 * (1024 + 60) + 400,
        ) as store:
            found = replay(store, clock, pause_s)
            stats = store.stats()
        runs.append((found, stats["host"], stats["disk"], stats["policy"]))
    assert runs[0] == runs[1]
    found, host, disk, policy = runs[0]
    # 40 passes due on the clock (it moves 2 s a turn, past the 0.05 s interval: each turn's
    # first call runs one), 12 more a host past its high mark asked for at once
    assert policy["mover_passes"] == 52
    assert host["demotions"] > 0 and disk["demotions"] > 0 and disk["evictions"] > 0
