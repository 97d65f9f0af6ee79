"""The victim of the crash test: commits forever and acknowledges each commit on stdout.

``python -m tests.crash_child FOLDER CATALOG_URL|- SEED``. A line ``ack <version_id>
<num_tokens> <digest>`` is printed (and flushed) only after ``commit`` returned, so every
acknowledged line names a commit the store promised to keep. Some steps roll back first,
so the history branches; every commit carries the KV of all its full pages.
"""

from __future__ import annotations

import hashlib
import random
import sys

import dss

LAYOUT = dss.Layout(name="crash", page_tokens=8, page_bytes=512)


def payload(tokens: list[int], index: int) -> bytes:
    seed = hashlib.blake2b(repr(tokens[: (index + 1) * LAYOUT.page_tokens]).encode(), digest_size=16).digest()
    return seed * (LAYOUT.page_bytes // 16)


def digest(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()


def main() -> None:
    folder, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    store = dss.open(folder, catalog_url=None if url == "-" else url, disk_bytes=1 << 30)
    store.create_session("victim", user_id="u", layout=LAYOUT)
    print("ready", flush=True)
    while True:
        versions = store.versions("victim")
        if versions and rng.random() < 0.2:
            store.rollback("victim", rng.choice(versions).version_id)
        tokens = store.tokens("victim") + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        pages = {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
        version = store.commit("victim", tokens, pages)
        print(f"ack {version.version_id} {len(tokens)} {digest(tokens)}", flush=True)


if __name__ == "__main__":
    main()
