"""The commit path, as ``scripts/trace-commit`` traces it: one commit with new pages of a
session this process holds builds its change without the store's lock, takes the lock once (to
apply it, caught up with other processes, with its answer read under the same hold), syncs the
mirror once and runs one catalog transaction."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_commit_takes_the_lock_once_syncs_once_and_runs_one_transaction() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "trace-commit"), "--depth", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "store/history.py:History.commit"
    assert "  writes/writer.py:Writer.write" in lines
    assert lines[-1] == "lock entries: 1 (+0 nested), mirror syncs: 1, catalog transactions: 1"
