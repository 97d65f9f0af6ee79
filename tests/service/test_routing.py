"""The router's decision (dss/routing.py): exact choices for each policy, the load bound,
failover, and the properties of consistent hashing.

Ring orders used below (BLAKE2b points, 64 per node; computed once and pinned here, so a
change of the hash or of the ring is a visible change of every deployment's placement)::

    key       nodes a, b, c, d       nodes a, b, c (d gone: d just drops out of each order)
    chat-1    d a b c                a b c
    chat-2    c d a b                c a b
    chat-3    a c b d                a c b
"""

from __future__ import annotations

import math

import pytest

from dss.core.errors import InvalidInput, NoBackend
from dss.service.routing import Backend, Decision, load_bound, ring_order, route, score

NODES = ("a", "b", "c", "d")


def backends(loads: dict[str, int] | None = None, down: tuple[str, ...] = ()) -> list[Backend]:
    loads = loads or {}
    return [Backend(n, n not in down, loads.get(n, 0)) for n in NODES]


def test_ring_orders_are_pinned_and_consistent() -> None:
    assert ring_order(NODES, "chat-1") == ["d", "a", "b", "c"]
    assert ring_order(NODES, "chat-2") == ["c", "d", "a", "b"]
    assert ring_order(NODES, "chat-3") == ["a", "c", "b", "d"]
    assert ring_order(("a", "b", "c"), "chat-1") == ["a", "b", "c"]
    assert ring_order(("a", "b", "c"), "chat-2") == ["c", "a", "b"]


def test_removing_a_node_moves_only_its_keys() -> None:
    """Of 2000 keys, exactly those whose first node was ``c`` move; each goes to its second node."""
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: ring_order(NODES, k) for k in keys}
    after = {k: ring_order(("a", "b", "d"), k)[0] for k in keys}
    moved = [k for k in keys if before[k][0] != after[k]]
    assert moved == [k for k in keys if before[k][0] == "c"]
    assert all(after[k] == before[k][1] for k in moved)
    shares = [sum(1 for k in keys if before[k][0] == n) / len(keys) for n in NODES]
    assert all(0.15 < s < 0.35 for s in shares), shares


def test_round_robin_skips_unhealthy_backends() -> None:
    chosen = [route(backends(down=("b",)), policy="round_robin", counter=i).node_id for i in range(5)]
    assert chosen == ["a", "c", "d", "a", "c"]


def test_hash_follows_the_ring_and_the_load_bound() -> None:
    """chat-2 walks c d a b. Loads c=4, d=1, others 0: total 5, bound ceil(1.25 * 6 / 4) = 2,
    so c (4) is passed over and d (1 < 2) takes it; with d at 3, the bound is ceil(1.25 * 8 / 4)
    = 3, d is at it too, and a takes it."""
    assert route(backends(), policy="hash", key="chat-2") == Decision("c", "hash", {})
    assert load_bound(backends({"c": 4, "d": 1}), 1.25) == 2
    assert route(backends({"c": 4, "d": 1}), policy="hash", key="chat-2", load_factor=1.25).node_id == "d"
    assert route(backends({"c": 4, "d": 3}), policy="hash", key="chat-2", load_factor=1.25).node_id == "a"
    assert route(backends(down=("c",)), policy="hash", key="chat-2").node_id == "d"


def test_without_a_key_the_least_loaded_node_takes_it() -> None:
    loads = backends({"a": 2, "b": 1, "c": 1, "d": 3})
    assert route(loads, policy="hash") == Decision("b", "least_loaded", {})
    assert route(loads, policy="kv").node_id == "b"


def test_kv_prefers_most_pages_then_faster_tiers() -> None:
    """Scores (total, device, host): a (4, 0, 0), b (4, 0, 4), c (3, 2, 1), d none. b and a tie
    on total and device; b has more on host."""
    holdings = {"a": {"disk": 4}, "b": {"host": 4}, "c": {"device": 2, "host": 1}}
    assert [score(holdings.get(n, {})) for n in NODES] == [(4, 0, 0), (4, 0, 4), (3, 2, 1), (0, 0, 0)]
    assert route(backends(), key="chat-1", holdings=holdings) == Decision("b", "kv", {"host": 4})
    assert route(backends(), key="chat-1", holdings={"a": {"disk": 3}, "d": {"disk": 3}}).node_id == "d"  # ring: d a
    assert route(backends(), key="chat-3", holdings={"a": {"disk": 3}, "d": {"disk": 3}}).node_id == "a"  # ring: a .. d


def test_kv_passes_over_a_holder_at_its_bound_and_falls_back_to_hash() -> None:
    """Loads b=5: total 5, bound ceil(1.25 * 6 / 4) = 2; b is over it, so a (the next holder)
    takes it; with only b holding pages, the request falls back to the ring (chat-1: d)."""
    holdings = {"a": {"disk": 4}, "b": {"host": 4}}
    assert route(backends({"b": 5}), key="chat-1", holdings=holdings, load_factor=1.25).node_id == "a"
    assert route(backends({"b": 5}), key="chat-1", holdings={"b": {"host": 4}}, load_factor=1.25) == Decision(
        "d", "hash", {}
    )
    assert route(backends(), key="chat-1", holdings={}) == Decision("d", "hash", {})


def test_kv_fails_over_when_the_holder_dies() -> None:
    holdings = {"b": {"device": 8, "host": 8}}
    assert route(backends(), key="chat-2", holdings=holdings).node_id == "b"
    assert route(backends(down=("b",)), key="chat-2", holdings=holdings) == Decision("c", "hash", {})


def test_bounded_load_holds_for_a_stream_of_requests() -> None:
    """1000 requests that never finish, all of one hot key: hashing alone would put them all
    on one node; the bound keeps every node within ceil(1.25 * (n + 1) / 4) at each step. The
    key's ring order is d c a b: d, c and a fill up to the bound (313 after 1000), b takes the rest."""
    loads = dict.fromkeys(NODES, 0)
    for n in range(1000):
        node = route([Backend(x, True, loads[x]) for x in NODES], policy="hash", key="hot", load_factor=1.25).node_id
        loads[node] += 1
        assert max(loads.values()) <= math.ceil(1.25 * (n + 1) / 4)
    assert loads == {"a": 312, "b": 62, "c": 313, "d": 313}


def test_bad_inputs() -> None:
    with pytest.raises(NoBackend, match="none of the 4 backends is healthy"):
        route(backends(down=NODES), key="x")
    with pytest.raises(InvalidInput, match="routing policy must be one of kv, hash, round_robin, not 'random'"):
        route(backends(), policy="random")
    with pytest.raises(InvalidInput, match="load_factor must be at least 1"):
        route(backends(), load_factor=0.5)
