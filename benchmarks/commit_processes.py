"""Commits per second of 1, 2 and 4 processes committing chat turns into one store folder on one
PostgreSQL catalog (group commit on, fsync on), and where a commit's time goes.

Each process opens the store and commits from ``--threads`` threads (default 1: a commit's time
then splits cleanly) for ``--duration`` seconds, all processes at once: each thread plays chat
sessions of 8 turns (a new session for user ``u<n>``, then commits of history + 60-160 new tokens
with their new 1 KiB pages), as ``benchmarks/group_commit.py`` does. A commit's wall time is split
three ways, measured in the thread that made it:

* **SQL** — wall time inside the catalog's statements and transaction commits (the driver, the
  round trips, and the server's work, its WAL flush at commit included);
* **fsync** — wall time inside ``os.fsync`` (each page file, and the folder after the renames);
* **Python** — the rest: checking the tokens, building the change, hashing and writing the page
  files, the store's caches (and, with several threads, waiting for a group's leader).

Then it reopens the store and checks that ``check()`` is empty and every acknowledged commit is
there with exactly its tokens (exit status 1 otherwise). Rerun with (a fresh schema per run,
dropped afterwards)::

    .venv/bin/python benchmarks/commit_processes.py --catalog postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/commit_processes.py --catalog URL --processes 1 2 4 --threads 1 --duration 15
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from service_load import fresh_schema, percentile

import dss

LAYOUT = dss.Layout(name="commit-processes", page_tokens=16, page_bytes=1024, model="synthetic")


class Clocks(threading.local):
    """Seconds this thread spent in SQL and in fsync so far."""

    def __init__(self) -> None:
        self.sql = 0.0
        self.fsync = 0.0


CLOCKS = Clocks()


def timed(fn: Callable[..., Any], slot: str) -> Callable[..., Any]:
    """``fn``, adding the wall time of each call to this thread's ``slot`` clock."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(CLOCKS, slot, getattr(CLOCKS, slot) + time.perf_counter() - start)

    return call


def instrument(store: dss.Store) -> None:
    """Time every SQL statement and transaction commit of the store's catalog, and every fsync."""
    dialect = store.catalog.engine.dialect
    for name in ("do_execute", "do_executemany", "do_execute_no_params", "do_commit", "do_rollback"):
        setattr(dialect, name, timed(getattr(dialect, name), "sql"))
    os.fsync = timed(os.fsync, "fsync")  # type: ignore[assignment]


@dataclass
class Part:
    """What one process measured."""

    commits: int = 0
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    sql: float = 0.0
    fsync: float = 0.0
    acked: list[tuple[str, int, int, str]] = field(default_factory=list)
    """``(session, version, num_tokens, digest)`` of every acknowledged commit."""


def digest(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()


def chat(store: dss.Store, name: str, seed: int, deadline: float, part: Part, lock: threading.Lock) -> None:
    """Commit chat turns until ``deadline``, timing each commit and its SQL and fsync."""
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < deadline:
        n += 1
        session_id, history = f"{name}-s{n}", []
        store.create_session(session_id, user_id=f"u{seed % 8}", layout=LAYOUT)
        for _ in range(8):
            if time.monotonic() >= deadline:
                return
            tokens = history + [rng.randrange(50_000) for _ in range(rng.randint(60, 160))]
            pages = {p: p.to_bytes(4, "little") * 256 for p in range(len(history) // 16, len(tokens) // 16)}
            sql, fsync, start = CLOCKS.sql, CLOCKS.fsync, time.perf_counter()
            version = store.commit(session_id, tokens, pages)
            took = time.perf_counter() - start
            with lock:
                part.latencies.append(took)
                part.sql += CLOCKS.sql - sql
                part.fsync += CLOCKS.fsync - fsync
                part.acked.append((session_id, version.version_id, len(tokens), digest(tokens)))
            history = tokens


def child(home: str, url: str, index: int, threads: int, duration: float, ready: Any, go: Any, out: Any) -> None:
    """One process: open the store, say ready, wait for the start, commit, report."""
    store = dss.open(home, catalog_url=url, mover=False, group_commit=True)
    instrument(store)
    ready.put(index)
    go.wait()
    part, lock = Part(), threading.Lock()
    deadline = time.monotonic() + duration
    workers = [
        threading.Thread(target=chat, args=(store, f"p{index}t{t}", index * 100 + t, deadline, part, lock))
        for t in range(threads)
    ]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    part.elapsed = time.perf_counter() - start
    part.commits = len(part.latencies)
    store.close()
    out.put((index, part))


@dataclass
class Run:
    processes: int
    parts: list[Part]
    problems: list[str]
    missing: int

    @property
    def commits(self) -> int:
        return sum(p.commits for p in self.parts)

    @property
    def commits_per_s(self) -> float:
        return sum(p.commits / p.elapsed for p in self.parts)

    def share(self, what: str) -> float:
        """Share of the commits' wall time spent in ``sql``, ``fsync`` or ``python`` (the rest)."""
        total = sum(sum(p.latencies) for p in self.parts)
        sql, fsync = sum(p.sql for p in self.parts), sum(p.fsync for p in self.parts)
        return {"sql": sql, "fsync": fsync, "python": total - sql - fsync}[what] / total


def run(processes: int, threads: int, duration: float, catalog: str) -> Run:
    """Commit from ``processes`` processes at once into one fresh store and schema; verify."""
    home = Path(tempfile.mkdtemp(prefix=f"dss-commit-{processes}p-"))
    url, drop = fresh_schema(catalog)
    try:
        dss.open(home, catalog_url=url, mover=False).close()  # the schema, made once
        ctx = mp.get_context("spawn")
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [
            ctx.Process(target=child, args=(str(home), url, i, threads, duration, ready, go, out))
            for i in range(processes)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=120)
        go.set()
        parts = dict(out.get(timeout=duration + 300) for _ in procs)
        for proc in procs:
            proc.join()
        with dss.open(home, catalog_url=url, mover=False) as again:
            problems = again.check()
            acked = [a for p in parts.values() for a in p.acked]
            missing = sum(digest(again.tokens(s, v)[:n]) != d for s, v, n, d in acked)
    finally:
        drop()
    return Run(processes, [parts[i] for i in sorted(parts)], problems, missing)


def report(runs: Sequence[Run], threads: int, duration: float) -> list[str]:
    title = (
        f"commits of chat turns, {threads} thread(s) per process, one store folder and one PostgreSQL catalog, "
        f"group commit on, fsync on, {duration:.0f} s"
    )
    head = (
        f"{'processes':>9}{'commits':>9}{'commits/s':>11}{'per process':>13}{'x 1 proc':>10}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'SQL':>7}{'Python':>8}{'fsync':>7}"
    )
    lines = [title, head]
    base = runs[0].commits_per_s
    for r in runs:
        lat = [x for p in r.parts for x in p.latencies]
        lines.append(
            f"{r.processes:>9}{r.commits:>9}{r.commits_per_s:>11.1f}{r.commits_per_s / r.processes:>13.1f}"
            f"{r.commits_per_s / base:>10.2f}{percentile(lat, 0.5) * 1e3:>8.2f}{percentile(lat, 0.99) * 1e3:>8.2f}"
            f"{r.share('sql'):>7.0%}{r.share('python'):>8.0%}{r.share('fsync'):>7.0%}"
        )
    for r in runs:
        lines.append(
            f"{r.processes} process(es): acknowledged commits missing or different after reopening: {r.missing}; "
            f"check(): {r.problems or '[]'}"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--catalog", required=True, metavar="URL", help="PostgreSQL URL (a fresh schema per run)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--threads", type=int, default=1, help="committing threads per process")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per run")
    args = parser.parse_args()
    runs = [run(n, args.threads, args.duration, args.catalog) for n in args.processes]
    for line in report(runs, args.threads, args.duration):
        print(line)
    return 0 if all(not r.missing and not r.problems for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
