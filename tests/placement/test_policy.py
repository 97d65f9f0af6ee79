"""The placement policy on hand-built access sequences: the victim at each step, written out;
promotion after repeated access and the cool-down; watermarks and the mover; holds; quotas;
prefetch; nonsense settings.

Policy time comes from a fake clock (``clock=``): every step says what time it is.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

import dss
from dss.core.types import PageId
from dss.pages.host import put_host
from dss.placement.policy import Placement, Settings
from dss.tiers.host import HostTier, Victims

LAYOUT = dss.Layout(name="pol", page_tokens=4, page_bytes=1024)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Host:
    """The host tier as the page store drives it: each put makes the room the policy decides
    (:func:`dss.pages.host.put_host`); everything else is the tier's."""

    def __init__(self, tier: HostTier, placement: Placement) -> None:
        self.tier = tier
        self.placement = placement

    def put(
        self, page_id: PageId, payload: bytes, owner: tuple[str, int] | None = None, *, compete: bool = False
    ) -> Victims | None:
        return put_host(self.tier, self.placement, page_id, payload, owner, compete=compete)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)


def host_of(policy: str, pages: int = 4, **settings: object) -> tuple[Host, Placement, Clock]:
    clock = Clock()
    placement = Placement(Settings(policy=policy, **settings), clock)  # type: ignore[arg-type]
    return Host(HostTier(pages * 10), placement), placement, clock


def put(
    host: Host, placement: Placement, clock: Clock, t: float, name: str, owner: tuple[str, int] | None = None
) -> list[str] | None:
    """At time ``t``, a page is accessed and put in host; returns the names of the victims."""
    clock.t = t
    page = PageId(name.encode())
    placement.touch([page])
    got = host.put(page, b"x" * 10, owner)
    return None if got is None else [v.decode() for v in got]


def touch(placement: Placement, clock: Clock, t: float, *names: str) -> None:
    clock.t = t
    placement.touch([PageId(n.encode()) for n in names])


def test_dss_keeps_the_frequently_used_page_lru_drops_it() -> None:
    for policy, expected in (("dss", (["b"], ["d"], ["e"])), ("lru", (["a"], ["b"], ["d"]))):
        host, placement, clock = host_of(policy)
        for t in range(5):  # a: read at t = 0..4 (five accesses)
            touch(placement, clock, t, "a")
        host.put(PageId(b"a"), b"x" * 10)
        for t, name in ((5, "b"), (6, "c"), (7, "d")):  # b, c, d: one access each
            assert put(host, placement, clock, t, name) == []
        # t=8, e arrives: dss drops b (one access, oldest); lru drops a (least recently used)
        assert put(host, placement, clock, 8, "e") == expected[0], policy
        # t=100: c is read again; f arrives. dss: d and e have one old access each, d is older
        # -> d; lru: b, the least recently used
        touch(placement, clock, 100, "c")
        host.get_many([PageId(b"c")])
        assert put(host, placement, clock, 101, "f") == expected[1], policy
        # t=102, g arrives. dss: e (one access, t=8) is the least worth; lru: d (c was just read)
        assert put(host, placement, clock, 102, "g") == expected[2], policy
        assert host.check() == []


def test_decay_lets_a_page_that_was_hot_long_ago_go() -> None:
    host, placement, clock = host_of("dss", pages=2, frequency_half_life_s=10.0, recency_half_life_s=10.0)
    for t in range(4):
        touch(placement, clock, t, "old")  # four accesses around t = 0..3
    host.put(PageId(b"old"), b"x" * 10)
    assert put(host, placement, clock, 500, "new") == []
    # t=501: 'old' was hot, but 50 half-lives ago; 'new' was read a second ago
    assert put(host, placement, clock, 501, "next") == ["old"]


def test_ties_go_to_the_least_recently_used() -> None:
    host, placement, clock = host_of("dss", pages=3)
    for name in ("a", "b", "c"):
        assert put(host, placement, clock, 0, name) == []  # all at t=0: equal scores
    assert put(host, placement, clock, 0, "d") == ["a"]
    assert put(host, placement, clock, 0, "e") == ["b"]


def write(host: Host, placement: Placement, clock: Clock, t: float, name: str, user: int | None) -> list[str] | None:
    """At time ``t``, a turn of ``user`` writes a page (``user=None``: no user to inherit
    from) and puts it in host; returns the names of the victims."""
    clock.t = t
    page = PageId(name.encode())
    placement.wrote([page], user, turn=True)
    got = host.put(page, b"x" * 10)
    return None if got is None else [v.decode() for v in got]


def test_a_written_page_starts_at_its_users_activity() -> None:
    # user 1 writes a at t=0; at t=30 reads a and writes b; a one-off (user 2) writes v at t=30.
    # t=31: another one-off's w needs room. With the rule, b starts at user 1's activity
    # (2 turns decayed: 1.84, as a, read at every turn) and v, a user seen once, goes; without
    # a user to inherit from, b and v tie (one access at t=30) and b, put first, goes. LRU:
    # a, the least recently put.
    for policy, user_1, user_2, expected in (("dss", 1, 2, ["v"]), ("dss", None, None, ["b"]), ("lru", 1, 2, ["a"])):
        host, placement, clock = host_of(policy, pages=3)
        assert write(host, placement, clock, 0, "a", user_1) == []
        touch(placement, clock, 30, "a")
        assert write(host, placement, clock, 30, "b", user_1) == []
        assert write(host, placement, clock, 30, "v", user_2) == []
        assert write(host, placement, clock, 31, "w", 3) == expected, (policy, user_1)


def test_a_users_activity_counts_turns_decayed_and_is_forgotten_when_idle() -> None:
    _, placement, clock = host_of("dss", frequency_half_life_s=120.0)
    placement.wrote([PageId(b"a")], 7, turn=True, now=0.0)
    placement.wrote([PageId(b"b")], 7, turn=True, now=120.0)  # a half-life later: 0.5 + 1
    placement.wrote([PageId(b"c")], 7, turn=False, now=120.0)  # a save, not a turn: no count
    assert placement.activity(7, 120.0) == 1.5
    assert placement.activity(7, 240.0) == 0.75
    assert placement.activity(8, 240.0) == 0.0  # never seen
    assert placement.stats[PageId(b"c")].freq == 1.5  # but its pages start at it
    clock.t = 120.0 + 9 * 120.0  # 9 half-lives idle: under 1/256
    placement.prune(placement.stats)  # every page is still held
    assert 7 not in placement.users


def test_the_eviction_order_is_computed_again_once_an_eighth_of_it_arrived() -> None:
    # eight pages read three times at t=0; one-offs n0, n1, n2 arrive at t=1, 2, 3 (well
    # within a quarter recency half-life). n0: the order is computed, p0 (a tie, first) goes.
    # n1: one page arrived since, under an eighth of the eight ranked: p1 goes, next in the
    # order. n2: two arrived: the order is computed again and n0, read once, goes.
    host, placement, clock = host_of("dss", pages=8)
    names = [f"p{i}" for i in range(8)]
    for t in (0.0, 0.0, 0.0):
        touch(placement, clock, t, *names)
    for name in names:
        host.put(PageId(name.encode()), b"x" * 10)
    assert put(host, placement, clock, 1, "n0") == ["p0"]
    assert put(host, placement, clock, 2, "n1") == ["p1"]
    assert put(host, placement, clock, 3, "n2") == ["n0"]


def test_a_prefetched_page_counts_as_just_used_not_as_an_access() -> None:
    # c was read once at t=0; a at t=1. At t=20 a prefetch moves c up to host; at t=21 d
    # needs room: c, recent by its prefetch, stays and a goes (without the rule, c's last use
    # is t=0 and c would go). Its frequency is still one access decayed from t=0.
    host, placement, clock = host_of("dss", pages=2, frequency_half_life_s=20.0)
    touch(placement, clock, 0, "c")
    assert put(host, placement, clock, 1, "a") == []
    clock.t = 20
    assert host.put(PageId(b"c"), b"x" * 10) == []
    placement.prefetch_issued(PageId(b"c"))
    assert placement.stats[PageId(b"c")].freq == 0.5 and placement.stats[PageId(b"c")].last == 20
    assert put(host, placement, clock, 21, "d") == ["a"]


def test_held_pages_are_never_chosen() -> None:
    host, placement, clock = host_of("dss", pages=2)
    assert put(host, placement, clock, 0, "a") == []
    assert put(host, placement, clock, 1, "b") == []
    with placement.hold([PageId(b"a")]):
        assert put(host, placement, clock, 2, "c") == ["b"]  # a would go first, but it is held
        with placement.hold([PageId(b"c")]):
            assert put(host, placement, clock, 3, "d") is None  # everything held: d stays out
    assert put(host, placement, clock, 4, "d") == ["a"]
    assert host.check() == []


def test_a_heavy_user_evicts_their_own_pages_first() -> None:
    heavy, light = ("t", 1), ("t", 2)
    host, placement, clock = host_of("dss", pages=4, host_user_quota=20)
    assert put(host, placement, clock, 0, "l1", light) == []
    assert put(host, placement, clock, 1, "h1", heavy) == []
    assert put(host, placement, clock, 2, "h2", heavy) == []
    # h3 would put the heavy user over 20 bytes: their own oldest page goes, not l1
    assert put(host, placement, clock, 3, "h3", heavy) == ["h1"]
    assert put(host, placement, clock, 4, "l2", light) == []
    assert put(host, placement, clock, 5, "h4", heavy) == ["h2"]
    assert sorted(p.decode() for p in host.ids()) == ["h3", "h4", "l1", "l2"]
    assert host.owner_bytes[heavy] == 20 and host.owner_bytes[light] == 20


def test_tenant_quota() -> None:
    host, placement, clock = host_of("lru", pages=4, host_tenant_quota=20)
    assert put(host, placement, clock, 0, "a1", ("a", 1)) == []
    assert put(host, placement, clock, 1, "a2", ("a", 2)) == []
    assert put(host, placement, clock, 2, "b1", ("b", 3)) == []
    assert put(host, placement, clock, 3, "a3", ("a", 2)) == ["a1"]  # tenant a at its quota: its oldest goes
    assert host.tenant_bytes["a"] == 20


def test_promotion_needs_repeated_access_and_respects_the_cooldown() -> None:
    _, placement, clock = host_of("dss", promote_after=2, promote_interval_s=60.0, cooldown_s=30.0)
    p = PageId(b"p")
    touch(placement, clock, 0, "p")
    assert not placement.should_promote(p, load=False)  # a single touch never promotes
    assert placement.should_promote(p, load=True)  # ... unless the engine waits for it
    touch(placement, clock, 100, "p")  # the second access comes too late
    assert not placement.should_promote(p, load=False)
    touch(placement, clock, 110, "p")  # two within 60 s
    assert placement.should_promote(p, load=False)
    placement.demoted([p])  # demoted at t=110
    touch(placement, clock, 120, "p")
    assert not placement.should_promote(p, load=False)  # cooling down until t=140
    clock.t = 141
    assert placement.should_promote(p, load=False)
    lru = host_of("lru")[1]
    assert lru.should_promote(PageId(b"q"), load=False)  # plain LRU promotes every read


# -- through the store ----------------------------------------------------------------------


def toks(seed: int, n: int = 16) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def pages(tokens: list[int]) -> dict[int, bytes]:
    return {i: bytes([(tokens[0] + i) % 256]) * 1024 for i in range(len(tokens) // 4)}


def test_reads_promote_as_the_policy_says(open_store) -> None:
    clock = Clock()
    store = open_store(host_bytes=20 * 1024, clock=clock, promote_interval_s=60.0, cooldown_s=30.0)
    store.create_session("s", layout=LAYOUT)
    t = toks(1)
    store.commit("s", t, pages(t))
    refs = store.resume("s", t).pages
    store.host.discard([r.page_id for r in refs])  # only disk holds them now
    first = refs[0].page_id
    clock.t = 100  # the commit's access (t=0) is out of the window
    assert store.read_pages([first], load=False) == [pages(t)[0]]
    assert first not in store.host  # one touch: served, not promoted
    clock.t = 110
    assert store.read_pages([first], load=False) == [pages(t)[0]]
    assert first in store.host  # second access within the interval
    assert store.read_pages([refs[1].page_id]) == [pages(t)[1]]
    assert refs[1].page_id in store.host  # an engine load promotes at once
    stats = store.stats()
    assert stats["host"]["promotions"] == 2 and stats["disk"]["hits"] == 3
    assert stats["host"]["hits"] == 0 and stats["host"]["misses"] == 3
    assert store.check() == []


def test_the_mover_demotes_to_the_low_mark_in_batches(open_store) -> None:
    clock = Clock()
    store = open_store(host_bytes=100 * 1024, clock=clock, move_batch_pages=8)
    for n in range(12):  # 12 sessions x 4 pages = 48 pages, under 85 %
        store.create_session(f"s{n}", layout=LAYOUT)
        clock.t = n
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    assert store.run_mover() == {"host": 0, "disk": 0}  # under the high mark: nothing moves
    for n in range(12, 22):  # 88 pages: past 85 (the high mark)
        store.create_session(f"s{n}", layout=LAYOUT)
        clock.t = n
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    assert store.stats()["host"]["inline_evictions"] == 0
    assert store.run_mover() == {"host": 18, "disk": 0}  # 88 -> 70 active pages (the low mark)
    stats = store.stats()["host"]
    assert stats["bytes"] - stats["inactive_bytes"] == 70 * 1024 == stats["low_watermark"]
    assert stats["bytes"] == 88 * 1024 and stats["inactive_bytes"] == 18 * 1024
    assert stats["demotions"] == 18 and stats["moved_bytes"] == 18 * 1024 and stats["evictions"] == 0
    # demoted (the oldest: all four pages of each of s0..s3, two of s4), but still readable
    assert [store.resume(f"s{n}", toks(n)).tiers for n in (0, 3, 5)] == [{"host": 16}] * 3
    assert store.run_mover() == {"host": 0, "disk": 0}  # the active pages are at the low mark
    store.read_pages(store.resume("s1", toks(1)).pages)  # read: s1's pages are active again
    assert store.stats()["host"]["inactive_bytes"] == 14 * 1024
    for n in range(22, 28):  # 24 more pages: 12 fit, 12 take inactive room
        store.create_session(f"s{n}", layout=LAYOUT)
        clock.t = n
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    stats = store.stats()["host"]
    assert stats["bytes"] == 100 * 1024 and stats["inactive_bytes"] == 2 * 1024
    assert stats["inline_evictions"] == 0 and stats["demotions"] == 18  # the room was made before
    # the inactive pages left in the order demoted (s0, s2, s3); s4's two are still inactive
    assert [store.resume(f"s{n}", toks(n)).tiers for n in (0, 1, 2, 3, 4)] == [
        {"disk": 16},
        {"host": 16},
        {"disk": 16},
        {"disk": 16},
        {"host": 16},
    ]
    assert store.check() == []


def test_the_disk_mover_demotes_to_the_low_mark_and_keeps_pinned_pages(open_store) -> None:
    segment = 32 + 4 * (32 + 28 + 1024)  # one commit of 4 sealed pages
    store = open_store(disk_bytes=10 * segment, host_bytes=0)
    for n in range(9):  # 9 segments: 90 %, over the 85 % mark
        store.create_session(f"s{n}", layout=LAYOUT)
        version = store.commit(f"s{n}", toks(n), pages(toks(n)))
        if n == 0:
            store.pin("s0", version.version_id)
    assert store.run_mover() == {"host": 0, "disk": 8}  # two segments demoted: 7 of 10 active = 70 %
    entries = [store.index.entries[store.resume(f"s{n}", toks(n)).pages[0].page_id] for n in (1, 2)]
    assert store.disk.inactive.names() == [entry.disk.segment for entry in entries if entry.disk is not None]
    assert [store.resume(f"s{n}", toks(n)).matched_tokens for n in range(9)] == [16] * 9  # still readable
    disk = store.stats()["disk"]
    assert (disk["inactive_bytes"], disk["demotions"], disk["evictions"]) == (2 * segment, 8, 0)
    for n in (9, 10):  # s9 fits; s10 takes s1's room (the first demoted), no more
        store.create_session(f"s{n}", layout=LAYOUT)
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    assert [store.resume(f"s{n}", toks(n)).matched_tokens for n in range(11)] == [16, 0] + [16] * 9
    disk = store.stats()["disk"]
    got = (disk["bytes"], disk["inactive_bytes"], disk["evictions"], disk["inline_evictions"])
    assert got == (10 * segment, segment, 4, 0)
    assert store.check() == []


def test_prefetch_moves_the_head_up_and_counts_hits_and_waste(open_store) -> None:
    clock = Clock()
    store = open_store(host_bytes=7 * 1024, clock=clock)
    for n in (1, 2):
        store.create_session(f"s{n}", layout=LAYOUT)
        store.commit(f"s{n}", toks(n), pages(toks(n)))
    store.host.discard(store.host.ids())
    assert store.prefetch("s1", wait=True) == 4
    assert store.resume("s1", toks(1)).tiers == {"host": 16}
    refs = store.resume("s1", toks(1)).pages
    assert store.read_pages(refs[:3]) == [pages(toks(1))[i] for i in range(3)]
    assert store.prefetch("s2", wait=True) == 4  # fills host: s1's page 3 goes, unread
    assert store.prefetch("s2", wait=True) == 0  # already up
    assert store.stats()["prefetch"] == {"issued": 8, "hits": 3, "wasted": 1}
    assert store.check() == []


def test_the_mover_thread_runs_by_itself_and_stops_on_close(tmp_path) -> None:
    store = dss.open(tmp_path / "s", host_bytes=20 * 1024, mover_interval_s=0.05)
    store.create_session("s", layout=LAYOUT)
    t = toks(1, 80)  # 20 pages: a full host, past its high mark
    store.commit("s", t, pages(t))
    deadline = time.monotonic() + 10
    while store.host.active_bytes > 14 * 1024 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.host.active_bytes == 14 * 1024  # the low mark, reached without run_mover
    assert store.host.inactive_bytes == 6 * 1024  # demoted, still readable
    thread = store.mover._thread
    assert thread is not None and thread.is_alive()
    store.close()
    assert not thread.is_alive()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"host_low_watermark": 0.9}, "host_low_watermark"),
        ({"disk_high_watermark": 0.5, "disk_low_watermark": 0.6}, "disk_low_watermark"),
        ({"host_user_quota": -1}, "host_user_quota"),
        ({"disk_tenant_quota": "-5MiB"}, "disk_tenant_quota"),
        ({"policy_weights": (0, 0, 0)}, "policy_weights"),
        ({"policy_weights": (1, -2, 0.5)}, "policy_weights"),
        ({"host_bytes": 1000, "host_user_quota": 2000}, "host_user_quota"),
        ({"disk_bytes": "1MiB", "disk_tenant_quota": "2MiB"}, "disk_tenant_quota"),
        ({"policy": "fifo"}, "policy"),
        ({"move_batch_pages": 64}, "move_batch_pages"),
    ],
)
def test_nonsense_settings_are_a_config_error_naming_them(tmp_path, options, named) -> None:
    with pytest.raises(dss.ConfigError, match=named):
        dss.open(tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()


def test_a_page_worth_less_than_what_it_would_displace_stays_out_of_a_full_host() -> None:
    for policy in ("dss", "lru"):
        host, placement, clock = host_of(policy, pages=2)
        for t in range(5):  # a at t = 0..4, b at t = 5..9
            touch(placement, clock, t, "a")
            touch(placement, clock, t + 5, "b")
        host.put(PageId(b"a"), b"x" * 10)
        host.put(PageId(b"b"), b"x" * 10)
        # t=10: a page read once competes for room: dss keeps it out, lru takes it (drops a)
        touch(placement, clock, 10, "once")
        got = host.put(PageId(b"once"), b"x" * 10, compete=True)
        assert (got is None) if policy == "dss" else (got == [PageId(b"a")]), policy
        if policy == "dss":
            assert host.ids() == [PageId(b"a"), PageId(b"b")]
            # without competing (a prefetch, a page no durable tier holds) it goes in: a leaves
            assert host.put(PageId(b"once"), b"x" * 10) == [PageId(b"a")]
            # t=11: a page read six times outscores the lowest (once): it goes in, once leaves
            for _ in range(6):
                touch(placement, clock, 11, "hot")
            assert host.put(PageId(b"hot"), b"x" * 10, compete=True) == [PageId(b"once")]
        assert host.check() == []


def wrote(placement: Placement, clock: Clock, t: float, user: int, *names: str, started: bool = False) -> None:
    """At time ``t``, ``user`` takes a turn that writes the pages ``names`` (``started``: the
    turn is a session's first)."""
    clock.t = t
    placement.wrote([PageId(n.encode()) for n in names], user, turn=True, started=started)


def test_the_recency_of_a_users_pages_follows_how_often_it_comes_back() -> None:
    # recency alone (weights 0/1/0): a user back every 5 s, one back every 60 s
    host, placement, clock = host_of("dss", pages=2, weights=(0.0, 1.0, 0.0))
    for t in (-20, 40):
        wrote(placement, clock, t, 2)  # slow: its rhythm stays 60 s
    for t in range(60, 100, 5):
        wrote(placement, clock, t, 1)  # fast: rhythm 60 -> about 8 s
    wrote(placement, clock, 100, 2, "slow")
    host.put(PageId(b"slow"), b"x" * 10)
    wrote(placement, clock, 100, 1, "fast")
    host.put(PageId(b"fast"), b"x" * 10)
    assert placement.users[1].rhythm == pytest.approx(5 + 55 * 0.7**8)
    # t=130: both last used at t=100, 30 s ago: about 4 of the fast user's rhythms without its
    # next turn, half of the slow user's; the fast user's page is the staler, so it leaves,
    # though it was put last (plain recency would drop slow)
    assert put(host, placement, clock, 130, "x") == ["fast"]


def test_a_page_of_a_user_whose_turns_start_sessions_goes_stale_first() -> None:
    # recency alone: two users with the same rhythm, a turn every 10 s; "oneoff" starts a new
    # session with every turn (one-off requests), "chat" keeps one conversation going
    host, placement, clock = host_of("dss", pages=2, weights=(0.0, 1.0, 0.0))
    for t in range(0, 40, 10):
        wrote(placement, clock, t, 1, started=True)
        wrote(placement, clock, t, 2, started=t == 0)
    wrote(placement, clock, 40, 2, "chat")
    host.put(PageId(b"chat"), b"x" * 10)
    wrote(placement, clock, 40, 1, "oneoff", started=True)
    host.put(PageId(b"oneoff"), b"x" * 10)
    one, chat = placement.users[1], placement.users[2]
    assert (one.turns, one.starts, chat.turns, chat.starts) == (5, 5, 5, 1)
    assert one.rhythm == chat.rhythm == pytest.approx(10 + 50 * 0.7**4)
    # everyone's share of turns that started a session: 6 of 10; each user's own, drawn
    # towards it as if from 8 turns more
    assert placement.ending(one) == pytest.approx((5 + 8 * 0.6) / 13)
    assert placement.ending(chat) == pytest.approx((1 + 8 * 0.6) / 13)
    # t=60: 20 s without either's next turn; a conversation of "chat" more likely goes on,
    # so the one-off's page leaves, though it was put last
    assert put(host, placement, clock, 60, "x") == ["oneoff"]
    # its score is its recency alone (weights 0/1/0): the chance its conversation goes on
    g, w = 1 - placement.ending(chat), math.exp(-20 / chat.rhythm)
    (score,), _ = placement.scored([PageId(b"chat")], [10], 60.0)
    assert score == pytest.approx(g * w / (1 - g + g * w))


def test_the_store_counts_each_users_turns_and_the_sessions_they_started(open_store) -> None:
    store = open_store(host_bytes=20 * 1024)
    store.create_session("a", user_id="u", layout=LAYOUT)
    first = store.commit("a", toks(1), pages(toks(1)))  # a session's first version: a start
    store.commit("a", toks(1, 24))  # the conversation goes on
    store.branch("a", first.version_id, "b")  # a branch goes on from a version
    store.create_session("c", user_id="u", layout=LAYOUT)
    store.commit("c", toks(2))  # another conversation starts
    store.save_pages("c", toks(2, 20), {4: b"s" * 1024})  # a save is not a turn
    (user,) = store.placement.users.values()
    assert (user.turns, user.starts) == (4, 2)
    assert (store.placement.turns, store.placement.starts) == (4, 2)


def test_an_overdue_page_loses_its_frequency() -> None:
    host, placement, clock = host_of("dss", pages=2)
    for t in range(60, 100, 5):
        wrote(placement, clock, t, 1)  # a user back every ~8 s: high activity
    wrote(placement, clock, 100, 1, "busy")
    host.put(PageId(b"busy"), b"x" * 10)
    wrote(placement, clock, 100, 2, "new")  # a new user: activity 1
    host.put(PageId(b"new"), b"x" * 10)
    assert placement.stats[PageId(b"busy")].freq > 7 and placement.stats[PageId(b"new")].freq == 1
    # t=110: busy (not yet overdue: 4 rhythms = 33 s) outscores new, which leaves
    assert put(host, placement, clock, 110, "x") == ["new"]
    # t=180: busy was not read for 80 s, about 10 of its user's rhythms: overdue, its
    # frequency halved every rhythm since 33 s; x (one access at 110) now outscores it
    assert put(host, placement, clock, 180, "y") == ["busy"]
