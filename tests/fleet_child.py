"""A node of a fleet, driven line by line, for the multi-node tests.

``python -m tests.fleet_child FOLDER CATALOG_URL REMOTE_URL PREFIX NODE_ID``: opens the store
as node ``NODE_ID`` (one PostgreSQL catalog and one Redis shared with the other nodes),
prints ``ready``, then runs one command per line of stdin and answers one line each (flushed):

``commit SESSION USER N [START]``  commit N more tokens to SESSION (created for USER if new),
                           counting up from START (default 0) modulo 1000, with the KV of
                           every full page; ``ack <version_id> <num_tokens>`` only after
                           ``commit`` returned;
``loop SESSION USER``      make the session if new, then commit 8 more tokens to it again and
                           again, forever (until the process is killed): ``ack`` for each
                           commit that returned, ``error <type>`` (then a 10 ms pause) for
                           each that raised a ``DssError``;
``resume SESSION``         resume the session's head tokens and read its pages: ``resumed
                           <matched> <tiers as JSON> <pages read byte-exact> <pages missed>``
                           (a read that fails is an ``error <type>`` line instead);
``flush``                  wait for the remote tier's queue: ``flushed <True|False>``;
``check``                  ``checked <problems as JSON>``;
``forget USER [PAUSE_S BEGAN]``  ``forget_user(USER)`` in tenant ``default``: ``forgot <pages
                           removed> <status>``; with ``PAUSE_S``, it pauses that long before each
                           step and writes the time (``time.time()``) its job began to the file
                           ``BEGAN`` first;
``exit``                   closes the store and exits.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import dss
from tests.crash_child import LAYOUT, payload


def commit(store: dss.Store, session_id: str, user_id: str, count: int, start: int = 0) -> str:
    store.create_session(session_id, user_id=user_id, layout=LAYOUT)
    before = store.tokens(session_id)
    tokens = before + [(start + len(before) + i) % 1000 for i in range(count)]
    pages = {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
    version = store.commit(session_id, tokens, pages)
    return f"ack {version.version_id} {len(tokens)}"


def commit_more(store: dss.Store, session_id: str, count: int) -> str:
    """Commit ``count`` more tokens to an existing session (never makes it again)."""
    before = store.tokens(session_id)
    tokens = before + [(len(before) + i) % 1000 for i in range(count)]
    pages = {i: payload(tokens, i) for i in range(len(tokens) // LAYOUT.page_tokens)}
    version = store.commit(session_id, tokens, pages)
    return f"ack {version.version_id} {len(tokens)}"


def paused(pause_s: float, began: str) -> Callable[[str], None]:
    """An erasure's progress callback: the first call (the job is recorded) writes the time to
    the file ``began``; every call sleeps ``pause_s``."""

    def progress(step: str) -> None:
        if step.startswith("planned "):
            Path(began).write_text(repr(time.time()))
        time.sleep(pause_s)

    return progress


def resume(store: dss.Store, session_id: str) -> str:
    tokens = store.tokens(session_id)
    result = store.resume(session_id, tokens)
    read = store.read_pages(result.pages)
    exact = sum(data == payload(tokens, ref.index) for ref, data in zip(result.pages, read))
    missed = sum(data is None for data in read)
    return f"resumed {result.matched_tokens} {json.dumps(result.tiers, separators=(',', ':'))} {exact} {missed}"


def main() -> None:
    folder, url, remote_url, prefix, node_id = sys.argv[1:6]
    store = dss.open(
        folder,
        catalog_url=url,
        remote_url=remote_url,
        remote_prefix=prefix,
        node_id=node_id,
        remote_timeout_s=0.3,
        feed_poll_s=0.5,
    )
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "commit":
                answer = commit(store, args[0], args[1], int(args[2]), *map(int, args[3:]))
            elif command == "loop":
                store.create_session(args[0], user_id=args[1], layout=LAYOUT)
                while True:
                    try:
                        print(commit_more(store, args[0], 8), flush=True)
                    except dss.DssError as exc:
                        print(f"error {type(exc).__name__}", flush=True)
                        time.sleep(0.01)
            elif command == "resume":
                answer = resume(store, args[0])
            elif command == "flush":
                assert store.remote is not None
                answer = f"flushed {store.remote.flush(10)}"
            elif command == "check":
                answer = f"checked {json.dumps(store.check())}"
            elif command == "forget":
                receipt = store.forget_user(
                    args[0], tenant_id="default", progress=paused(float(args[1]), args[2]) if len(args) > 1 else None
                )
                answer = f"forgot {receipt.removed.pages} {receipt.status}"
            else:
                break
        except dss.DssError as exc:
            answer = f"error {type(exc).__name__} {exc}"
        print(answer, flush=True)
    store.close()


if __name__ == "__main__":
    main()
