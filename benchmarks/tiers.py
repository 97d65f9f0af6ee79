"""Where prompt tokens are served from, under dss's placement policy, plain LRU and Belady's
offline optimum, replaying a multi-turn chat workload (:mod:`workload`) through the real store.

For each host capacity (a share of the trace's working set: every page it ever stores) and
each policy, a fresh store (disk larger than the working set, so every policy has the same
pages available and differs only in what host keeps) replays the trace with its clock injected
(think times cost nothing): per request ``resume`` the prompt, ``read_pages`` the matched pages
(the engine's load), commit prompt + reply with the new pages, run the mover. Tokens are
counted by the tier that served them (host, disk) or recomputed. Belady's optimum is computed
from the same trace of page reads and writes: a host of the same capacity that, when full,
drops the page (the arriving one included) whose next read is furthest away.

The estimated load time prices a token at 128 KiB of KV (an 8B model), host at
``host_read_gbps`` (8 GB/s), disk at ``disk_read_gbps`` (1 GB/s), recompute at
``recompute_tokens_per_s`` (4000/s): dss's default rates.

``dss+prefetch`` is dss with the session-aware prefetch a chat backend would call when the user
starts typing (``PREFETCH_S`` before each turn); the bar is judged on ``dss`` alone.

Bar (issue 10): dss >= LRU in host share at every capacity; at 2 % and 5 % at least 1.5x LRU's
host share, or half of the LRU-to-Belady gap closed, whichever is smaller. Rerun with::

    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py            # --turns 1000 --seed 1

For a notebook: ``from tiers import run, table`` then ``rows = run((0.02, 0.05), seed=1)``.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from progress import track
from workload import Request, WorkloadSpec, generate, prompt_tokens, reply_tokens, system_prompt, working_set_tokens

import dss

CAPACITIES = (0.02, 0.05, 0.10, 0.20)
POLICIES = ("dss", "lru", "belady", "dss+prefetch")
PREFETCH_S = 2.0
"""``dss+prefetch``: the chat backend calls ``store.prefetch(session)`` when the user starts
typing, this many seconds before the turn arrives."""
PAGE_TOKENS = 32
PAGE_BYTES = 512
KV_BYTES_PER_TOKEN = 128 << 10
HOST_BPS, DISK_BPS, RECOMPUTE_TPS = 8e9, 1e9, 4000.0
LAYOUT = dss.Layout(name="bench-tiers", page_tokens=PAGE_TOKENS, page_bytes=PAGE_BYTES)


@dataclass
class Row:
    """One policy at one host capacity."""

    capacity: float
    policy: str
    host_pages: int
    prompt_tokens: int
    host_tokens: int
    disk_tokens: int
    recompute_tokens: int
    promotions: int = 0
    demotions: int = 0
    inline_evictions: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0

    @property
    def host_share(self) -> float:
        return self.host_tokens / self.prompt_tokens

    @property
    def disk_share(self) -> float:
        return self.disk_tokens / self.prompt_tokens

    @property
    def recompute_share(self) -> float:
        return self.recompute_tokens / self.prompt_tokens

    @property
    def load_s(self) -> float:
        """Estimated time to get every prompt's KV: loads from host and disk, the rest recomputed."""
        kv = KV_BYTES_PER_TOKEN
        return (
            self.host_tokens * kv / HOST_BPS + self.disk_tokens * kv / DISK_BPS + self.recompute_tokens / RECOMPUTE_TPS
        )

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "host_share": self.host_share,
            "disk_share": self.disk_share,
            "recompute_share": self.recompute_share,
            "load_s": self.load_s,
        }


@dataclass
class Trace:
    """What a replay saw, per request: the pages read (available ones, in prompt order) and the
    pages written; Belady's optimum is computed from it."""

    reads: list[list[bytes]]
    writes: list[list[bytes]]
    prompt_tokens: int
    recompute_tokens: int


def _payload(i: int) -> bytes:
    return (i % 251).to_bytes(1, "big") * PAGE_BYTES


def replay(
    requests: Sequence[Request],
    policy: str,
    host_pages: int,
    disk_pages: int,
    folder: Path,
    label: str = "",
    **options: object,
) -> tuple[Row, Trace]:
    """Replay ``requests`` through a fresh store in ``folder`` with ``policy`` (``dss+prefetch``:
    dss, and a prefetch of the session ``PREFETCH_S`` before each of its turns) and a host of
    ``host_pages`` pages; returns the row and the page trace."""
    now = [0.0]
    name, prefetch = policy, policy.endswith("+prefetch")
    policy = policy.removesuffix("+prefetch")
    events: list[tuple[float, int, Request | None, str]] = [(r.t, 1, r, r.session_id) for r in requests]
    if prefetch:
        events += [(r.t - PREFETCH_S, 0, None, r.session_id) for r in requests if r.turn]
    events.sort(key=lambda e: (e[0], e[1]))
    store = dss.open(
        folder,
        encrypt=False,
        fsync=False,
        mover=False,
        policy=policy,
        clock=lambda: now[0],
        host_bytes=host_pages * PAGE_BYTES,
        disk_bytes=disk_pages * (PAGE_BYTES + 64),
        segment_bytes=1 << 20,
        **options,
    )
    trace = Trace([], [], 0, 0)
    host = disk = recompute = 0
    try:
        seen_systems: set[int] = set()
        for r in requests:
            if r.system_id not in seen_systems:
                seen_systems.add(r.system_id)
                tokens = system_prompt(r.system_id, r.system_tokens, r.seed)
                n = len(tokens) // PAGE_TOKENS
                store.register_prefix(tokens, {i: _payload(i) for i in range(n)}, layout=LAYOUT, tenant_id=r.tenant_id)
        for t, _, r, session_id in track(events, label or name, total=len(events)):
            now[0] = t
            if r is None:
                with contextlib.suppress(dss.UnknownSession):  # typing began before the first turn was in
                    store.prefetch(session_id, wait=True)
                continue
            if r.turn == 0:
                store.create_session(r.session_id, user_id=r.user_id, tenant_id=r.tenant_id, layout=LAYOUT)
            prompt = prompt_tokens(r)
            result = store.resume(r.session_id, prompt, tenant_id=r.tenant_id)
            tiers = result.tiers
            host += tiers.get("host", 0)
            disk += tiers.get("disk", 0)
            recompute += len(prompt) - result.matched_tokens
            refs = result.pages
            store.read_pages(refs, tenant_id=r.tenant_id)
            trace.reads.append([ref.page_id for ref in refs])
            history = prompt + reply_tokens(r)
            first = result.matched_tokens // PAGE_TOKENS
            now[0] = r.t + 0.5
            store.commit(
                r.session_id,
                history,
                {i: _payload(i) for i in range(first, len(history) // PAGE_TOKENS)},
                tenant_id=r.tenant_id,
            )
            if policy == "lru":  # Belady's trace: the pages the commit stored
                after = store.resume(r.session_id, history, tenant_id=r.tenant_id).pages
                trace.writes.append([ref.page_id for ref in after if ref.index >= first])
            store.run_mover()
        stats = store.stats()
    finally:
        store.close()
    prompt_total = sum(r.prompt_len for r in requests)
    trace.prompt_tokens, trace.recompute_tokens = prompt_total, recompute
    row = Row(
        0.0,
        name,
        host_pages,
        prompt_total,
        host,
        disk,
        recompute,
        stats["host"]["promotions"],
        stats["host"]["demotions"],
        stats["host"]["inline_evictions"],
        stats["prefetch"]["hits"],
        stats["prefetch"]["wasted"],
    )
    return row, trace


def belady(trace: Trace, host_pages: int) -> Row:
    """Belady's offline optimum on ``trace``: a host of ``host_pages`` pages that, when full,
    drops the page whose next read is furthest in the future (the arriving one if it is)."""
    INF = float("inf")
    # the position of every read, in one global order: request i reads, then writes
    nexts: dict[bytes, list[int]] = {}
    pos = 0
    for reads, writes in zip(trace.reads, trace.writes):
        for p in reads:
            nexts.setdefault(p, []).append(pos)
            pos += 1
    for lst in nexts.values():
        lst.reverse()  # pop() gives the next read

    def next_read(p: bytes) -> float:
        lst = nexts.get(p)
        return lst[-1] if lst else INF

    cache: set[bytes] = set()
    heap: list[tuple[float, bytes]] = []  # (-next read, page): lazy, stale entries skipped

    def admit(p: bytes) -> None:
        nr = next_read(p)
        if nr == INF:
            return  # never read again: not worth a slot
        if len(cache) >= host_pages:
            while heap:
                neg, q = heap[0]
                if q not in cache or -neg != next_read(q):
                    heapq.heappop(heap)
                    continue
                break
            if not heap or -heap[0][0] <= nr:
                return  # every cached page is read sooner than p
            _, q = heapq.heappop(heap)
            cache.discard(q)
        cache.add(p)
        heapq.heappush(heap, (-nr, p))

    hits = 0
    pos = 0
    tokens_host = 0
    for reads, writes in zip(trace.reads, trace.writes):
        for p in reads:
            nexts[p].pop()
            pos += 1
            if p in cache:
                hits += 1
                heapq.heappush(heap, (-next_read(p), p))
                if next_read(p) == INF:
                    cache.discard(p)
            else:
                admit(p)
        for p in writes:
            if p not in cache:
                admit(p)
    tokens_host = hits * PAGE_TOKENS
    matched = trace.prompt_tokens - trace.recompute_tokens
    return Row(
        0.0, "belady", host_pages, trace.prompt_tokens, tokens_host, matched - tokens_host, trace.recompute_tokens
    )


def run(
    capacities: Iterable[float] = CAPACITIES,
    policies: Iterable[str] = POLICIES,
    seed: int = 1,
    spec: WorkloadSpec | None = None,
) -> list[Row]:
    """Replay the workload of ``spec`` and ``seed`` at each host capacity (share of the working
    set) under each policy; Belady comes from the trace of the LRU replay (every policy has the
    same pages available: the disk holds the whole working set)."""
    requests = generate(spec or WorkloadSpec(), seed)
    working_pages = working_set_tokens(requests, PAGE_TOKENS) // PAGE_TOKENS
    disk_pages = int(working_pages * 1.5) + 64
    rows: list[Row] = []
    wanted = list(policies)
    replayed = [p for p in wanted if p != "belady"]
    if "belady" in wanted and "lru" not in replayed:
        replayed.append("lru")  # Belady's trace comes from the LRU replay
    for capacity in capacities:
        host_pages = max(1, int(working_pages * capacity))
        trace = None
        for policy in replayed:
            with tempfile.TemporaryDirectory(prefix="dss-tiers-") as tmp:
                row, got = replay(
                    requests, policy, host_pages, disk_pages, Path(tmp) / "store", f"{policy} at {capacity:.0%} host"
                )
            if policy == "lru":
                trace = got
            row.capacity = capacity
            if policy in wanted:
                rows.append(row)
        if "belady" in wanted and trace is not None:
            row = belady(trace, host_pages)
            row.capacity = capacity
            rows.append(row)
    return rows


def verdict(rows: Sequence[Row]) -> list[str]:
    """The bar, one line per capacity: dss against LRU (and Belady)."""
    out = []
    by = {(r.capacity, r.policy): r for r in rows}
    for capacity in sorted({r.capacity for r in rows}):
        d, lru, opt = by.get((capacity, "dss")), by.get((capacity, "lru")), by.get((capacity, "belady"))
        if d is None or lru is None:
            continue
        ratio = d.host_share / lru.host_share if lru.host_share else float("inf")
        pf = by.get((capacity, "dss+prefetch"))
        line = f"{capacity:>5.0%} host: dss/lru host share {ratio:.2f}x"
        ok = d.host_share >= lru.host_share
        if opt is not None and opt.host_share > lru.host_share:
            closed = (d.host_share - lru.host_share) / (opt.host_share - lru.host_share)
            line += f", closes {closed:.0%} of the LRU-to-Belady gap"
            if capacity <= 0.05:
                target = min(1.5 * lru.host_share, lru.host_share + 0.5 * (opt.host_share - lru.host_share))
                ok = ok and d.host_share >= target
        line += "  OK" if ok else "  BELOW THE BAR"
        if pf is not None and lru.host_share:
            line += f"   (dss+prefetch: {pf.host_share / lru.host_share:.2f}x lru)"
        out.append(line)
    return out


def table(rows: Sequence[Row]) -> str:
    """The rows as a text table."""
    head = (
        f"{'host cap':>8}  {'policy':<12} {'host':>7} {'disk':>7} {'recomp':>7} {'load s':>9} "
        f"{'promo':>7} {'demo':>7} {'inline':>6} {'pf hit':>7} {'pf waste':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.capacity:>8.0%}  {r.policy:<12} {r.host_share:>7.1%} {r.disk_share:>7.1%} "
            f"{r.recompute_share:>7.1%} {r.load_s:>9.1f} {r.promotions:>7} {r.demotions:>7} "
            f"{r.inline_evictions:>6} {r.prefetch_hits:>7} {r.prefetch_wasted:>8}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1000, help="requests in the trace (default 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--capacities", type=float, nargs="+", default=list(CAPACITIES))
    args = parser.parse_args(argv)
    spec = WorkloadSpec(turns=args.turns)
    print(f"spec: {spec}")
    requests = generate(spec, args.seed)
    print(
        f"workload: {len(requests)} requests, seed {args.seed}, working set "
        f"{working_set_tokens(requests, PAGE_TOKENS):,} tokens in pages of {PAGE_TOKENS}; disk 1.5x the working set"
    )
    rows = run(args.capacities, POLICIES, args.seed, spec)
    print(
        "share of prompt tokens served from each tier (host, disk) or recomputed; "
        "load s: estimated time to get every prompt's KV"
    )
    print(table(rows))
    for line in verdict(rows):
        print(line)


if __name__ == "__main__":
    main()
