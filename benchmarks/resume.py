"""How fast ``resume`` answers on a long conversation, next to hashing-based lookups of the same prompt.

Builds, in a fresh store, one 40-turn session of 32,768 tokens (plus 15 other sessions and
3 branches of the big one), then times ``resume`` on three prompts:

* full match + 200 new tokens, * divergence at token 16,000, * no match (first token differs),

with the prompt given as a Python list (what engines pass) and as a uint32 numpy buffer,
next to three baselines on the same prompt in the same run:

* floor: pack the list into a uint32 buffer (``array.fromlist``) and compare it with the
  stored history in one memcmp — what any exact lookup from a Python list must pay;
* chain/sha256: a vLLM-style chained block lookup, SHA-256 over pickled (parent, 32 tokens),
  probing a dict of the stored blocks until the first miss;
* chain/xxh3: the same with XXH3-128;
* vllm: vLLM's own ``hash_block_tokens`` with its default ``sha256`` (when vLLM is installed).

The contenders run interleaved (one call of each per round, rounds repeated), so drift of this
shared machine hits them alike: list/floor is the median of per-round ratios; a chain's
speed-up is its median over dss's median in the same (slower, cache-polluting) rounds. Medians of
per-call times in microseconds. Rerun with::

    .venv/bin/python benchmarks/resume.py

Targets: on the full match, from a list within 1.5x of the floor; from a buffer
under 50 us.
"""

from __future__ import annotations

import array
import hashlib
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash
from progress import track

import dss

PAGE = 32
TURNS = 40
TOTAL = 32_768
LAYOUT = dss.Layout(name="bench", page_tokens=PAGE, page_bytes=64)


def interleaved_us(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Per-call microseconds of each function, one call of each per round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - start) / 1000)
    return times


def build(store: dss.Store, rng: random.Random) -> list[int]:
    """The big session, 15 others of other users, and three branches of the big one."""
    store.create_session("big", user_id="u0", layout=LAYOUT)
    history: list[int] = []
    per_turn = TOTAL // TURNS
    for turn in track(range(TURNS), "committing 40 turns"):
        grow = per_turn if turn < TURNS - 1 else TOTAL - len(history)
        history = history + [rng.randrange(128_000) for _ in range(grow)]
        store.commit("big", history, {i: b"k" * 64 for i in range(len(history) // PAGE)})
    versions = store.versions("big")
    for n, turn in enumerate((10, 20, 30)):
        branch = f"big-branch-{n}"
        store.branch("big", versions[turn].version_id, branch)
        tokens = store.tokens(branch) + [rng.randrange(128_000) for _ in range(500)]
        store.commit(branch, tokens, {i: b"b" * 64 for i in range(len(tokens) // PAGE)})
    for n in range(15):
        store.create_session(f"other-{n}", user_id=f"u{n + 1}", layout=LAYOUT)
        tokens = [rng.randrange(128_000) for _ in range(4096)]
        store.commit(f"other-{n}", tokens, {i: b"o" * 64 for i in range(len(tokens) // PAGE)})
    return history


class Chain:
    """A vLLM-style prefix cache: chained block hashes in a dict, probed until the first miss."""

    def __init__(self, block_hash: Callable[[bytes | None, tuple[int, ...]], bytes], history: Sequence[int]) -> None:
        self.block_hash = block_hash
        self.cached: set[bytes] = set()
        self.cached.update(self.hashes(history))

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        out, parent = [], None
        for start in range(0, len(tokens) - PAGE + 1, PAGE):
            parent = self.block_hash(parent, tuple(tokens[start : start + PAGE]))
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[int]) -> int:
        parent, hit = None, 0
        for start in range(0, len(tokens) - PAGE + 1, PAGE):
            parent = self.block_hash(parent, tuple(tokens[start : start + PAGE]))
            if parent not in self.cached:
                break
            hit += PAGE
        return hit


def sha256_block(parent: bytes | None, block: tuple[int, ...]) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, block), protocol=pickle.HIGHEST_PROTOCOL)).digest()


def xxh3_block(parent: bytes | None, block: tuple[int, ...]) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps((parent, block), protocol=pickle.HIGHEST_PROTOCOL))


def vllm_block() -> Callable[[bytes | None, tuple[int, ...]], bytes] | None:
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    except ImportError:
        return None
    init_none_hash(sha256)
    return lambda parent, block: hash_block_tokens(sha256, parent, block)  # type: ignore[arg-type]


def main() -> None:
    rng = random.Random(0)
    folder = tempfile.mkdtemp(prefix="dss-bench-resume-")
    store = dss.open(folder)
    print(f"building 40 turns x {TOTAL} tokens + 15 sessions + 3 branches in {folder} ...", file=sys.stderr)
    history = build(store, rng)
    stored = array.array("I", history).tobytes()
    prompts = {
        "full match + 200 new": history + [rng.randrange(128_000) for _ in range(200)],
        "divergence at 16,000": history[:16_000] + [rng.randrange(128_000) for _ in range(TOTAL + 200 - 16_000)],
        "no match": [128_001] + history[1:] + [rng.randrange(128_000) for _ in range(200)],
    }
    chains = {"sha256": Chain(sha256_block, history), "xxh3": Chain(xxh3_block, history)}
    vllm = vllm_block()
    if vllm is not None:
        chains["vllm"] = Chain(vllm, history)

    def floor(prompt: list[int]) -> bool:
        packed = array.array("I")
        packed.fromlist(prompt)
        return packed.tobytes().startswith(stored)

    rows = []
    for case, prompt in track(prompts.items(), "timing resume and the chains"):
        buffer = np.array(prompt, dtype=np.uint32)
        result = store.resume("big", prompt)
        expected = {"full match + 200 new": TOTAL, "divergence at 16,000": 16_000, "no match": 0}[case]
        assert result.matched_tokens == expected, (case, result)
        assert all(chain.lookup(prompt) == expected for chain in chains.values())
        fast = interleaved_us(
            {
                "list": lambda p=prompt: store.resume("big", p),
                "buffer": lambda b=buffer: store.resume("big", b),
                "floor": lambda p=prompt: floor(p),
            },
            rounds=1500,
        )
        slow = interleaved_us(
            {
                "list": lambda p=prompt: store.resume("big", p),
                **{name: (lambda c=chain, p=prompt: c.lookup(p)) for name, chain in chains.items()},
            },
            rounds=40,
        )
        row: dict = {
            "case": case,
            **{k: statistics.median(v) for k, v in fast.items()},
            "list/floor": statistics.median(a / b for a, b in zip(fast["list"], fast["floor"])),
        }
        for name in chains:
            row[name] = statistics.median(slow[name])
            row[f"x {name}"] = row[name] / statistics.median(slow["list"])
        rows.append(row)
    store.close()
    report(rows, list(chains))


def report(rows: list[dict], chains: list[str]) -> None:
    head = [
        "case",
        "dss list",
        "dss buffer",
        "floor",
        *[f"chain/{c}" for c in chains],
        "list/floor",
        *[f"x vs {c}" for c in chains],
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["case"],
                f"{r['list']:.1f}",
                f"{r['buffer']:.1f}",
                f"{r['floor']:.1f}",
                *[f"{r[c]:.0f}" for c in chains],
                f"{r['list/floor']:.2f}",
                *[f"{r[f'x {c}']:.1f}x" for c in chains],
            ]
        )
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    print(
        "median microseconds per call; list/floor is the median of per-round ratios; x vs chain is the chain's "
        "median over dss's (list) in the same interleaved rounds"
    )
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(t, widths)) + " |")
    full = rows[0]
    print(
        f"\ntarget, full match from a list within 1.5x of the floor: {full['list/floor']:.2f}x "
        f"({'met' if full['list/floor'] <= 1.5 else 'MISSED'})"
    )
    print(
        f"target, full match from a buffer under 50 us: {full['buffer']:.1f} us "
        f"({'met' if full['buffer'] < 50 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
