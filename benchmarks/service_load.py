"""Load on a real ``dss serve``: N concurrent clients in multi-turn chats for a fixed time.

Rerun (defaults: 64 clients, 60 s per mode, pages of 16 tokens x 1 KiB, fsync on, group commit
off then on in one run, SQLite catalog)::

    .venv/bin/python benchmarks/service_load.py --clients 64 --duration 60
    .venv/bin/python benchmarks/service_load.py --clients 64 --duration 60 \\
        --catalog postgresql://postgres@127.0.0.1:5432/test

It starts ``dss serve`` on a free loopback port on a fresh store folder (``--home`` to
choose it), makes one API key, and runs ``--clients`` threads, each with its own
``dss.connect`` client, playing chat sessions: every turn resumes the prompt (history +
new user tokens), checks the match is exactly the history's full pages, and commits
prompt + answer with the new full pages; after a commit it may undo the turn (rollback to
the parent, 15 %) or regenerate it in a new session (branch from the parent, 10 %); a
session ends after 6-10 turns and a new one starts. Then it prints requests/s, p50/p99
latency per endpoint (as the client sees it) and the error count, stops the service with
SIGTERM, opens the store folder and checks that ``check()`` is empty and that every
acknowledged commit is present with exactly its tokens. With ``--group-commit both`` (the
default) it does all of this twice, group commit off then on, and prints the ratio of
acknowledged commits per second and of commit p99 latency. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from progress import run_until

import dss
from dss.core.tokens import pack
from dss.service.process import ServiceProcess

ENDPOINTS = ("create_session", "resume", "commit", "rollback", "branch")


@dataclass
class Tally:
    """One client's measurements."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: list[str] = field(default_factory=list)
    acked: list[tuple[str, int, int, bytes]] = field(default_factory=list)  # session, version, tokens, digest


def digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(pack(tokens), digest_size=16).digest()


class ChatClient:
    """One simulated chat backend worker: sessions, turns, undo, regenerate."""

    def __init__(
        self, index: int, client: dss.service.client.Client, layout: dss.Layout, deadline: float, seed: int
    ) -> None:
        self.index = index
        self.client = client
        self.layout = layout
        self.deadline = deadline
        self.rng = random.Random(seed * 1_000_003 + index)
        self.tally = Tally()
        self.num_sessions = 0

    def timed(self, endpoint: str, call, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = call(*args, **kwargs)
        self.tally.latencies[endpoint].append(time.perf_counter() - start)
        return result

    def run(self) -> Tally:
        try:
            while time.monotonic() < self.deadline:
                self.chat()
        except dss.DssError as exc:
            self.tally.errors.append(f"client {self.index}: {exc.kind}: {exc}")
        return self.tally

    def new_session_id(self) -> str:
        self.num_sessions += 1
        return f"c{self.index}-s{self.num_sessions}"

    def chat(self) -> None:
        session_id = self.new_session_id()
        self.timed(
            "create_session",
            self.client.create_session,
            session_id,
            user_id=f"user-{self.index % 8}",
            layout=self.layout,
        )
        history: list[int] = []
        versions: dict[int, list[int]] = {}
        parent: int | None = None
        for _ in range(self.rng.randint(6, 10)):
            if time.monotonic() >= self.deadline:
                return
            prompt = history + [self.rng.randrange(50_000) for _ in range(self.rng.randint(20, 60))]
            resumed = self.timed("resume", self.client.resume, session_id, prompt)
            page_tokens = self.layout.page_tokens
            expected = len(history) // page_tokens * page_tokens
            if resumed.matched_tokens != expected:
                self.tally.errors.append(
                    f"{session_id}: resume matched {resumed.matched_tokens} tokens, expected {expected}"
                )
            tokens = prompt + [self.rng.randrange(50_000) for _ in range(self.rng.randint(20, 100))]
            first = resumed.matched_tokens // page_tokens
            pages = {
                i: i.to_bytes(4, "little") * (self.layout.page_bytes // 4)
                for i in range(first, len(tokens) // page_tokens)
            }
            version = self.timed("commit", self.client.commit, session_id, tokens, pages)
            self.tally.acked.append((session_id, version.version_id, len(tokens), digest(tokens)))
            versions[version.version_id] = tokens
            history = tokens
            roll = self.rng.random()
            if parent is not None and roll < 0.15:  # undo the turn
                self.timed("rollback", self.client.rollback, session_id, parent)
                history = versions[parent]
                continue
            if parent is not None and roll < 0.25:  # regenerate the turn in a new session
                branch_id = self.new_session_id()
                branched = self.timed("branch", self.client.branch, session_id, parent, branch_id)
                session_id, history = branch_id, versions[parent]
                parent = branched.head_id
                versions[parent] = history
                continue
            parent = version.version_id


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class Run:
    """One load run's figures."""

    mode: str
    elapsed: float
    latencies: dict[str, list[float]]
    errors: list[str]
    num_acked: int
    missing: int
    problems: list[str]
    status: int

    @property
    def commits_per_s(self) -> float:
        return len(self.latencies.get("commit", [])) / self.elapsed

    @property
    def ok(self) -> bool:
        return not self.errors and not self.missing and not self.problems and bool(self.latencies)


def fresh_schema(url: str) -> tuple[str, Callable[[], None]]:
    """A new PostgreSQL schema on the database at ``url``: its URL, and how to drop it."""
    import uuid

    import sqlalchemy as sa

    url = url.replace("postgresql://", "postgresql+psycopg://", 1) if url.startswith("postgresql://") else url
    schema = f"dss_load_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))

    def drop() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()

    joiner = "&" if "?" in url else "?"
    return f"{url}{joiner}options=-csearch_path%3D{schema}", drop


def run_load(args: argparse.Namespace, mode: str) -> Run:
    """Start ``dss serve`` (group commit ``mode``) on a fresh store, load it, stop it, verify."""
    home = (args.home / mode) if args.home else Path(tempfile.mkdtemp(prefix=f"dss-load-{mode}-"))
    layout = dss.Layout(name="load", page_tokens=args.page_tokens, page_bytes=args.page_bytes, model="synthetic")
    catalog_url, drop = fresh_schema(args.catalog) if args.catalog else (None, lambda: None)
    env = {"DSS_GROUP_COMMIT": "true" if mode == "on" else "false"}
    if catalog_url:
        env["DSS_CATALOG_URL"] = catalog_url
    try:
        service = ServiceProcess(home, args=tuple(args.serve_arg), env=env).start()
        key = service.add_key("load")
        clients = [dss.connect(service.url, api_key=key, timeout=120) for _ in range(args.clients)]
        deadline = time.monotonic() + args.duration
        workers = [ChatClient(i, clients[i], layout, deadline, args.seed) for i in range(args.clients)]
        tallies: list[Tally] = []
        elapsed = run_until(
            [lambda w=w: tallies.append(w.run()) for w in workers],
            deadline,
            f"{args.clients} clients chatting, group commit {mode}",
        )
        for client in clients:
            client.close()
        status = service.stop()

        latencies: dict[str, list[float]] = defaultdict(list)
        for tally in tallies:
            for endpoint, values in tally.latencies.items():
                latencies[endpoint].extend(values)
        acked = [a for t in tallies for a in t.acked]
        missing = 0
        with dss.open(home, catalog_url=catalog_url) as store:
            problems = store.check()
            for session_id, version_id, num_tokens, expected in acked:
                try:
                    tokens = store.tokens(session_id, version_id, tenant_id="load")
                except dss.NotFound:
                    missing += 1
                    continue
                if len(tokens) != num_tokens or digest(tokens) != expected:
                    missing += 1
    finally:
        drop()
    return Run(mode, elapsed, latencies, [e for t in tallies for e in t.errors], len(acked), missing, problems, status)


def report(run: Run) -> None:
    total = sum(len(v) for v in run.latencies.values())
    print(f"\ngroup commit {run.mode}: {run.elapsed:.1f} s")
    print(f"{'endpoint':<16}{'requests':>10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for endpoint in ENDPOINTS:
        values = run.latencies.get(endpoint, [])
        print(
            f"{endpoint:<16}{len(values):>10}{len(values) / run.elapsed:>10.1f}"
            f"{percentile(values, 0.5) * 1e3:>10.2f}{percentile(values, 0.99) * 1e3:>10.2f}"
        )
    every = [v for values in run.latencies.values() for v in values]
    print(
        f"{'all':<16}{total:>10}{total / run.elapsed:>10.1f}{percentile(every, 0.5) * 1e3:>10.2f}"
        f"{percentile(every, 0.99) * 1e3:>10.2f}"
    )
    print(f"errors: {len(run.errors)}")
    for error in run.errors[:10]:
        print(f"  {error}")
    print(f"service exit status after SIGTERM: {run.status}")
    print(f"acknowledged commits: {run.num_acked}, missing or different after shutdown: {run.missing}")
    print(f"check(): {run.problems if run.problems else '[] (every invariant holds)'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (per group-commit mode)")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--page-bytes", type=int, default=1024)
    parser.add_argument(
        "--home",
        type=Path,
        default=None,
        help="parent of the store folders, one per mode (default: fresh temporary ones)",
    )
    parser.add_argument(
        "--catalog",
        default=None,
        metavar="URL",
        help="PostgreSQL catalog, e.g. postgresql://postgres@127.0.0.1/test (a fresh schema "
        "per mode, dropped afterwards); default SQLite in the store folder",
    )
    parser.add_argument(
        "--group-commit",
        choices=("on", "off", "both"),
        default="both",
        help="run with group commit on, off, or both in this run and compare [default: both]",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `dss serve` argument (repeatable)")
    args = parser.parse_args()
    modes = ("off", "on") if args.group_commit == "both" else (args.group_commit,)
    print(
        f"dss service load: {args.clients} clients, {args.duration:.0f} s per mode, pages of {args.page_tokens} "
        f"tokens x {args.page_bytes} B, catalog {'PostgreSQL' if args.catalog else 'SQLite'}"
    )
    runs = {mode: run_load(args, mode) for mode in modes}
    for run in runs.values():
        report(run)
    if len(runs) == 2:
        on, off = runs["on"], runs["off"]
        p99_on, p99_off = (percentile(r.latencies.get("commit", []), 0.99) for r in (on, off))
        ratio = on.commits_per_s / off.commits_per_s if off.commits_per_s else float("inf")
        print(f"\n{'group commit':<14}{'commits/s':>11}{'commit p99 ms':>15}")
        for run, p99 in ((off, p99_off), (on, p99_on)):
            print(f"{run.mode:<14}{run.commits_per_s:>11.1f}{p99 * 1e3:>15.2f}")
        print(
            f"on/off: {ratio:.2f}x the acknowledged commits per second, commit p99 {p99_on / p99_off:.2f}x "
            f"(bar: >= 4x, p99 no worse)"
        )
    return 0 if all(run.ok for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
