"""The host tier: a byte-bounded LRU."""

from __future__ import annotations

from dss.core.types import PageId
from dss.tiers.host import HostTier


def ids(*names: str) -> list[PageId]:
    return [PageId(n.encode()) for n in names]


def test_lru_order_and_bounds() -> None:
    host = HostTier(30)
    a, b, c, d = ids("a", "b", "c", "d")
    assert host.put(a, b"x" * 10) == [] and host.put(b, b"y" * 10) == [] and host.put(c, b"z" * 10) == []
    assert host.get_many([a]) == [b"x" * 10]  # a is now most recent
    assert host.put(d, b"w" * 10) == [b]
    assert host.ids() == [c, a, d]
    assert host.put(a, b"x" * 10) == []  # present: only refreshed
    assert host.ids() == [c, d, a] and host.used_bytes == 30
    assert host.check() == []


def test_eviction_frees_enough_and_oversize_is_refused() -> None:
    host = HostTier(20)
    a, b, c = ids("a", "b", "c")
    host.put(a, b"1" * 10)
    host.put(b, b"2" * 10)
    got = host.get_many([a])[0]
    assert host.put(c, b"3" * 15) == [b, a]  # a was used last, so b goes first; then a too
    assert got == b"1" * 10  # what a reader got stays valid
    assert host.put(a, b"1" * 5) == []
    assert host.put(PageId(b"big"), b"4" * 21) is None
    assert host.discard([c, c, PageId(b"nope")]) == 15
    assert host.used_bytes == 5 and host.check() == []


def test_demoted_pages_stay_readable_and_leave_first_in_the_order_demoted() -> None:
    host = HostTier(40)
    a, b, c, d, e = ids("a", "b", "c", "d", "e")
    for page in (a, b, c, d):
        assert host.put(page, b"x" * 10) == []
    assert host.demote([c, a, PageId(b"nope")]) == 20 and host.demote([c]) == 0  # once only
    assert (host.used_bytes, host.inactive_bytes, host.active_bytes) == (40, 20, 20)
    assert list(host.inactive()) == [(c, 10), (a, 10)]
    got = host.put(e, b"y" * 10)  # full: the first demoted goes, not the LRU b
    assert got == [c] and got.reclaimed == 1
    assert host.get_many([a]) == [b"x" * 10]  # still readable; active again
    assert host.inactive_bytes == 0 and not host.is_inactive(a)
    host.demote([d])
    got = host.put(PageId(b"f"), b"z" * 20)  # d (inactive), then b (least recently used)
    assert got == [d, b] and got.reclaimed == 1
    host.demote([e])
    assert host.discard([e]) == 10 and host.inactive_bytes == 0
    assert host.check() == []


def test_peek_leaves_the_recency_order_as_it_is() -> None:
    host = HostTier(30)
    a, b, c = ids("a", "b", "c")
    host.put(a, b"x" * 10)
    host.put(b, b"y" * 10)
    assert host.peek(a) == b"x" * 10 and host.peek(c) is None
    assert host.ids() == [a, b]  # a was peeked, not used: still the oldest
    assert host.put(c, b"z" * 10) == [] and host.put(PageId(b"d"), b"w" * 10) == [a]
