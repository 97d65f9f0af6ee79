"""The victim of the mover crash test: commits, loads and prefetches in a loop on a store whose
tiers are small, so the mover (its thread, and ``run_mover`` here) demotes and evicts all the
time; SIGKILL lands in the middle of moves.

``python -m tests.mover_child FOLDER CATALOG_URL|- SEED``. Prints ``ack SESSION NUM_TOKENS
DIGEST`` (flushed) only after the commit returned; the first session's first version is pinned
before ``ready``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sys

import dss

LAYOUT = dss.Layout(name="mover", page_tokens=4, page_bytes=1024)
DISK_BYTES = 64 * (1024 + 60) + 2000
HOST_BYTES = 16 * 1024


def payload(tokens: list[int], index: int) -> bytes:
    seed = hashlib.blake2b(repr(tokens[: (index + 1) * LAYOUT.page_tokens]).encode(), digest_size=16).digest()
    return seed * (LAYOUT.page_bytes // 16)


def digest(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()


def open_store(folder: str, url: str | None, **options: object) -> dss.Store:
    return dss.open(
        folder,
        catalog_url=url,
        host_bytes=HOST_BYTES,
        disk_bytes=DISK_BYTES,
        mover_interval_s=0.005,
        move_batch_pages=8,
        **options,
    )


def main() -> None:
    folder, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    store = open_store(folder, None if url == "-" else url)
    pinned = [7000 + i for i in range(16)]
    store.create_session("pinned", layout=LAYOUT)
    if not store.versions("pinned"):
        version = store.commit("pinned", pinned, {i: payload(pinned, i) for i in range(4)})
        store.pin("pinned", version.version_id)
    print("ready", flush=True)
    for step in itertools.count():
        session = f"s{seed}-{step % 7}"
        store.create_session(session, user_id=f"u{step % 7 % 3}", layout=LAYOUT)
        tokens = store.tokens(session) + [rng.randrange(1000) for _ in range(rng.randrange(4, 24))]
        store.commit(session, tokens, {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)})
        print(f"ack {session} {len(tokens)} {digest(tokens)}", flush=True)
        other = f"s{seed}-{rng.randrange(min(7, step + 1))}"
        history = store.tokens(other)
        store.read_pages(store.resume(other, history).pages)
        store.prefetch(other)
        store.run_mover()


if __name__ == "__main__":
    main()
