"""Where prompt tokens are served from, under dss's placement policy, plain LRU and Belady's
offline optimum, replaying a workload through the real store (:mod:`replay`).

Three workloads, each at host and disk capacities given as shares of its working set (every
page it ever stores):

* the multi-turn **chat** workload (:mod:`workload`) with sessions, as a chat backend drives
  the store (the default: host 2, 5, 10 and 20 %, a disk of 1.5x the working set, where every
  policy has the same pages available and differs only in what host keeps);
* the same workload **sessionless** (``--sessionless``): prefix lookups with no session or user,
  as the vLLM connector serves a request that names none;
* a published **block-hash trace** (``--trace synthetic`` or ``conversation``, from Mooncake:
  ``benchmarks/traces/``) replayed as sessionless lookups (host 2 %, disks of 20 and 40 %).

Policies: ``dss`` (default settings), ``lru``, ``belady`` (computed from the trace: on host alone,
with a disk behind it holding everything, and — the bound on the total — on host and disk as one
tier), ``dss+prefetch`` (chat with sessions: dss, and the backend's ``prefetch`` 2 s before each
turn). ``--watermarks 0.95/0.90 0.99/0.97`` adds dss at those disk watermarks (a sweep).

The estimated load time prices a token at 128 KiB of KV (an 8B model), host at 8 GB/s, disk at
1 GB/s, recompute at 4000 tokens/s: dss's default rates.

Bars. Chat with sessions: dss >= LRU in host share at every capacity; at 2 % and 5 % at least
1.5x LRU's host share, or half of the LRU-to-Belady gap closed, whichever is smaller. Small disks
and traces: dss's total above LRU's, within 0.5 point of the best watermark setting tried, and its
host share at least 1.5x LRU's. Rerun with::

    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py            # --turns 1000 --seed 1
    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py --disks 0.2 0.4 --capacities 0.02 0.05
    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py --sessionless --disks 0.2 0.4 --capacities 0.02 0.05
    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py --trace synthetic --watermarks 0.95/0.90 0.99/0.97
    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py --trace conversation
    PYTHONPATH=. .venv/bin/python benchmarks/tiers.py --trace conversation --precision int8 k8v4

``--precision int8 k8v4`` (traces) adds dss with the same disk bytes holding pages of those
encodings (a disk tier at ``disk_precision``): 1.94x and 2.51x the pages of a SmolLM2 bf16 page,
and the hit share that buys; every token served from such a disk is approximate (``disk`` column).

For a notebook: ``from tiers import run, table`` then ``rows = run((0.02, 0.05), seed=1)``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mooncake
from mooncake import BLOCK_TOKENS
from optimum import belady as optimum
from progress import track
from replay import (
    PAGE_TOKENS,
    Row,
    Trace,
    replay_blocks,
    replay_chat,
)
from workload import WorkloadSpec, generate, working_set_tokens

from dss.core import packing

__all__ = ["PAGE_TOKENS", "Row", "Trace", "belady", "run", "run_trace", "table", "verdict"]

CAPACITIES = (0.02, 0.05, 0.10, 0.20)
DISKS = (1.5,)
POLICIES = ("dss", "lru", "belady", "dss+prefetch")
TRACE_CAPACITIES = (0.02,)
TRACE_DISKS = (0.2, 0.4)
TRACE_POLICIES = ("dss", "lru", "belady")


def belady(trace: Trace, host_pages: int) -> Row:
    """Belady's optimum on host alone (a disk holding every page behind it) on a chat replay's
    ``trace``; the rest of what was matched counts as disk."""
    hits = optimum([r + w for r, w in zip(trace.reads, trace.writes)], host_pages, prefix=False)
    host = hits * PAGE_TOKENS
    matched = trace.prompt_tokens - trace.recompute_tokens
    return Row(0.0, 0.0, "belady", host_pages, trace.prompt_tokens, host, matched - host, trace.recompute_tokens)


def _bound(host_hits: int, total_hits: int, page_tokens: int, prompt_tokens: int, host_pages: int) -> Row:
    """Belady's row: host as on host alone, the total as on host and disk as one tier."""
    host, total = host_hits * page_tokens, max(host_hits, total_hits) * page_tokens
    return Row(0.0, 0.0, "belady", host_pages, prompt_tokens, host, total - host, prompt_tokens - total)


def _sweep(watermarks: Iterable[tuple[float, float]]) -> list[tuple[str, dict]]:
    """The dss replays besides the default: one per disk watermark setting of the sweep."""
    return [
        (f"dss {high:g}/{low:g}", {"disk_high_watermark": high, "disk_low_watermark": low}) for high, low in watermarks
    ]


def run(
    capacities: Iterable[float] = CAPACITIES,
    policies: Iterable[str] = POLICIES,
    seed: int = 1,
    spec: WorkloadSpec | None = None,
    *,
    disks: Iterable[float] = DISKS,
    sessions: bool = True,
    watermarks: Iterable[tuple[float, float]] = (),
) -> list[Row]:
    """Replay the chat workload of ``spec`` and ``seed`` at each disk and host capacity (shares of
    the working set) under each policy; Belady comes from the trace of an LRU replay whose disk
    holds the whole working set (every page available)."""
    requests = generate(spec or WorkloadSpec(), seed)
    working = working_set_tokens(requests, PAGE_TOKENS) // PAGE_TOKENS
    wanted = [p for p in policies if sessions or p != "dss+prefetch"]
    replayed = [(p, {}) for p in wanted if p != "belady"] + _sweep(watermarks)
    ideal: Trace | None = None
    rows: list[Row] = []
    for disk in disks:
        disk_pages = int(working * disk) + 64
        for capacity in capacities:
            host_pages = max(1, int(working * capacity))
            for name, settings in replayed:
                label = f"{name} at {capacity:.0%} host, disk {disk:g}x"
                row, trace = _chat(requests, name, host_pages, disk_pages, sessions, label, settings)
                if name == "lru" and disk >= 1.5:
                    ideal = ideal or trace
                row.policy, row.capacity, row.disk, row.settings = name, capacity, disk, settings
                rows.append(row)
            if "belady" in wanted:
                if ideal is None:
                    _, ideal = _chat(requests, "lru", 1, int(working * 1.5) + 64, sessions, "Belady's trace", {})
                rows.append(_chat_bound(ideal, host_pages, disk_pages, capacity, disk))
    return rows


def _chat(
    requests: Sequence, policy: str, host_pages: int, disk_pages: int, sessions: bool, label: str, settings: dict
) -> tuple[Row, Trace]:
    with tempfile.TemporaryDirectory(prefix="dss-tiers-") as tmp:
        return replay_chat(
            requests,
            policy.split(" ")[0],
            host_pages,
            disk_pages,
            Path(tmp) / "store",
            sessions=sessions,
            progress=lambda items: track(items, label, total=len(items)),
            **settings,
        )


def _chat_bound(ideal: Trace, host_pages: int, disk_pages: int, capacity: float, disk: float) -> Row:
    pages = [r + w for r, w in zip(ideal.reads, ideal.writes)]
    host = optimum(pages, host_pages, prefix=False)
    written: set[bytes] = set()
    stored_before: dict[bytes, None] = {}  # pages read before any request wrote them: the shared prefixes
    for r, w in zip(ideal.reads, ideal.writes):
        stored_before.update((p, None) for p in r if p not in written)
        written.update(w)
    total = optimum([list(stored_before), *pages], host_pages + disk_pages, prefix=True)
    row = _bound(host, total, PAGE_TOKENS, ideal.prompt_tokens, host_pages)
    matched = ideal.prompt_tokens - ideal.recompute_tokens  # what a disk holding everything matches
    if row.host_tokens + row.disk_tokens > matched:
        row.disk_tokens = max(0, matched - row.host_tokens)
        row.recompute_tokens = ideal.prompt_tokens - row.host_tokens - row.disk_tokens
    row.capacity, row.disk = capacity, disk
    return row


def run_trace(
    name: str,
    capacities: Iterable[float] = TRACE_CAPACITIES,
    policies: Iterable[str] = TRACE_POLICIES,
    *,
    disks: Iterable[float] = TRACE_DISKS,
    watermarks: Iterable[tuple[float, float]] = (),
    limit: int | None = None,
    encodings: Iterable[str] = (),
) -> list[Row]:
    """Replay a block-hash trace (:mod:`mooncake`; its first ``limit`` requests) as sessionless
    lookups at each disk and host capacity (shares of its distinct blocks) under each policy.
    Each of ``encodings`` adds dss with the same disk bytes holding pages of that encoding
    (:func:`pages_per_disk`: more pages than exact ones; row ``dss@int8``, say)."""
    requests = mooncake.load(name, limit)
    working = mooncake.distinct_blocks(requests)
    wanted = list(policies)
    replayed = [(p, {}) for p in wanted if p not in ("belady", "dss+prefetch")] + _sweep(watermarks)
    replayed += [(f"dss@{e}", {}) for e in encodings]
    rows: list[Row] = []
    for disk in disks:
        disk_pages = max(1, int(working * disk))
        for capacity in capacities:
            host_pages = max(1, int(working * capacity))
            for policy, settings in replayed:
                label = f"{policy} at {capacity:.0%} host, disk {disk:.0%}"
                encoding = policy.partition("@")[2] or "exact"
                with tempfile.TemporaryDirectory(prefix="dss-tiers-") as tmp:
                    row = replay_blocks(
                        requests,
                        policy.split(" ")[0].split("@")[0],
                        host_pages,
                        pages_per_disk(disk_pages, encoding),
                        Path(tmp) / "store",
                        progress=lambda items, label=label: track(items, label, total=len(items)),
                        **settings,
                    )
                row.policy, row.capacity, row.disk, row.settings = policy, capacity, disk, settings
                rows.append(row)
            if "belady" in wanted:
                rows.append(_trace_bound(requests, host_pages, disk_pages, capacity, disk))
    return rows


def pages_per_disk(exact_pages: int, encoding: str) -> int:
    """How many pages of ``encoding`` the disk bytes of ``exact_pages`` exact pages hold: the
    ratio of a SmolLM2-135M bf16 page of 32 tokens (737,280 bytes exact; int8 and fp8 0.516 of
    that, k8v4 0.398; :func:`dss.core.packing.encoded_size`)."""
    shape = packing.PageShape("bfloat16", 60, 96, 64)
    return int(exact_pages * shape.exact_bytes / packing.encoded_size(shape, encoding))


def _trace_bound(
    requests: Sequence[mooncake.BlockRequest], host_pages: int, disk_pages: int, capacity: float, disk: float
) -> Row:
    pages = [r.hash_ids for r in requests]
    total = optimum(pages, host_pages + disk_pages, prefix=True)
    row = _bound(_host_bound(pages, host_pages), total, BLOCK_TOKENS, sum(map(len, pages)) * BLOCK_TOKENS, host_pages)
    row.capacity, row.disk = capacity, disk
    return row


def _host_bound(pages: Sequence[Sequence[int]], host_pages: int) -> int:
    """Belady on host alone with a disk holding everything behind it: every cached block of a
    request counts (the disk serves the others, so the prefix never breaks). The blocks past a
    request's match are new (a block's id stands for its whole prefix): never cached before
    they are written, so they count as they should, as misses."""
    return optimum(pages, host_pages, prefix=False)


def verdict(rows: Sequence[Row]) -> list[str]:
    """The bars, one line per disk and host capacity: dss against LRU (and Belady, and the best
    watermark setting tried)."""
    out = []
    by = {(r.disk, r.capacity, r.policy): r for r in rows}
    for disk, capacity in sorted({(r.disk, r.capacity) for r in rows}):
        d, lru, opt = (by.get((disk, capacity, p)) for p in ("dss", "lru", "belady"))
        if d is None or lru is None:
            continue
        ratio = d.host_share / lru.host_share if lru.host_share else float("inf")
        line = f"disk {disk:g}x, {capacity:>4.0%} host: dss/lru host share {ratio:.2f}x"
        if disk >= 1.5:  # every policy has every page: the host share is all that differs
            ok = d.host_share >= lru.host_share
            if opt is not None and opt.host_share > lru.host_share:
                closed = (d.host_share - lru.host_share) / (opt.host_share - lru.host_share)
                line += f", closes {closed:.0%} of the LRU-to-Belady gap"
                if capacity <= 0.05:
                    target = min(1.5 * lru.host_share, lru.host_share + 0.5 * (opt.host_share - lru.host_share))
                    ok = ok and d.host_share >= target
        else:
            ok = ratio >= 1.5 and d.total_share > lru.total_share
            line += f"; total {d.total_share:.2%} (lru {lru.total_share:.2%}"
            line += f", belady {opt.total_share:.2%})" if opt is not None else ")"
            tried = [r for r in rows if (r.disk, r.capacity) == (disk, capacity) and r.policy.startswith("dss ")]
            best = max([d, *tried], key=lambda r: r.total_share)
            if tried:
                line += (
                    f", {(best.total_share - d.total_share) * 100:.2f} points below the best setting ({best.policy})"
                )
                ok = ok and best.total_share - d.total_share <= 0.005
        line += "  OK" if ok else "  BELOW THE BAR"
        pf = by.get((disk, capacity, "dss+prefetch"))
        if pf is not None and lru.host_share:
            line += f"   (dss+prefetch: {pf.host_share / lru.host_share:.2f}x lru)"
        out.append(line)
    return out


def table(rows: Sequence[Row]) -> str:
    """The rows as a text table."""
    head = (
        f"{'disk':>5} {'host cap':>8}  {'policy':<15} {'host':>7} {'disk':>7} {'total':>7} {'recomp':>7} "
        f"{'load s':>9} {'promo':>7} {'demo':>7} {'inline':>6} {'d inline':>8} {'pf hit':>7} {'pf waste':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.disk:>4g}x {r.capacity:>8.0%}  {r.policy:<15} {r.host_share:>7.1%} {r.disk_share:>7.1%} "
            f"{r.total_share:>7.1%} {r.recompute_share:>7.1%} {r.load_s:>9.1f} {r.promotions:>7} {r.demotions:>7} "
            f"{r.inline_evictions:>6} {r.disk_inline_evictions:>8} {r.prefetch_hits:>7} {r.prefetch_wasted:>8}"
        )
    return "\n".join(lines)


def _watermark(text: str) -> tuple[float, float]:
    high, _, low = text.partition("/")
    return float(high), float(low)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=1000, help="chat: requests in the workload (default 1000)")
    parser.add_argument("--seed", type=int, default=1, help="chat: the workload's seed")
    parser.add_argument("--sessionless", action="store_true", help="chat: lookups without a session or user")
    parser.add_argument("--trace", default=None, help="replay a block-hash trace: synthetic, conversation or a path")
    parser.add_argument("--requests", type=int, default=None, help="trace: replay only its first N requests")
    parser.add_argument("--capacities", type=float, nargs="+", default=None, help="host capacities (shares)")
    parser.add_argument("--disks", type=float, nargs="+", default=None, help="disk capacities (shares)")
    parser.add_argument(
        "--precision", nargs="*", default=[], metavar="ENCODING", help="trace: dss with disks of these encodings too"
    )
    parser.add_argument(
        "--watermarks", type=_watermark, nargs="*", default=[], metavar="HIGH/LOW", help="dss at these disk marks too"
    )
    args = parser.parse_args(argv)
    if args.trace is not None:
        requests = mooncake.load(args.trace, args.requests)
        print(
            f"trace {args.trace}: {len(requests)} requests, {mooncake.distinct_blocks(requests):,} distinct blocks, "
            "replayed as lookups without a session or user; capacities are shares of the distinct blocks"
        )
        rows = run_trace(
            args.trace,
            args.capacities or TRACE_CAPACITIES,
            disks=args.disks or TRACE_DISKS,
            watermarks=args.watermarks,
            limit=args.requests,
            encodings=args.precision,
        )
    else:
        spec = WorkloadSpec(turns=args.turns)
        requests = generate(spec, args.seed)
        print(f"spec: {spec}")
        print(
            f"workload: {len(requests)} requests, seed {args.seed}, working set "
            f"{working_set_tokens(requests, PAGE_TOKENS):,} tokens in pages of {PAGE_TOKENS}; "
            + ("without sessions or users" if args.sessionless else "with sessions")
        )
        rows = run(
            args.capacities or CAPACITIES,
            POLICIES,
            args.seed,
            spec,
            disks=args.disks or DISKS,
            sessions=not args.sessionless,
            watermarks=args.watermarks,
        )
    print(
        "share of prompt tokens served from each tier (host, disk; total: both) or recomputed; "
        "load s: estimated time to get every prompt's KV"
    )
    print(table(rows))
    for line in verdict(rows):
        print(line)


if __name__ == "__main__":
    main()
