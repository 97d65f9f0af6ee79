"""A store process driven line by line, for the multi-process tests.

``python -m tests.store_child FOLDER CATALOG_URL|-``: opens the store, prints ``ready``, then
runs one command per line of stdin and answers one line each (flushed):

``commit SESSION USER N``  commit N more tokens to SESSION (created for USER if new), with
                           the KV of every full page; answers ``ack <version_id> <num_tokens>``
                           only after ``commit`` returned;
``forget USER``            ``forget_user(USER)``; answers ``forgot <pages removed> <ok>``;
``exit``                   closes the store and exits.
"""

from __future__ import annotations

import sys

import dss
from tests.crash_child import LAYOUT, payload


def commit(store: dss.Store, session_id: str, user_id: str, count: int) -> str:
    if session_id not in {s.session_id for s in store.sessions(user_id=user_id)}:
        store.create_session(session_id, user_id=user_id, layout=LAYOUT)
    before = store.tokens(session_id) if store.session(session_id).head_id is not None else []
    tokens = before + [(len(before) + i) % 1000 for i in range(count)]
    pages = {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
    version = store.commit(session_id, tokens, pages)
    return f"ack {version.version_id} {len(tokens)}"


def main() -> None:
    folder, url = sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2]
    store = dss.open(folder, catalog_url=url)
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "commit":
            answer = commit(store, args[0], args[1], int(args[2]))
        elif command == "forget":
            receipt = store.forget_user(args[0], tenant_id="default")
            answer = f"forgot {receipt.removed.pages} {receipt.status}"
        else:
            break
        print(answer, flush=True)
    store.close()


if __name__ == "__main__":
    main()
