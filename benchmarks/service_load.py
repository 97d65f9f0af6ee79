"""Load on a real ``dss serve``: N concurrent clients in multi-turn chats for a fixed time.

Rerun (defaults: 64 clients, 60 s, pages of 16 tokens x 1 KiB, fsync on)::

    .venv/bin/python benchmarks/service_load.py --clients 64 --duration 60

It starts ``dss serve`` on a free loopback port on a fresh store folder (``--home`` to
choose it), makes one API key, and runs ``--clients`` threads, each with its own
``dss.connect`` client, playing chat sessions: every turn resumes the prompt (history +
new user tokens), checks the match is exactly the history's full pages, and commits
prompt + answer with the new full pages; after a commit it may undo the turn (rollback to
the parent, 15 %) or regenerate it in a new session (branch from the parent, 10 %); a
session ends after 6-10 turns and a new one starts. Then it prints requests/s, p50/p99
latency per endpoint (as the client sees it) and the error count, stops the service with
SIGTERM, opens the store folder and checks that ``check()`` is empty and that every
acknowledged commit is present with exactly its tokens. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import dss
from dss.service.process import ServiceProcess
from dss.core.tokens import pack
from progress import wait

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

    def __init__(self, index: int, client: dss.service.client.Client, layout: dss.Layout, deadline: float, seed: int) -> None:
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
        self.timed("create_session", self.client.create_session, session_id, user_id=f"user-{self.index % 8}",
                   layout=self.layout)
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
                self.tally.errors.append(f"{session_id}: resume matched {resumed.matched_tokens} tokens, "
                                         f"expected {expected}")
            tokens = prompt + [self.rng.randrange(50_000) for _ in range(self.rng.randint(20, 100))]
            first = resumed.matched_tokens // page_tokens
            pages = {i: i.to_bytes(4, "little") * (self.layout.page_bytes // 4)
                     for i in range(first, len(tokens) // page_tokens)}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--page-bytes", type=int, default=1024)
    parser.add_argument("--home", type=Path, default=None, help="store folder (default: a fresh temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `dss serve` argument (repeatable)")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="dss-load-"))
    layout = dss.Layout(name="load", page_tokens=args.page_tokens, page_bytes=args.page_bytes, model="synthetic")

    service = ServiceProcess(home, args=tuple(args.serve_arg)).start()
    key = service.add_key("load")
    clients = [dss.connect(service.url, api_key=key, timeout=120) for _ in range(args.clients)]
    deadline = time.monotonic() + args.duration
    workers = [ChatClient(i, clients[i], layout, deadline, args.seed) for i in range(args.clients)]
    tallies: list[Tally] = []
    threads = [threading.Thread(target=lambda w=w: tallies.append(w.run())) for w in workers]
    start = time.perf_counter()
    for t in threads:
        t.start()
    wait(deadline - time.monotonic(), f"{args.clients} clients chatting")
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for client in clients:
        client.close()
    status = service.stop()

    latencies: dict[str, list[float]] = defaultdict(list)
    errors = [e for t in tallies for e in t.errors]
    acked = [a for t in tallies for a in t.acked]
    for tally in tallies:
        for endpoint, values in tally.latencies.items():
            latencies[endpoint].extend(values)
    total = sum(len(v) for v in latencies.values())
    print(f"dss service load: {args.clients} clients, {elapsed:.1f} s, pages of {args.page_tokens} tokens x "
          f"{args.page_bytes} B, store {home}")
    print(f"{'endpoint':<16}{'requests':>10}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for endpoint in ENDPOINTS:
        values = latencies.get(endpoint, [])
        print(f"{endpoint:<16}{len(values):>10}{len(values) / elapsed:>10.1f}{percentile(values, 0.5) * 1e3:>10.2f}"
              f"{percentile(values, 0.99) * 1e3:>10.2f}")
    every = [v for values in latencies.values() for v in values]
    print(f"{'all':<16}{total:>10}{total / elapsed:>10.1f}{percentile(every, 0.5) * 1e3:>10.2f}"
          f"{percentile(every, 0.99) * 1e3:>10.2f}")
    print(f"errors: {len(errors)}")
    for error in errors[:10]:
        print(f"  {error}")
    print(f"service exit status after SIGTERM: {status}")

    missing = 0
    with dss.open(home) as store:
        problems = store.check()
        for session_id, version_id, num_tokens, expected in acked:
            try:
                tokens = store.tokens(session_id, version_id, tenant_id="load")
            except dss.NotFound:
                missing += 1
                continue
            if len(tokens) != num_tokens or digest(tokens) != expected:
                missing += 1
    print(f"acknowledged commits: {len(acked)}, missing or different after shutdown: {missing}")
    print(f"check(): {problems if problems else '[] (every invariant holds)'}")
    return 0 if not errors and not missing and not problems and total else 1


if __name__ == "__main__":
    sys.exit(main())
