"""The victim of the erasure kill test: forgets alice, SIGKILLing itself at a chosen point.

``python -m tests.erase_child FOLDER sql:N|unlink:N``: after the N-th SQL statement of the
erasure (or the N-th file deletion) the process sends itself SIGKILL. Prints the number of
statements and deletions when it finishes without being killed.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys

from sqlalchemy import event

import dss


def main() -> None:
    folder, point = sys.argv[1], sys.argv[2]
    kind, _, at = point.partition(":")
    limit = int(at)
    counts = {"sql": 0, "unlink": 0}

    def tick(what: str) -> None:
        counts[what] += 1
        if what == kind and counts[what] == limit:
            os.kill(os.getpid(), signal.SIGKILL)

    store = dss.open(folder)
    event.listen(store.catalog.engine, "after_cursor_execute", lambda *args: tick("sql"))
    unlink = pathlib.Path.unlink

    def counted_unlink(self: pathlib.Path, missing_ok: bool = False) -> None:
        unlink(self, missing_ok=missing_ok)
        if self.suffix == ".seg":
            tick("unlink")

    pathlib.Path.unlink = counted_unlink  # type: ignore[method-assign]
    receipt = store.forget_user("alice", tenant_id="acme")
    print(f"done {counts['sql']} {counts['unlink']} {receipt.verification.ok}", flush=True)


if __name__ == "__main__":
    main()
