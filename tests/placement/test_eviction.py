"""Bounded tiers: host evicts least recently used pages (they stay on disk); a full disk drops
abandoned branches first, then the least used segments (the oldest newest-version among
equals), never a pinned version's. Versions keep their tokens.

Sizes here: pages of 1024 bytes sealed into 1052 (nonce and tag), 4 pages a commit, so a
segment is 32 + 4 * (32 + 1052) = 4368 bytes.
"""

from __future__ import annotations

import dss
from dss.core.crypto import OVERHEAD

LAYOUT = dss.Layout(name="e", page_tokens=4, page_bytes=1024)
SEGMENT = 32 + 4 * (32 + OVERHEAD + 1024)


def toks(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def pages(tokens: list[int], first: int = 0) -> dict[int, bytes]:
    return {i: bytes([(tokens[0] + i) % 256]) * 1024 for i in range(first, len(tokens) // 4)}


def test_host_tier_evicts_least_recently_used(open_store) -> None:
    store = open_store(host_bytes=3 * 1024)
    store.create_session("s", layout=LAYOUT)
    t = toks(1, 20)
    store.commit("s", t, pages(t))
    assert store.resume("s", t).tiers == {"disk": 8, "host": 12}  # pages 0, 1 left host
    refs = store.resume("s", t).pages
    assert store.read_pages(refs[:2]) == [pages(t)[0], pages(t)[1]]
    assert [(p.index, p.tier) for p in store.resume("s", t).pages] == [
        (0, "host"),
        (1, "host"),
        (2, "disk"),
        (3, "disk"),
        (4, "host"),
    ]
    assert store.host.used_bytes == 3 * 1024
    assert store.check() == []


def test_full_disk_drops_oldest_segments_and_keeps_tokens(open_store) -> None:
    store = open_store(disk_bytes=3 * SEGMENT + 100)
    for n in (1, 2, 3):
        store.create_session(f"s{n}", layout=LAYOUT)
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    assert sorted(store.disk.files().values()) == [SEGMENT] * 3
    store.create_session("s4", layout=LAYOUT)
    store.commit("s4", toks(4), pages(toks(4)))
    # used 3 segments + 1 new > capacity: free down to 95 % => the two oldest go from disk;
    # this process still holds them in its host tier
    assert {n: store.resume(f"s{n}", toks(n)).tiers for n in (1, 2, 3, 4)} == {
        1: {"host": 16},
        2: {"host": 16},
        3: {"host": 16},
        4: {"host": 16},
    }
    assert sum(store.disk.files().values()) == 2 * SEGMENT
    assert store.check() == []
    store.close()
    again = open_store(disk_bytes=3 * SEGMENT + 100)
    assert {n: again.resume(f"s{n}", toks(n)).matched_tokens for n in (1, 2, 3, 4)} == {1: 0, 2: 0, 3: 16, 4: 16}
    assert again.tokens("s1") == toks(1)  # dialogue state survives
    assert again.check() == []


def test_pages_only_old_versions_hold_go_first(open_store) -> None:
    store = open_store(disk_bytes=4 * SEGMENT + 1000, host_bytes=0)  # room to free: one segment
    store.create_session("s", layout=LAYOUT)
    a = toks(1, 16)
    v1 = store.commit("s", a, pages(a))  # segment A: pages 0-3
    b = a + toks(2, 16)
    store.commit("s", b, pages(b, first=4))  # segment B: pages 4-7 (version 2 only)
    store.create_session("t", layout=LAYOUT)
    store.commit("t", toks(3), pages(toks(3)))  # segment C: version 3
    store.rollback("s", v1.version_id)
    d = a + toks(4, 16)
    store.commit("s", d, pages(d, first=4))  # segment D: version 4, which also holds A
    store.create_session("u", layout=LAYOUT)
    store.commit("u", toks(5), pages(toks(5)))  # needs room: B (newest version 2) goes first
    assert store.resume("s", b).matched_tokens == 16  # the abandoned branch lost its own pages
    assert store.resume("s", d).matched_tokens == 32
    assert store.resume("t", toks(3)).matched_tokens == 16
    assert store.resume("u", toks(5)).matched_tokens == 16
    assert store.check() == []


def test_an_abandoned_branch_goes_first_however_often_read_then_the_least_used(open_store) -> None:
    store = open_store(disk_bytes=4 * SEGMENT + 1000, host_bytes=0)  # room to free: one segment

    def read(session: str, tokens: list[int], times: int = 3) -> None:
        for _ in range(times):
            store.read_pages(store.resume(session, tokens).pages)

    store.create_session("s", layout=LAYOUT)
    a = toks(1, 16)
    v1 = store.commit("s", a, pages(a))  # segment A
    b = a + toks(2, 16)
    store.commit("s", b, pages(b, first=4))  # segment B
    read("s", b)  # A and B read three times
    store.rollback("s", v1.version_id)
    d = a + toks(4, 16)
    store.commit("s", d, pages(d, first=4))  # segment D; B is now an abandoned branch
    store.create_session("t", layout=LAYOUT)
    store.commit("t", toks(3), pages(toks(3)))  # segment C
    store.create_session("u", layout=LAYOUT)
    store.commit("u", toks(5), pages(toks(5)))  # needs room: B goes, though read more than D, C
    assert store.resume("s", b).matched_tokens == 16
    assert store.resume("s", d).matched_tokens == 32
    read("t", toks(3))
    read("u", toks(5))
    store.create_session("w", layout=LAYOUT)
    store.commit("w", toks(6), pages(toks(6)))  # needs room: D, the least used, goes
    assert store.resume("s", d).matched_tokens == 16  # A, read most, stays
    assert store.resume("t", toks(3)).matched_tokens == 16
    assert store.resume("u", toks(5)).matched_tokens == 16
    assert store.resume("w", toks(6)).matched_tokens == 16
    assert store.check() == []


def test_pinned_versions_are_never_dropped(open_store) -> None:
    store = open_store(disk_bytes=3 * SEGMENT + 100, host_bytes=0)
    for n in (1, 2, 3):
        store.create_session(f"s{n}", layout=LAYOUT)
        version = store.commit(f"s{n}", toks(n), pages(toks(n)))
        if n == 1:
            store.pin("s1", version.version_id)
    store.create_session("s4", layout=LAYOUT)
    store.commit("s4", toks(4), pages(toks(4)))
    assert {n: store.resume(f"s{n}", toks(n)).matched_tokens for n in (1, 2, 3, 4)} == {1: 16, 2: 0, 3: 0, 4: 16}
    assert store.check() == []


def test_pages_that_cannot_fit_stay_in_host_only(open_store) -> None:
    store = open_store(disk_bytes=SEGMENT + 100)
    store.create_session("s1", layout=LAYOUT)
    store.pin("s1", store.commit("s1", toks(1), pages(toks(1))).version_id)
    store.create_session("s2", layout=LAYOUT)
    store.commit("s2", toks(2), pages(toks(2)))  # the only segment is pinned: no room on disk
    assert store.resume("s2", toks(2)).tiers == {"host": 16}
    assert store.sql("SELECT COUNT(*) FROM pages").rows == [(4,)]
    assert store.check() == []
    store.close()
    again = open_store(disk_bytes=SEGMENT + 100)
    assert again.resume("s2", toks(2)).matched_tokens == 0  # host is per process
    assert again.resume("s1", toks(1)).tiers == {"disk": 16}
