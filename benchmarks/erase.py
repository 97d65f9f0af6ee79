"""Forget-user speed, the cost of encryption at rest, and whether a foreign prefix is a timing oracle.

Three measurements in one run:

1. **Erasure.** A user with 1,000 sessions and 10,000 pages (16 KiB each), beside other
   users' data; ``forget_user`` end to end (key destroyed, catalog purged, files deleted,
   catalog scrubbed, verified): seconds, pages/s, sessions/s.
2. **Encryption overhead.** The same commits and disk reads (a fresh process, so the host tier
   is cold) with pages sealed (AES-256-GCM, the default) and in plaintext
   (``encrypt=False``), interleaved; throughput in MB/s and the ratio, plus the raw seal and
   open cost per GB on this machine.
3. **Timing check.** ``resume`` of a prefix that another user stored (a foreign namespace)
   against ``resume`` of tokens nobody stored: medians and a two-sample Kolmogorov-Smirnov
   p-value (a large p: the two are not distinguishable).

Rerun with::

    .venv/bin/python benchmarks/erase.py            # --pages 10000 --sessions 1000 by default
"""

from __future__ import annotations

import argparse
import array
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from progress import track

import dss
from dss.core.crypto import Sealer, new_data_key

PAGE_BYTES = 16 << 10
LAYOUT = dss.Layout(name="bench-erase", page_tokens=32, page_bytes=PAGE_BYTES)


def build_user(store: dss.Store, user: str, sessions: int, pages: int, rng: random.Random) -> None:
    per = pages // sessions
    payload = os.urandom(PAGE_BYTES)
    for n in track(range(sessions), f"building {user}'s sessions"):
        session = f"{user}-{n}"
        store.create_session(session, user_id=user, tenant_id="bench", layout=LAYOUT)
        tokens = [rng.randrange(1 << 20) for _ in range(per * 32)]
        store.commit(session, tokens, {i: payload for i in range(per)})


def erasure(sessions: int, pages: int) -> dict[str, float]:
    rng = random.Random(1)
    with dss.open(tempfile.mkdtemp(prefix="dss-bench-erase-"), disk_bytes=8 << 30, host_bytes=64 << 20) as store:
        print(f"building {sessions} sessions / {pages} pages of {PAGE_BYTES >> 10} KiB ...", file=sys.stderr)
        build_user(store, "target", sessions, pages, rng)
        build_user(store, "bystander", 20, 200, rng)
        start = time.perf_counter()
        receipt = store.forget_user("target", tenant_id="bench")
        seconds = time.perf_counter() - start
        assert receipt.verification.ok and receipt.removed.pages == pages
        assert store.check() == []
    return {
        "seconds": seconds,
        "pages/s": pages / seconds,
        "sessions/s": sessions / seconds,
        "bytes": receipt.removed.tiers["disk"].bytes,
    }


READER = """
import sys, time, dss
store = dss.open(sys.argv[1], encrypt=sys.argv[2] == "1")
refs = [p for s in store.sessions() for p in store.resume(s.session_id, store.tokens(s.session_id)).pages]
start = time.perf_counter()
data = store.read_pages(refs)
print(time.perf_counter() - start, sum(len(d) for d in data if d))
"""


def overhead(pages: int, rounds: int) -> dict[str, float]:
    """Commit and cold-read throughput, sealed vs plaintext, interleaved over ``rounds``."""
    rng = random.Random(2)
    results: dict[str, list[float]] = {"commit sealed": [], "commit plain": [], "read sealed": [], "read plain": []}
    for _ in range(rounds):
        for encrypt in (True, False):
            name = "sealed" if encrypt else "plain"
            folder = tempfile.mkdtemp(prefix=f"dss-bench-{name}-")
            with dss.open(folder, encrypt=encrypt, disk_bytes=8 << 30, host_bytes=1 << 20) as store:
                start = time.perf_counter()
                build_user(store, "u", 50, pages, rng)
                results[f"commit {name}"].append(pages * PAGE_BYTES / (time.perf_counter() - start) / 1e6)
            out = subprocess.run(
                [sys.executable, "-c", READER, folder, "1" if encrypt else "0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            assert int(out[1]) == pages * PAGE_BYTES
            results[f"read {name}"].append(pages * PAGE_BYTES / float(out[0]) / 1e6)
    return {k: statistics.median(v) for k, v in results.items()}


def raw_cipher_cost() -> dict[str, float]:
    sealer = Sealer(new_data_key())
    chunk = os.urandom(PAGE_BYTES)
    count = (1 << 30) // PAGE_BYTES // 4  # a quarter GB, scaled to a GB
    start = time.perf_counter()
    sealed = [sealer.seal(chunk, b"aad") for _ in range(count)]
    seal = (time.perf_counter() - start) * 4
    start = time.perf_counter()
    for blob in sealed:
        sealer.open(blob, b"aad")
    return {"seal s/GB": seal, "open s/GB": (time.perf_counter() - start) * 4}


def timing(samples: int, prefixes: int = 200) -> dict[str, float]:
    """resume of another namespace's prefixes vs of tokens nobody stored, interleaved in random order."""
    rng = random.Random(3)
    with dss.open(tempfile.mkdtemp(prefix="dss-bench-timing-")) as store:
        stored = []
        for n in track(
            range(prefixes), "storing the owner's prefixes"
        ):  # the owner's prefixes: many, so neither side repeats one input
            prefix = [rng.randrange(1 << 20) for _ in range(64)]
            store.create_session(f"owner-{n}", user_id="owner", tenant_id="bench", layout=LAYOUT)
            store.commit(f"owner-{n}", prefix, {0: b"k" * PAGE_BYTES, 1: b"k" * PAGE_BYTES})
            stored.append(prefix)
        store.create_session("prober", user_id="prober", tenant_id="bench", layout=LAYOUT)
        # every prompt is made of fresh int objects, the two kinds alternately, so they lie alike
        # in memory and converting one costs the same whichever kind it is
        foreign, nobody = [], []
        for n in track(range(samples), "making the probes"):
            tail = [rng.randrange(1 << 20) for _ in range(4032)]
            made = {
                "foreign": stored[n % prefixes] + tail,
                "nobody": [rng.randrange(1 << 20) for _ in range(64)] + tail,
            }
            for kind in rng.sample(sorted(made), 2):
                (foreign if kind == "foreign" else nobody).append(array.array("I", made[kind]).tolist())
        times: dict[str, list[float]] = {"foreign": [], "nobody": []}
        gc.disable()  # a collection landing on one side would fake a difference
        try:
            for n in range(samples):
                pair = [("foreign", foreign[n]), ("nobody", nobody[n])]
                rng.shuffle(pair)
                for kind, prompt in pair:
                    start = time.perf_counter_ns()
                    result = store.resume("prober", prompt)
                    times[kind].append((time.perf_counter_ns() - start) / 1000)
                    assert result.matched_tokens == 0
        finally:
            gc.enable()
    statistic, p = ks_2samp(times["foreign"], times["nobody"])
    return {
        "foreign us": statistics.median(times["foreign"]),
        "miss us": statistics.median(times["nobody"]),
        "ks D": statistic,
        "ks p": p,
    }


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    d = 0.0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            i += 1
        else:
            j += 1
        d = max(d, abs(i / len(a) - j / len(b)))
    n = math.sqrt(len(a) * len(b) / (len(a) + len(b)))
    lam = (n + 0.12 + 0.11 / n) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--pages", type=int, default=10_000)
    parser.add_argument("--overhead-pages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    erased = erasure(args.sessions, args.pages)
    print(f"\nforget_user: {args.sessions} sessions, {args.pages} pages, {erased['bytes'] / 1e6:.0f} MB on disk")
    print(
        f"| seconds | pages/s | sessions/s |\n|---|---|---|\n| {erased['seconds']:.2f} | "
        f"{erased['pages/s']:.0f} | {erased['sessions/s']:.0f} |"
    )
    cost = overhead(args.overhead_pages, args.rounds)
    raw = raw_cipher_cost()
    print(
        f"\nencryption at rest ({args.overhead_pages} pages of {PAGE_BYTES >> 10} KiB, median of {args.rounds} "
        f"interleaved rounds, MB/s)"
    )
    print("| operation | sealed | plaintext | sealed/plaintext |\n|---|---|---|---|")
    for op in ("commit", "read"):
        print(
            f"| {op} | {cost[f'{op} sealed']:.0f} | {cost[f'{op} plain']:.0f} | "
            f"{cost[f'{op} sealed'] / cost[f'{op} plain']:.2f} |"
        )
    print(f"raw AES-256-GCM on this machine: seal {raw['seal s/GB']:.2f} s/GB, open {raw['open s/GB']:.2f} s/GB")
    t = timing(args.samples)
    print(
        f"\ntiming check ({args.samples} interleaved samples each): resume of a foreign prefix "
        f"{t['foreign us']:.1f} us vs plain miss {t['miss us']:.1f} us (medians); "
        f"KS D = {t['ks D']:.3f}, p = {t['ks p']:.2f}"
    )


if __name__ == "__main__":
    main()
