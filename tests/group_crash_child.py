"""The victim of the group-commit crash test: many threads commit at once, each acknowledging
its commits on stdout.

``python -m tests.group_crash_child FOLDER CATALOG_URL|- ROUND THREADS``. Thread ``n`` commits
to session ``r<ROUND>-t<n>`` forever; a line ``ack <session> <version_id> <num_tokens>
<digest>`` is printed (and flushed) only after ``commit`` returned. Group commit is on (the
default), so most commits share a transaction with others.
"""

from __future__ import annotations

import random
import sys
import threading

import dss
from tests.crash_child import LAYOUT, digest, payload

PRINT = threading.Lock()


def main() -> None:
    folder, url, round_, num_threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = dss.open(folder, catalog_url=None if url == "-" else url, disk_bytes=1 << 30)
    assert store.writer.group_commit
    names = [f"r{round_}-t{n}" for n in range(num_threads)]
    for name in names:
        store.create_session(name, user_id=f"u{round_ % 3}", layout=LAYOUT)

    def worker(name: str, seed: int) -> None:
        rng = random.Random(seed)
        tokens: list[int] = []
        while True:
            tokens = tokens + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            version = store.commit(
                name, tokens, {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
            )
            with PRINT:
                print(f"ack {name} {version.version_id} {len(tokens)} {digest(tokens)}", flush=True)

    with PRINT:
        print("ready", flush=True)
    threads = [
        threading.Thread(target=worker, args=(name, round_ * 1000 + n), daemon=True) for n, name in enumerate(names)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
