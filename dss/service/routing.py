"""Where a request goes: the router's decision, as a pure function of plain values.

:func:`route` picks one node (engine replica) for a request, given the backends (each with
its node id, health and load), the request's key (its session id, else something stable
about its prompt, else nothing) and, for the ``kv`` policy, how many of the session's head
pages each node holds on each tier. It reads nothing and changes nothing; the proxy
(:mod:`dss.service.router`) gathers the inputs and keeps the round-robin counter.

Policies:

``kv`` (default)
    The healthy node with the most reusable head pages wins: most pages on any local tier,
    ties broken by more on ``device``, then on ``host`` (faster tiers load faster), then by
    the hash order below. A node at its load bound is passed over (the next holder is
    tried). When no node under its bound holds any page — a new session, a request without
    one, a node that died — the request falls back to ``hash``.
``hash``
    Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): each node
    has :data:`POINTS` points on a ring (BLAKE2b of ``"<node id>#<i>"``); the key's point
    (BLAKE2b of the key) walks the ring clockwise to the first healthy node whose load is
    under the bound ``ceil(load_factor * (total load + 1) / healthy nodes)``. A node joining
    or leaving moves only the keys next to its points; the bound keeps a hot key range from
    piling onto one node. A request without a key goes to the least-loaded healthy node.
``round_robin``
    The ``counter``-th healthy node in the given order (a baseline for comparison).

Every function raises ``NoBackend`` when no backend is healthy, and ``InvalidInput`` for a
policy it does not know or a load factor below 1.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dss.core.errors import InvalidInput, NoBackend

Policy = Literal["kv", "hash", "round_robin"]
POLICIES: tuple[str, ...] = ("kv", "hash", "round_robin")
LOCAL_TIERS: tuple[str, ...] = ("device", "host", "disk")
"""The tiers of one node, fastest first (the remote tier is every node's alike: it does not count)."""
POINTS = 64
"""Points of each node on the hash ring."""
LOAD_FACTOR = 2.0
"""Default bound on a node's load, as a multiple of the mean (``c`` of bounded-load hashing).
Loads are requests in flight, small integers: with 1.25, a fleet averaging 1.4 requests per
node bounds each at 2 and breaks sessions' affinity all the time (``benchmarks/fleet.py``:
kv reuses 0.88x of one big node at 1.25, 0.96x at 2.0, with imbalance 1.05 and 1.07)."""


@dataclass(frozen=True, slots=True)
class Backend:
    """One engine replica as the router sees it: its node id, whether it answers its health
    check, and its load (requests in flight there)."""

    node_id: str
    is_healthy: bool = True
    load: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why: ``reason`` is ``kv`` (the node holding most of the
    head's pages), ``hash``, ``least_loaded`` (no key) or ``round_robin``; ``held`` is the
    head's pages that node holds per local tier (empty unless ``kv``)."""

    node_id: str
    reason: str
    held: Mapping[str, int]


Holdings = Mapping[str, Mapping[str, int]]
"""Pages of a session's head held per node id, then per tier (``{"node-a": {"host": 3}}``);
nodes and tiers absent hold none."""


def route(
    backends: Sequence[Backend],
    *,
    policy: str = "kv",
    key: str | None = None,
    holdings: Holdings | None = None,
    counter: int = 0,
    load_factor: float = LOAD_FACTOR,
) -> Decision:
    """The node a request goes to; see the module docstring. Pure: reads only its arguments."""
    if policy not in POLICIES:
        raise InvalidInput(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if not load_factor >= 1:
        raise InvalidInput(f"load_factor must be at least 1, not {load_factor!r}")
    healthy = [b for b in backends if b.is_healthy]
    if not healthy:
        raise NoBackend(f"none of the {len(backends)} backends is healthy")
    if policy == "round_robin":
        return Decision(healthy[counter % len(healthy)].node_id, "round_robin", {})
    bound = load_bound(healthy, load_factor)
    if policy == "kv" and holdings:
        held = kv_choice(healthy, holdings, bound, key)
        if held is not None:
            return Decision(held.node_id, "kv", dict(holdings.get(held.node_id, {})))
    if key is None:
        least = min(healthy, key=lambda b: b.load)
        return Decision(least.node_id, "least_loaded", {})
    return Decision(hash_choice(healthy, key, bound).node_id, "hash", {})


def load_bound(healthy: Sequence[Backend], load_factor: float) -> int:
    """The most requests a node may have in flight and still take one more (at least 1)."""
    total = sum(b.load for b in healthy)
    return max(1, math.ceil(load_factor * (total + 1) / len(healthy)))


def score(held: Mapping[str, int]) -> tuple[int, ...]:
    """How good a node's holdings are: total pages on local tiers, then device, then host."""
    return (sum(held.get(t, 0) for t in LOCAL_TIERS), held.get("device", 0), held.get("host", 0))


def kv_choice(healthy: Sequence[Backend], holdings: Holdings, bound: int, key: str | None) -> Backend | None:
    """The node under its load bound with the best :func:`score` (ties: the key's ring order,
    else the given order); ``None`` when none under its bound holds a page."""
    order = (
        {node: i for i, node in enumerate(ring_order(tuple(sorted(b.node_id for b in healthy)), key))}
        if key is not None
        else {b.node_id: i for i, b in enumerate(healthy)}
    )
    best: tuple[tuple[int, ...], int] | None = None
    chosen = None
    for backend in healthy:
        held = holdings.get(backend.node_id, {})
        rank = score(held)
        if rank[0] <= 0 or backend.load >= bound:
            continue
        candidate = (tuple(-x for x in rank), order[backend.node_id])
        if best is None or candidate < best:
            best, chosen = candidate, backend
    return chosen


def hash_choice(healthy: Sequence[Backend], key: str, bound: int) -> Backend:
    """The first node clockwise from ``key`` on the ring whose load is under ``bound``."""
    by_id = {b.node_id: b for b in healthy}
    for node in ring_order(tuple(sorted(by_id)), key):
        if by_id[node].load < bound:
            return by_id[node]
    return min(healthy, key=lambda b: b.load)  # unreachable: the bound exceeds the mean load


def ring_order(node_ids: tuple[str, ...], key: str) -> list[str]:
    """Every node once, in the order the ring walks them clockwise from ``key``'s point."""
    points, owners = _ring(node_ids)
    start = bisect.bisect_right(points, _point(key))
    seen: list[str] = []
    for i in range(len(points)):
        node = owners[(start + i) % len(points)]
        if node not in seen:
            seen.append(node)
            if len(seen) == len(node_ids):
                break
    return seen


@functools.lru_cache(maxsize=64)
def _ring(node_ids: tuple[str, ...]) -> tuple[list[int], list[str]]:
    placed = sorted((_point(f"{node}#{i}"), node) for node in node_ids for i in range(POINTS))
    return [p for p, _ in placed], [n for _, n in placed]


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


__all__ = [
    "LOAD_FACTOR",
    "LOCAL_TIERS",
    "POINTS",
    "POLICIES",
    "Backend",
    "Decision",
    "Holdings",
    "Policy",
    "hash_choice",
    "kv_choice",
    "load_bound",
    "ring_order",
    "route",
    "score",
]
