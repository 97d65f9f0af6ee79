"""The victim of the crash test: commits forever and acknowledges each commit on stdout.

``python -m tests.crash_child FOLDER CATALOG_URL|- SEED``. A line ``ack <version_id>
<num_tokens> <digest>`` is printed (and flushed) only after ``commit`` returned, so every
acknowledged line names a commit the store promised to keep. Some steps roll back first,
so the history branches; every commit carries the KV of all its full pages. The first step
after ``ready``, and some later ones, erase a user of their own first (a session with pages,
then ``forget_user``) and print ``forgot <user_id>`` when the erasure returned.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sys

import dss

LAYOUT = dss.Layout(name="crash", page_tokens=8, page_bytes=512)


def payload(tokens: list[int], index: int) -> bytes:
    seed = hashlib.blake2b(repr(tokens[: (index + 1) * LAYOUT.page_tokens]).encode(), digest_size=16).digest()
    return seed * (LAYOUT.page_bytes // 16)


def digest(tokens: list[int]) -> str:
    return hashlib.blake2b(repr(tokens).encode(), digest_size=8).hexdigest()


def forget_one(store: dss.Store, user_id: str, rng: random.Random) -> None:
    """Give ``user_id`` a session with pages, then erase them."""
    store.create_session(user_id, user_id=user_id, layout=LAYOUT)
    tokens = [rng.randrange(1000) for _ in range(rng.randrange(8, 40))]
    store.commit(user_id, tokens, {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)})
    receipt = store.forget_user(user_id, tenant_id="default")
    assert receipt.status == "verified" and receipt.removed.sessions == 1
    print(f"forgot {user_id}", flush=True)


def main() -> None:
    folder, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    store = dss.open(folder, catalog_url=None if url == "-" else url, disk_bytes=1 << 30)
    store.create_session("victim", user_id="u", layout=LAYOUT)
    print("ready", flush=True)
    for step in itertools.count():
        if step == 0 or rng.random() < 0.1:
            forget_one(store, f"gone-{seed}-{step}", rng)
        versions = store.versions("victim")
        if versions and rng.random() < 0.2:
            store.rollback("victim", rng.choice(versions).version_id)
        tokens = store.tokens("victim") + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        pages = {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
        version = store.commit("victim", tokens, pages)
        print(f"ack {version.version_id} {len(tokens)} {digest(tokens)}", flush=True)


if __name__ == "__main__":
    main()
