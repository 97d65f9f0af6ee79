"""Group commit without HTTP in the way: N threads of one process committing chat turns straight
to a ``Store`` (fsync on), group commit off then on, in one run.

Rerun (defaults: 64 threads, 20 s per mode, SQLite catalog; ``--catalog`` for PostgreSQL, a
fresh schema per mode, dropped afterwards)::

    .venv/bin/python benchmarks/group_commit.py --threads 64 --duration 20
    .venv/bin/python benchmarks/group_commit.py --threads 64 --duration 20 \\
        --catalog postgresql://postgres@127.0.0.1:5432/test

Each thread plays chat sessions of 8 turns (a new session for user ``u<thread % 8>``, then
commits of history + 60-160 new tokens with their new 1 KiB pages). It prints commits per
second, commit latency p50/p99 and catalog transactions per commit for each mode and the ratio
on/off; then it reopens each store and checks that ``check()`` is empty and every
acknowledged commit is there with exactly its tokens (exit status 1 otherwise).
:mod:`service_load` measures the same through ``dss serve``, where HTTP costs as much as the
catalog.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from progress import run_until
from service_load import fresh_schema, percentile

import dss

LAYOUT = dss.Layout(name="group-commit", page_tokens=16, page_bytes=1024, model="synthetic")


@dataclass
class Run:
    mode: str
    elapsed: float
    latencies: list[float]
    transactions: int
    missing: int
    problems: list[str]

    @property
    def commits_per_s(self) -> float:
        return len(self.latencies) / self.elapsed


def run(mode: str, threads: int, duration: float, catalog: str | None) -> Run:
    """Commit from ``threads`` threads for ``duration`` seconds with group commit ``mode``; verify."""
    home = Path(tempfile.mkdtemp(prefix=f"dss-group-{mode}-"))
    url, drop = fresh_schema(catalog) if catalog else (None, lambda: None)
    try:
        store = dss.open(home, catalog_url=url, group_commit=mode == "on", mover=False)
        seq_before = int(store.sql("SELECT seq FROM catalog_seq").rows[0][0])
        deadline = time.monotonic() + duration
        latencies: list[list[float]] = [[] for _ in range(threads)]
        acked: list[list[tuple[str, int, list[int]]]] = [[] for _ in range(threads)]

        def chat(i: int) -> None:
            rng = random.Random(i)
            n = 0
            while time.monotonic() < deadline:
                n += 1
                session_id, history = f"t{i}-s{n}", []
                store.create_session(session_id, user_id=f"u{i % 8}", layout=LAYOUT)
                for _ in range(8):
                    if time.monotonic() >= deadline:
                        return
                    tokens = history + [rng.randrange(50_000) for _ in range(rng.randint(60, 160))]
                    pages = {p: p.to_bytes(4, "little") * 256 for p in range(len(history) // 16, len(tokens) // 16)}
                    start = time.perf_counter()
                    version = store.commit(session_id, tokens, pages)
                    latencies[i].append(time.perf_counter() - start)
                    acked[i].append((session_id, version.version_id, tokens))
                    history = tokens

        elapsed = run_until(
            [lambda i=i: chat(i) for i in range(threads)],
            deadline,
            f"{threads} threads committing, group commit {mode}",
        )
        transactions = int(store.sql("SELECT seq FROM catalog_seq").rows[0][0]) - seq_before
        store.close()
        with dss.open(home, catalog_url=url) as again:
            problems = again.check()
            missing = sum(again.tokens(s, v) != tokens for one in acked for s, v, tokens in one)
    finally:
        drop()
    return Run(mode, elapsed, [x for one in latencies for x in one], transactions, missing, problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per mode")
    parser.add_argument("--catalog", default=None, metavar="URL", help="PostgreSQL URL (default: SQLite)")
    args = parser.parse_args()
    runs = [run(mode, args.threads, args.duration, args.catalog) for mode in ("off", "on")]
    print(
        f"group commit, {args.threads} threads of one process, catalog "
        f"{'PostgreSQL' if args.catalog else 'SQLite'}, fsync on, {args.duration:.0f} s per mode"
    )
    print(f"{'mode':<6}{'commits':>9}{'commits/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'tx/commit':>11}")
    for r in runs:
        print(
            f"{r.mode:<6}{len(r.latencies):>9}{r.commits_per_s:>11.1f}{percentile(r.latencies, 0.5) * 1e3:>9.1f}"
            f"{percentile(r.latencies, 0.99) * 1e3:>9.1f}{r.transactions / max(1, len(r.latencies)):>11.2f}"
        )
    off, on = runs
    print(
        f"on/off: {on.commits_per_s / off.commits_per_s:.2f}x the commits per second, p99 "
        f"{percentile(on.latencies, 0.99) / percentile(off.latencies, 0.99):.2f}x"
    )
    for r in runs:
        print(
            f"{r.mode}: acknowledged commits missing or different after reopening: {r.missing}; "
            f"check(): {r.problems or '[]'}"
        )
    return 0 if all(not r.missing and not r.problems for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
