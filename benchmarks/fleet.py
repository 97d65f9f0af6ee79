"""Prompt tokens reused across a fleet of 4 nodes under ``round_robin``, ``hash`` and ``kv``
routing, against one node with the same total capacity, replaying the multi-turn chat
workload of ``benchmarks/tiers.py`` (:mod:`workload`).

Each node has three local tiers of pages, each an LRU of a fixed number of pages: ``device``
(the engine's KV memory), ``host`` and ``disk`` (a share of the trace's working set each, see
``--device``, ``--host``, ``--disk``); pages are keyed as dss keys them (namespace, and the
chain of tokens up to the page's end), so identical prefixes of one user share pages and
nothing is shared across users. Per request, in arrival order:

1. the router picks a node with :func:`dss.service.routing.route` — the same function ``dss route``
   calls — given each node's holdings of the request's leading pages per tier (what the
   catalog and the engines' registries tell the router), the nodes' loads (requests in
   flight: a request occupies its node from its arrival for ``--service-s`` seconds plus 10 ms
   per reply token), and the session id as the key;
2. on that node, the prompt's leading pages are reused while some tier holds them, each
   counted on the fastest tier holding it; the first page no tier holds ends the reuse, the
   rest is recomputed;
3. the node then holds every full page of prompt + reply on every tier (the engine computed
   or loaded them; dss writes them through to host and disk), most recently used.

A ``single`` node with 4x each capacity replays the same trace as the reference. Printed: the
share of prompt tokens reused per tier and in all, the ratio to ``single``, and the load
imbalance (max / mean requests per node). The remote tier is left out on purpose: with one,
every node reuses what any node wrote, and routing decides only how fast.

Bar: ``kv`` reuses at least 0.95x what ``single`` reuses, with imbalance <= 1.25.
Rerun with::

    PYTHONPATH=. .venv/bin/python benchmarks/fleet.py            # --turns 4000 --seed 1
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from progress import track
from workload import Request, WorkloadSpec, generate, prompt_tokens, reply_tokens, working_set_tokens

from dss.core.tokens import pack
from dss.service.routing import LOAD_FACTOR, LOCAL_TIERS, Backend, route

PAGE_TOKENS = 32
NODES = ("node-0", "node-1", "node-2", "node-3")
POLICIES = ("round_robin", "hash", "kv")


class Lru:
    """Page keys, least recently used first, at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.keys

    def touch(self, key: bytes) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


@dataclass
class Node:
    tiers: dict[str, Lru]
    requests: int = 0
    finishing: list[float] = field(default_factory=list)
    """Finish times of the requests in flight (a heap)."""

    def load(self, now: float) -> int:
        while self.finishing and self.finishing[0] <= now:
            heapq.heappop(self.finishing)
        return len(self.finishing)

    def held(self, keys: list[bytes]) -> dict[str, int]:
        """The leading pages of ``keys`` this node holds, counted on the fastest tier holding each."""
        out = dict.fromkeys(LOCAL_TIERS, 0)
        for key in keys:
            tier = next((t for t in LOCAL_TIERS if key in self.tiers[t]), None)
            if tier is None:
                break
            out[tier] += 1
        return {t: n for t, n in out.items() if n}

    def keep(self, keys: list[bytes]) -> None:
        for lru in self.tiers.values():
            for key in keys:
                lru.touch(key)


def page_keys(user_id: str, tokens: list[int]) -> list[bytes]:
    """One key per full page: the namespace and every token up to the page's end (a chain hash)."""
    chain = hashlib.blake2b(user_id.encode(), digest_size=16)
    out = []
    for start in range(0, len(tokens) - PAGE_TOKENS + 1, PAGE_TOKENS):
        chain.update(pack(tokens[start : start + PAGE_TOKENS]))
        out.append(chain.copy().digest())
    return out


@dataclass
class Result:
    name: str
    prompt_tokens: int
    reused: dict[str, int]
    requests: list[int]

    @property
    def share(self) -> float:
        return sum(self.reused.values()) / self.prompt_tokens

    @property
    def imbalance(self) -> float:
        return max(self.requests) / (sum(self.requests) / len(self.requests))


def replay(
    trace: list[Request], name: str, num_nodes: int, capacity: dict[str, int], service_s: float, load_factor: float
) -> Result:
    nodes = {f"node-{i}": Node({t: Lru(capacity[t]) for t in LOCAL_TIERS}) for i in range(num_nodes)}
    policy = "kv" if name == "single" else name
    reused = dict.fromkeys(LOCAL_TIERS, 0)
    total = 0
    for n, request in enumerate(track(trace, f"{name:<12}")):
        tokens = prompt_tokens(request)
        keys = page_keys(request.user_id, tokens)
        holdings = {node_id: node.held(keys) for node_id, node in nodes.items()} if policy == "kv" else None
        backends = [Backend(node_id, True, node.load(request.t)) for node_id, node in nodes.items()]
        node_id = route(
            backends, policy=policy, key=request.session_id, holdings=holdings, counter=n, load_factor=load_factor
        ).node_id
        node = nodes[node_id]
        held = holdings[node_id] if holdings is not None else node.held(keys)
        for tier, pages in held.items():
            reused[tier] += pages * PAGE_TOKENS
        total += len(tokens)
        node.requests += 1
        heapq.heappush(node.finishing, request.t + service_s + request.reply_tokens * 0.01)
        node.keep(page_keys(request.user_id, tokens + reply_tokens(request)))
    return Result(name, total, reused, [node.requests for node in nodes.values()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--device", type=float, default=0.02, help="device tier of one node, share of the working set")
    parser.add_argument("--host", type=float, default=0.05, help="host tier of one node, share of the working set")
    parser.add_argument("--disk", type=float, default=0.15, help="disk tier of one node, share of the working set")
    parser.add_argument(
        "--service-s", type=float, default=1.0, help="seconds a request occupies its node, plus 10 ms per reply token"
    )
    parser.add_argument(
        "--load-factor",
        type=float,
        default=LOAD_FACTOR,
        help="bound on a node's requests in flight, as a multiple of the mean (dss route's default)",
    )
    args = parser.parse_args()
    trace = generate(WorkloadSpec(turns=args.turns, rate=args.rate), seed=args.seed)
    working = working_set_tokens(trace, PAGE_TOKENS) // PAGE_TOKENS
    capacity = {
        "device": int(args.device * working),
        "host": int(args.host * working),
        "disk": int(args.disk * working),
    }
    print(
        f"fleet: {len(trace)} requests, working set {working} pages of {PAGE_TOKENS} tokens; per node "
        f"device {capacity['device']}, host {capacity['host']}, disk {capacity['disk']} pages; "
        f"4 nodes vs one with 4x each"
    )
    results = [replay(trace, "single", 1, {t: 4 * c for t, c in capacity.items()}, args.service_s, args.load_factor)]
    results += [replay(trace, policy, len(NODES), capacity, args.service_s, args.load_factor) for policy in POLICIES]
    single = results[0].share
    print(
        f"\n{'routing':<13}{'device':>9}{'host':>9}{'disk':>9}{'reused':>9}{'vs single':>11}{'imbalance':>11}"
        f"  requests per node"
    )
    for r in results:
        shares = [r.reused[t] / r.prompt_tokens for t in LOCAL_TIERS]
        print(
            f"{r.name:<13}" + "".join(f"{s:>9.3f}" for s in shares) + f"{r.share:>9.3f}{r.share / single:>10.3f}x"
            f"{r.imbalance:>11.3f}  {' '.join(map(str, r.requests))}"
        )
    kv = results[-1]
    ok = kv.share >= 0.95 * single and kv.imbalance <= 1.25
    print(
        f"\nbar: kv reuses {kv.share / single:.3f}x of single (>= 0.95) with imbalance {kv.imbalance:.3f} "
        f"(<= 1.25): {'met' if ok else 'NOT met'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
