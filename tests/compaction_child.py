"""The victim of the compaction crash tests: builds sparse segments, then dies at one step.

``python -m tests.compaction_child FOLDER CATALOG_URL|- STEP``. The child commits the scenario of
``tests/writes/test_compaction.py`` (printing ``ack`` after each acknowledged write), then:

* ``before-copy``, ``after-copy``, ``after-commit``: compacts, and SIGKILLs itself when
  compaction is about to read the live records, right after it wrote their copy (before the
  catalog commit), or right after the commit (before the old file is deleted);
* ``disk-full``: from then on every page-file write fails with ENOSPC after writing half of
  its first part; it commits more versions (acknowledged: their pages stay in host only) and
  tries to compact, then SIGKILLs itself.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

import dss
from dss.tiers import disk as disk_module
from dss.tiers.disk import DiskTier
from tests.writes.test_compaction import build


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(step: str) -> None:
    if step == "before-copy":
        DiskTier.read = lambda self, *a, **k: die()  # type: ignore[method-assign]
    elif step == "after-copy":
        write = DiskTier.write

        def write_then_die(self: DiskTier, pages: object) -> object:
            write(self, pages)  # type: ignore[arg-type]
            die()

        DiskTier.write = write_then_die  # type: ignore[method-assign]
    elif step == "after-commit":
        DiskTier.remove = lambda self, segments: die() if list(segments) else None  # type: ignore[method-assign]
    elif step == "disk-full":

        def full(fd: int, parts: list) -> None:
            os.write(fd, bytes(memoryview(parts[0])[: len(parts[0]) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk_module.write_all = full


def main() -> None:
    folder, url, step = sys.argv[1], sys.argv[2], sys.argv[3]
    store = dss.open(folder, catalog_url=None if url == "-" else url, compact_auto=False)
    build(store)
    print("ack built", flush=True)
    store.delete_session("a")
    print("ack deleted", flush=True)
    arm(step)
    if step == "disk-full":
        tokens = [60, 61, 62, 63] * 3
        for turn in range(3):
            tokens = tokens + [70 + turn] * 4
            version = store.commit("b", tokens, {i: bytes([i]) * 64 for i in range(len(tokens) // 4)})
            print(f"ack commit {version.version_id} {len(tokens)}", flush=True)
        try:
            store.compact()
        except dss.InternalError:
            print("ack compaction refused", flush=True)
        die()
    store.compact()
    print("survived", flush=True)


if __name__ == "__main__":
    main()
