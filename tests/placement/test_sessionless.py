"""Placement of pages saved without a session (:mod:`dss.placement.sessionless`): the rhythm, the
going on and the memory the policy learns from prefix lookups, on hand-worked examples, and the
same through the store's public API (``lookup``, ``read_pages``, ``save_pages`` without a
session, as the vLLM connector serves a request that names none).
"""

from __future__ import annotations

import math

import pytest

import dss
from dss.catalog.segments import SegmentRow
from dss.core.types import PageId
from dss.pages.host import put_host
from dss.placement.disk import segment_worth
from dss.placement.policy import Placement, Settings
from dss.placement.sessionless import SessionlessStats
from dss.tiers.host import HostTier


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_rhythm_the_going_on_and_the_memory_by_hand() -> None:
    # recency_half_life_s 60, frequency_half_life_s 120: the rhythm starts at 60 s and a page's
    # frequency halves every max(120, 2.5 x 60) = 150 s.
    stats = SessionlessStats(60.0, 120.0)
    assert stats.half_life == 150.0
    # 4 pages are read once (written); two of them again; one of those a third time
    stats.first(4)
    stats.again(1)
    stats.again(1)
    stats.again(2)
    assert (stats.reached[:4], stats.went_on[:4]) == ([0, 4, 2, 1], [0, 2, 1, 0])
    # the share over every count: 3 went on of 7 reached; each count drawn towards it with 8
    # pages' weight: going(1) = (2 + 8 x 3/7) / (4 + 8), going(2) = (1 + 24/7) / (2 + 8),
    # going(3) = (0 + 24/7) / (1 + 8)
    assert stats.going(1) == pytest.approx((2 + 24 / 7) / 12)
    assert stats.going(2) == pytest.approx((1 + 24 / 7) / 10)
    assert stats.going(3) == pytest.approx((24 / 7) / 9)
    # a read that read pages again 100 s after their last read: the rhythm moves 5 % of the
    # way, 60 -> 62; the memory follows it: max(120, 2.5 x 62) = 155
    stats.gap(100.0)
    assert (stats.rhythm, stats.half_life) == (62.0, 155.0)
    # recency: g at once; after one rhythm, g·e⁻¹ / (1 − g + g·e⁻¹)
    g = (2 + 24 / 7) / 12
    assert stats.recency(1, 0.0) == pytest.approx(g)
    assert stats.recency(1, 62.0) == pytest.approx(g / math.e / (1 - g + g / math.e))


def page(name: str) -> PageId:
    return PageId(name.encode())


def test_a_prefix_read_again_keeps_its_place_and_one_off_prompts_take_turns() -> None:
    # A host of three 10-byte pages. t=0: a prompt saves a, b (a prefix) and four one-off pages
    # o1..o4 elsewhere (6 pages read once); a and b go to host. t=30: a lookup reads a and b
    # again (going on of a page read once: 2 of 6; the rhythm 60 + 5 % of (30 - 60) = 58.5 s,
    # the memory max(120, 2.5 x 58.5) = 146.25 s). t=40: one-off x fits. t=50: one-off y
    # competes for room. Counts: read once 8 (x, y too), 2 went on; twice 2, none yet; over
    # every count 2 of 10: going(1) = (2 + 1.6) / 16 = 0.225, going(2) = 1.6 / 10 = 0.16.
    #   a: frequency (2^(-30/150) + 1) x 2^(-20/146.25) = 1.7014 (it is the 90th percentile:
    #      its term is 1), recency 0.16·w / (0.84 + 0.16·w), w = e^(-20/58.5): 0.1192
    #      -> 0.6 + 0.3 x 0.1192 + 0.1 = 0.7358
    #   x: frequency 2^(-10/146.25) = 0.9537, term log(1.9537) / log(2.7014) = 0.6739;
    #      recency 0.225·w / (0.775 + 0.225·w), w = e^(-10/58.5): 0.1966 -> 0.5633
    #   y: frequency 1, term 0.6975; recency 0.225 -> 0.5860
    # x is the lowest; y is worth more: x goes. t=60: z takes y's place the same way. LRU
    # drops the least recently used instead: a, then b.
    cases = (("dss", ([], ["x"], ["y"]), ["a", "b", "z"]), ("lru", ([], ["a"], ["b"]), ["x", "y", "z"]))
    for policy, expected, kept in cases:
        clock = Clock()
        placement = Placement(Settings(policy=policy), clock)
        host = HostTier(30)
        placement.wrote([page(n) for n in ("a", "b", "o1", "o2", "o3", "o4")], None, turn=False, sessionless=True)
        for name in ("a", "b"):
            host.put(page(name), b"x" * 10)
        clock.t = 30
        placement.touch([page("a"), page("b")])
        host.get_many([page("a"), page("b")])
        got = []
        for t, name in ((40, "x"), (50, "y"), (60, "z")):
            clock.t = t
            placement.wrote([page(name)], None, turn=False, sessionless=True)
            victims = put_host(host, placement, page(name), b"x" * 10, None, compete=True)
            assert victims is not None
            got.append([v.decode() for v in victims])
            if policy == "dss" and name == "y":
                sessionless = placement.sessionless
                assert (sessionless.rhythm, sessionless.half_life) == (58.5, 146.25)
                assert (sessionless.going(1), sessionless.going(2)) == pytest.approx((0.225, 0.16))
                scores = [placement.score(page(n), 10, placement._scale, 50.0) for n in ("a", "x", "y")]
                assert scores == pytest.approx([0.7358, 0.5633, 0.5860], abs=1e-4)
        assert tuple(got) == expected, policy
        assert sorted(p.decode() for p in host.ids()) == kept, policy


def test_a_long_learned_rhythm_keeps_a_prefix_the_session_rules_would_let_go() -> None:
    # Lookups that read pages again every 300 s teach the rhythm: after n of them it is
    # 300 - 240 x 0.95^n (n = 40: 269.16 s), the memory 2.5 x that (672.9 s). Then prefix p,
    # read twice, 400 s ago; one-off q arrives in a full host of one page. As a page of no
    # session p keeps its place: its frequency decays over the learned memory, not the 120 s
    # half-life, and its recency over the learned rhythm, not 60 s. Marked as a session's page
    # (no user known: the plain rules) it would leave for q.
    outcome = {}
    for sessionless in (True, False):
        clock = Clock()
        placement = Placement(Settings(), clock)
        teacher = [page(f"t{i}") for i in range(4)]
        placement.wrote(teacher, None, turn=False, sessionless=True)
        for n in range(1, 41):
            clock.t = 300.0 * n
            placement.touch(teacher)
        assert placement.sessionless.rhythm == pytest.approx(300 - 240 * 0.95**40)
        clock.t = 20_000.0
        placement.wrote([page("p")], None, turn=False, sessionless=sessionless)
        placement.touch([page("p")])
        host = HostTier(10)
        host.put(page("p"), b"x" * 10)
        clock.t = 20_400.0
        placement.wrote([page("q")], None, turn=False, sessionless=sessionless)
        outcome[sessionless] = put_host(host, placement, page("q"), b"x" * 10, None, compete=True)
    assert outcome[True] is None  # q stays out: p is worth more
    assert outcome[False] == [page("p")]


def test_on_disk_a_sessionless_page_weighs_its_chance_of_coming_back_and_a_session_page_its_frequency() -> None:
    # Segment Q holds page q, read 6 times at t=0; segment R page r, read twice, at t=150 and
    # t=190; six one-off pages read once teach that few pages come back after one read. At
    # t=200 q's frequency, decayed (halving every 120 s), is still above r's, but r, read
    # twice and 10 s ago, is far likelier to be read again than q, silent for 200 s: saved
    # without a session (chance of coming back times log(1 + frequency at the last read)),
    # Q leaves first. Saved by a session (frequency, decayed), R leaves first; under LRU, Q
    # (the least recently read).
    order = {}
    for policy, sessionless in (("dss", True), ("dss", False), ("lru", True)):
        clock = Clock()
        placement = Placement(Settings(policy=policy), clock)
        q, r = page("q"), page("r")
        placement.wrote([q], None, turn=False, sessionless=sessionless)
        for _ in range(5):
            placement.touch([q])
        placement.wrote([page(f"o{i}") for i in range(6)], None, turn=False, sessionless=sessionless)
        clock.t = 150.0
        placement.wrote([r], None, turn=False, sessionless=sessionless)
        clock.t = 190.0
        placement.touch([r])
        clock.t = 200.0
        segments = [SegmentRow(1, "Q", 100, -1, False, False), SegmentRow(2, "R", 100, -1, False, False)]
        if policy == "dss":
            stats = {p: placement.stats[p] for p in (q, r)}
            assert (stats[q].reads, stats[r].reads) == (6, 2)
            assert (stats[q].freq, stats[r].freq) == pytest.approx((6.0, 2 ** (-40 / 120) + 1))
            assert placement.half_life(stats[q]) == 120.0
            frequency = [stats[p].freq * 2 ** (-(200.0 - stats[p].last) / 120.0) for p in (q, r)]
            assert frequency[0] > frequency[1]
            worth = segment_worth(placement, segments, {1: [q], 2: [r]}, 200.0)
            if sessionless:
                learned = placement.sessionless
                chance = (learned.recency(6, 200.0), learned.recency(2, 10.0))
                assert chance[0] < 0.01
                assert chance[1] > 0.3
                assert worth == pytest.approx([chance[0] * math.log(7.0), chance[1] * math.log1p(stats[r].freq)])
            else:
                assert worth == pytest.approx(frequency)
        ordered = placement.segment_order(segments, {1: [q], 2: [r]}, 200.0)
        order[policy, sessionless] = [segment.name for segment in ordered]
    assert order == {("dss", True): ["Q", "R"], ("dss", False): ["R", "Q"], ("lru", True): ["Q", "R"]}


LAYOUT = dss.Layout(name="nosession", page_tokens=4, page_bytes=64)


def blocks(*ids: int) -> list[int]:
    """A prompt of one page per block id (the way the benchmark replays hash traces)."""
    return [t for i in ids for t in (i, 0, 0, 0)]


def test_a_sessionless_prefix_stays_in_host_through_the_public_api(open_store) -> None:
    # A host of 3 pages. Prompt [1, 2] is saved (no session), then looked up and loaded again
    # at t=30: a prefix read twice. One-off prompts [7], [8], [9] follow, one page each: each
    # takes the third place in turn; the prefix stays on host. The pages are marked
    # sessionless; the one-offs go on being readable from disk.
    clock = Clock()
    store = open_store(clock=clock, host_bytes=3 * 64, encrypt=False)
    options = {"user_id": "anonymous", "tenant_id": "default", "layout": LAYOUT}
    store.save_pages(None, blocks(1, 2), {0: b"a" * 64, 1: b"b" * 64}, **options)
    clock.t = 30
    found = store.lookup(blocks(1, 2), layout=LAYOUT)
    assert found.tiers == {"host": 8}
    store.read_pages(found.pages)
    for t, block in ((40, 7), (50, 8), (60, 9)):
        clock.t = t
        assert store.lookup(blocks(block), layout=LAYOUT).matched_tokens == 0
        store.save_pages(None, blocks(block), {0: bytes([block]) * 64}, **options)
    assert store.lookup(blocks(1, 2), layout=LAYOUT).tiers == {"host": 8}
    assert [store.lookup(blocks(b), layout=LAYOUT).tiers for b in (7, 8, 9)] == [{"disk": 4}, {"disk": 4}, {"host": 4}]
    assert all(store.placement.stats[ref.page_id].is_sessionless for ref in found.pages)
    assert store.check() == []
