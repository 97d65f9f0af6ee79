"""What leaves the disk tier: the mover demotes segments (they stay readable, inactive), a write
that needs room reclaims them first demoted first, exactly as many as it needs, passing over
those read since; only when they run out does a write rank segments inline. Compaction leaves
inactive segments alone.

Sizes here: pages of 1024 bytes sealed into 1052 (nonce and tag), 4 pages a commit, so a
segment is 32 + 4 * (32 + 1052) = 4368 bytes.
"""

from __future__ import annotations

import dss
from dss.core.crypto import OVERHEAD
from dss.core.types import PageId
from dss.placement.policy import Placement, Settings
from dss.tiers.inactive import InactiveSegment

LAYOUT = dss.Layout(name="d", page_tokens=4, page_bytes=1024)
SEGMENT = 32 + 4 * (32 + OVERHEAD + 1024)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def toks(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def pages(tokens: list[int]) -> dict[int, bytes]:
    return {i: bytes([(tokens[0] + i) % 256]) * 1024 for i in range(len(tokens) // 4)}


def test_reclaim_takes_the_first_demoted_and_passes_over_those_read_since_or_held() -> None:
    # Four segments of 10 bytes, one page each, demoted in the order A, B, C, D at tick 4 (one
    # access each before). Then B's page is read (tick 5) and C's is held. A write needs 15
    # bytes: A (10; 5 to go), B is active again (taken off the list), C held (stays inactive),
    # D (10): done. Needing 30 bytes gives A and D too (all there is).
    placement = Placement(Settings(), Clock())
    ids = {name: PageId(name.encode() * 16) for name in "abcd"}
    for page_id in ids.values():
        placement.touch([page_id])
    tick = placement.tick
    assert tick == 4
    inactive = [InactiveSegment(name.upper(), 10, (page_id,), tick) for name, page_id in ids.items()]
    placement.touch([ids["b"]])
    with placement.hold([ids["c"]]):
        chosen, active = placement.disk_reclaim(inactive, 15)
        assert ([s.name for s in chosen], active) == (["A", "D"], ["B"])
        chosen, active = placement.disk_reclaim(inactive, 30)
        assert ([s.name for s in chosen], active) == (["A", "D"], ["B"])
    chosen, active = placement.disk_reclaim(inactive, 5)  # A is enough: nothing after it is looked at
    assert ([s.name for s in chosen], active) == (["A"], [])


def commit(store: dss.Store, n: int) -> None:
    """Session ``s<n>`` of user ``u<n>`` commits 4 pages: one segment, its pages at one
    access (a user's first turn)."""
    store.create_session(f"s{n}", user_id=f"u{n}", layout=LAYOUT)
    store.commit(f"s{n}", toks(n), pages(toks(n)))


def segment_of(store: dss.Store, n: int) -> str:
    entry = store.index.entries[store.resume(f"s{n}", toks(n)).pages[0].page_id]
    assert entry.disk is not None
    return entry.disk.segment


def matched(store: dss.Store, sessions: range) -> list[int]:
    return [store.resume(f"s{n}", toks(n)).matched_tokens for n in sessions]


def test_demoted_segments_stay_readable_and_leave_in_order_when_a_write_needs_room(open_store) -> None:
    # 9 one-segment sessions fill 90 % of a 10-segment disk: the mover demotes s0 and s1 (the
    # oldest; 7 of 10 active). s0 is read: active again. s9 fits. s10 needs one segment: s0 is
    # taken off the list (read since), s1 goes. s11: nothing inactive is left, so the write
    # ranks inline and frees 5 % more than it needs (10 + 1 - 9.5 = 1.5 segments: two), the
    # oldest cold ones, s2 and s3 (s0, read twice, is hot: it goes last).
    store = open_store(disk_bytes=10 * SEGMENT, host_bytes=0, clock=Clock())
    for n in range(9):
        commit(store, n)
    assert store.run_mover() == {"host": 0, "disk": 8}
    assert matched(store, range(9)) == [16] * 9
    assert store.stats()["disk"]["inactive_bytes"] == 2 * SEGMENT
    assert store.read_pages(store.resume("s0", toks(0)).pages) == list(pages(toks(0)).values())
    commit(store, 9)
    assert matched(store, range(10)) == [16] * 10  # a write that fits drops nothing
    commit(store, 10)
    assert matched(store, range(11)) == [16, 0] + [16] * 9
    disk = store.stats()["disk"]
    assert (disk["inactive_bytes"], disk["evictions"], disk["inline_evictions"]) == (0, 4, 0)
    commit(store, 11)
    assert matched(store, range(12)) == [16, 0, 0, 0] + [16] * 8
    disk = store.stats()["disk"]
    assert (disk["bytes"], disk["evictions"], disk["inline_evictions"]) == (9 * SEGMENT, 12, 8)
    assert store.check() == []


def test_a_mover_pass_takes_read_segments_off_the_list_and_demotes_to_the_low_mark(open_store) -> None:
    # 11 of 12 segments (92 %): the mover demotes s0, s1, s2 (8 of 12 active, under the 70 %
    # mark of 8.4). s1 is read: the next pass takes it off the list (9 active, 75 %: under the
    # high mark of 10.2, nothing to demote). s11 fits; s12 takes s0's room (the first
    # demoted): 11 active, and a pass demotes s3, s4, s5, the oldest cold ones (s1, read
    # twice, is hot: it would go last), after s2, which keeps its place.
    store = open_store(disk_bytes=12 * SEGMENT, host_bytes=0, clock=Clock())
    for n in range(11):
        commit(store, n)
    assert store.run_mover() == {"host": 0, "disk": 12}
    store.read_pages(store.resume("s1", toks(1)).pages)
    assert store.run_mover() == {"host": 0, "disk": 0}
    assert store.disk.inactive.names() == [segment_of(store, 0), segment_of(store, 2)]
    commit(store, 11)
    commit(store, 12)
    assert store.run_mover() == {"host": 0, "disk": 12}
    assert store.disk.inactive.names() == [segment_of(store, n) for n in (2, 3, 4, 5)]
    assert store.stats()["disk"]["inactive_bytes"] == 4 * SEGMENT
    assert matched(store, range(13)) == [0] + [16] * 12
    assert store.check() == []


def test_compaction_leaves_inactive_segments_alone(open_store) -> None:
    # a's segment (10 pages) is thinned by deleting a: b keeps 3 of its pages. The mover demotes
    # it (the disk is past its high mark); compaction then leaves it as it is, in its place on
    # the list, and the next write that needs room takes it.
    record = 32 + OVERHEAD + 1024
    a, b = toks(1, 40), toks(1, 12) + [7, 8, 9, 10]
    # a's file: 32 + 10 * 1084 bytes, b's: 32 + 1084; 11,988 of 14,092 (85.07 %): past the mark
    store = open_store(disk_bytes=13 * record, host_bytes=0, compact_auto=False, clock=Clock())
    store.create_session("a", layout=LAYOUT)
    store.commit("a", a, pages(a))
    store.create_session("b", layout=LAYOUT)
    store.commit("b", b, pages(b))
    store.delete_session("a")
    assert store.run_mover() == {"host": 0, "disk": 3}  # a's file (3 live pages) is demoted
    before = store.disk.inactive.names()
    files = store.disk.files()
    done = store.compact()
    assert (done.segments, done.new_segments, done.pages) == (0, 0, 0)
    assert store.disk.files() == files and store.disk.inactive.names() == before
    assert store.resume("b", b).matched_tokens == 16
    commit(store, 5)  # 4 more pages: a's file goes, and with it b's first three pages
    assert store.resume("b", b).matched_tokens == 0 and store.stats()["disk"]["inline_evictions"] == 0
    assert store.check() == []
