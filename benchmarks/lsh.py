"""MinHash-LSH approximate matching: recall and precision against brute-force Jaccard, query time,
memory per indexed version, and what approximate matching costs resume when it is not needed.

    PYTHONPATH=. .venv/bin/python benchmarks/lsh.py                      # 1,000 chats x 10 turns
    PYTHONPATH=. .venv/bin/python benchmarks/lsh.py --chats 200 --queries 50   # a quick look

Setup: ``--chats`` generated conversations of ``--turns`` turns (a system prompt of one of 20
templates, then user and answer messages of 20-80 random tokens each) are committed to one
store, one session each, one version per turn: 10,000 stored versions by default, all in one
namespace and layout (one index). Queries are re-rendered requests: a stored version with a
per-request line of 6 tokens put at position 8 and a new user message of 20-80 tokens
appended, or with 1-3 tokens replaced, or one of its earlier turns dropped.

Figures, at the default settings (threshold 0.85, 128 permutations, shingles of 4 tokens):

* recall: of the (query, version) pairs whose exact Jaccard of whole versions is at least 0.9
  (brute force over every stored version), the share the index proposes through the
  version's whole-version entry; also at Jaccard >= 0.85;
* precision: of the whole-version entries proposed, the share at Jaccard >= 0.85 (and >= 0.7);
* query time: median of the index lookup alone (signature of the prompt and its windows,
  band look-ups), and of ``store.nearest`` (lookup, then exact verification of candidates);
* next turns: a stored turn re-rendered (6 template tokens at position 8 replaced by a
  per-request line) and extended by a new user message of 20-80 tokens, the request a chat
  application sends next: the share for which ``store.nearest`` puts the right conversation
  first (and the very version it extends); recall at containment >= 0.9: of the (query,
  version) pairs where the query holds at least 90 % of the version's shingles (brute force
  over every stored version), the share the index proposes; the index lookup's median time,
  and its time without the prefixes (whole prompt and windows only: what a lookup was before
  next turns were looked for), turn about in the same run;
* memory per indexed version: Python heap of an index holding the versions (tracemalloc);
* resume with approximate matching on but unused (the exact match covers the prompt) against
  off, in one run, call by call turn about (medians of 10,000 calls each): the ratio is the
  cost of the check; and resume when approximate matching is used (a re-rendered prompt).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from progress import track

import dss
from dss.approx.lsh import LshIndex, Settings
from dss.approx.minhash import shingle_hashes

LAYOUT = dss.Layout(name="lsh-bench", page_tokens=16, page_bytes=64, model="bench")


def conversation(rng: random.Random, turns: int, templates: list[list[int]]) -> list[list[int]]:
    """The token history after each turn of one generated chat."""
    out = list(templates[rng.randrange(len(templates))])
    history = []
    for _ in range(turns):
        for _ in range(2):  # the user's message, the answer
            out += [rng.randrange(100, 50_000) for _ in range(rng.randrange(20, 81))]
        history.append(list(out))
    return history


def rerendered(rng: random.Random, tokens: list[int], turn_cuts: list[int]) -> list[int]:
    kind = rng.randrange(3)
    if kind == 0:
        line = [rng.randrange(60_000, 61_000) for _ in range(6)]
        return tokens[:8] + line + tokens[8:] + [rng.randrange(100, 50_000) for _ in range(rng.randrange(20, 81))]
    if kind == 1:
        out = list(tokens)
        for _ in range(rng.randrange(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(70_000, 71_000)
        return out
    if len(turn_cuts) >= 3:
        i = rng.randrange(1, len(turn_cuts) - 1)
        return tokens[: turn_cuts[i - 1]] + tokens[turn_cuts[i] :]
    return list(tokens)


def next_turn(rng: random.Random, tokens: list[int]) -> list[int]:
    """A stored turn re-rendered (a per-request line over tokens 8-13) with a new user message."""
    line = [rng.randrange(60_000, 61_000) for _ in range(6)]
    return tokens[:8] + line + tokens[14:] + [rng.randrange(100, 50_000) for _ in range(rng.randrange(20, 81))]


def next_turns(
    rng: random.Random, store: dss.Store, versions: list[list[int]], keys: list[tuple[str, int]], n: int
) -> dict[str, float]:
    """The next-turn figures over ``n`` queries (see the module's docstring)."""
    near = store._nearest_index()
    bucket = near.lsh.bucket(store.mirror.user_ref("default", "u"), LAYOUT.digest)
    size = near.lsh.settings.shingle_tokens
    stored = [np.unique(shingle_hashes(np.asarray(t, np.uint32), size, bucket.salt)) for t in versions]
    ref_of = {store.mirror.state(s, None).ref: s for s in {s for s, _ in keys}}
    chat_first = version_first = relevant = found = 0
    times: list[float] = []
    before: list[float] = []
    hits: list = []
    for _ in track(range(n), "next turns"):
        i = rng.randrange(len(versions))
        query = next_turn(rng, versions[i])
        buf = np.asarray(query, np.uint32).tobytes()
        for with_prefixes in (False, True) if len(times) % 2 else (True, False):  # turn about
            start = time.perf_counter()
            found_now = near.lsh.query(bucket, buf, LAYOUT.page_tokens, prefixes=with_prefixes)
            (times if with_prefixes else before).append(time.perf_counter() - start)
            hits = found_now if with_prefixes else hits
        best = store.nearest(query, user_id="u", layout=LAYOUT, k=1)[0]
        chat_first += best.session_id == keys[i][0]
        version_first += (best.session_id, best.version_id) == keys[i]
        whole = {(ref_of[h.entry.session_ref], h.entry.version_id) for h in hits if not h.entry.is_window}
        qs = np.unique(shingle_hashes(np.frombuffer(buf, np.uint32), size, bucket.salt))
        for j, s in enumerate(stored):
            if len(np.intersect1d(qs, s, assume_unique=True)) >= 0.9 * len(s):
                relevant += 1
                found += keys[j] in whole
    return {
        "chat": chat_first / n,
        "version": version_first / n,
        "recall": found / max(relevant, 1),
        "pairs": relevant,
        "lookup": statistics.median(times),
        "lookup_before": statistics.median(before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    templates = [[rng.randrange(100, 50_000) for _ in range(rng.randrange(30, 120))] for _ in range(20)]
    chats = [conversation(rng, args.turns, templates) for _ in range(args.chats)]
    settings = Settings()
    size = settings.shingle_tokens
    with tempfile.TemporaryDirectory() as folder:
        store = dss.open(Path(folder) / "store", fsync=False, encrypt=False)
        keys: list[tuple[str, int]] = []
        versions: list[list[int]] = []
        for c, history in enumerate(track(chats, "committing versions")):
            store.create_session(f"chat{c}", user_id="u", layout=LAYOUT)
            for tokens in history:
                v = store.commit(f"chat{c}", tokens)
                keys.append((f"chat{c}", v.version_id))
                versions.append(tokens)
        num_versions = len(versions)
        build = time.perf_counter()
        store.nearest(versions[0], user_id="u", layout=LAYOUT)  # builds the index from the catalog
        build = time.perf_counter() - build
        near = store._nearest_index()
        bucket = near.lsh.bucket(store.mirror.user_ref("default", "u"), LAYOUT.digest)
        salt = bucket.salt
        stored_sets = [np.unique(shingle_hashes(np.asarray(t, np.uint32), size, salt)) for t in versions]
        ref_of = {store.mirror.state(s, None).ref: s for s, _ in keys[:: args.turns]}
        index_of = {key: i for i, key in enumerate(keys)}

        hits_at = {0.9: [0, 0], 0.85: [0, 0]}
        proposed_total = proposed_good = proposed_fair = 0
        lookup_times, nearest_times = [], []
        for _ in track(range(args.queries), "querying"):
            i = rng.randrange(num_versions)
            chat = chats[i // args.turns]
            cuts = [len(h) for h in chat[: i % args.turns + 1]]
            query = rerendered(rng, versions[i], cuts)
            buf = np.asarray(query, np.uint32).tobytes()
            start = time.perf_counter()
            hits = near.lsh.query(bucket, buf, LAYOUT.page_tokens)
            lookup_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            store.nearest(query, user_id="u", layout=LAYOUT, k=5)
            nearest_times.append(time.perf_counter() - start)
            whole = {index_of[(ref_of[h.entry.session_ref], h.entry.version_id)] for h in hits if not h.entry.is_window}
            q = np.frombuffer(buf, np.uint32)
            qs = np.unique(shingle_hashes(q, size, salt))
            truth = np.empty(num_versions)
            for j, s in enumerate(stored_sets):
                common = len(np.intersect1d(qs, s, assume_unique=True))
                truth[j] = common / (len(qs) + len(s) - common)
            for bar_, counts in hits_at.items():
                relevant = np.flatnonzero(truth >= bar_)
                counts[0] += len(relevant)
                counts[1] += sum(1 for j in relevant if j in whole)
            proposed_total += len(whole)
            proposed_good += sum(1 for j in whole if truth[j] >= 0.85)
            proposed_fair += sum(1 for j in whole if truth[j] >= 0.7)

        turns = next_turns(rng, store, versions, keys, args.queries)

        # memory: a fresh index holding the same versions
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        index = LshIndex(settings)
        fresh, _ = index.open_bucket(1, LAYOUT.digest, b"k" * 32)
        for n, tokens in enumerate(versions):
            index.add(fresh, n // args.turns, n, np.asarray(tokens, np.uint32).tobytes(), LAYOUT.page_tokens)
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        heap = sum(s.size_diff for s in after.compare_to(before, "filename"))

        # resume: approximate on but unused (the exact match covers the prompt) against off
        session, prompt = "timed", versions[-1] + [5, 6, 7]
        store.create_session(session, user_id="u", layout=LAYOUT)
        pages = {k: bytes([k % 256]) * LAYOUT.page_bytes for k in range(len(versions[-1]) // LAYOUT.page_tokens)}
        store.commit(session, versions[-1], pages)
        assert store.resume(session, prompt, approximate=True).num_candidates == 0
        off, on = [], []
        clock = time.perf_counter
        for i in track(range(10_000), "timing resume"):  # call by call, turn about: drift hits both alike
            for flag in (False, True) if i % 2 else (True, False):
                start = clock()
                store.resume(session, prompt, approximate=flag)
                (on if flag else off).append(clock() - start)
        used = []
        rerender = prompt[:8] + [60_999] * 6 + prompt[8:]
        for _ in range(50):
            start = time.perf_counter()
            store.resume(session, rerender, approximate=True)
            used.append(time.perf_counter() - start)
        store.close()

    recall90 = hits_at[0.9][1] / max(hits_at[0.9][0], 1)
    recall85 = hits_at[0.85][1] / max(hits_at[0.85][0], 1)
    med = statistics.median
    print(
        f"\nMinHash-LSH over {num_versions:,} stored versions ({args.chats:,} chats x {args.turns} turns), "
        f"{args.queries} re-rendered queries; threshold {settings.threshold}, {settings.permutations} permutations, "
        f"shingles of {size} tokens, windows of {settings.window_tokens}; {index.stats()['entries']:,} entries; "
        f"built from the catalog in {build:.1f} s\n"
    )
    print("| figure | value | bar |")
    print("|---|---|---|")
    print(f"| recall at Jaccard >= 0.9 | {recall90:.3f} | >= 0.95 |")
    print(f"| recall at Jaccard >= 0.85 | {recall85:.3f} | |")
    print(f"| pairs at Jaccard >= 0.9 | {hits_at[0.9][0]} | |")
    print(f"| precision (proposed at Jaccard >= 0.85) | {proposed_good / max(proposed_total, 1):.3f} | |")
    print(f"| precision (proposed at Jaccard >= 0.7) | {proposed_fair / max(proposed_total, 1):.3f} | |")
    print(f"| index lookup median ms | {med(lookup_times) * 1e3:.3f} | < 1 |")
    print(f"| nearest (lookup + verify) median ms | {med(nearest_times) * 1e3:.3f} | |")
    print(f"| next turn: right conversation first | {turns['chat']:.3f} | >= 0.95 |")
    print(f"| next turn: the version it extends first | {turns['version']:.3f} | |")
    print(f"| next turn: recall at containment >= 0.9 | {turns['recall']:.3f} | >= 0.95 |")
    print(f"| next turn: pairs at containment >= 0.9 | {turns['pairs']} | |")
    print(f"| next turn: index lookup median ms | {turns['lookup'] * 1e3:.3f} | < 1 |")
    print(f"| next turn: index lookup without prefixes median ms | {turns['lookup_before'] * 1e3:.3f} | |")
    print(f"| next turn: lookup with / without prefixes | {turns['lookup'] / turns['lookup_before']:.2f}x | |")
    print(f"| memory per indexed version bytes | {heap / num_versions:,.0f} | |")
    print(f"| resume approximate off us | {med(off) * 1e6:.1f} | |")
    print(f"| resume approximate on, unused us | {med(on) * 1e6:.1f} | |")
    print(f"| on-but-unused / off | {med(on) / med(off):.3f}x | <= 1.1 |")
    print(f"| resume approximate on, used (re-rendered) ms | {med(used) * 1e3:.3f} | |")


if __name__ == "__main__":
    main()
