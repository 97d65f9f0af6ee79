"""An erasure killed (SIGKILL) at any step is finished by reopening the store or rerunning it.

The victim counts the erasure's SQL statements and file deletions and kills itself at one of
them; the test repeats this at points spread over the whole job. Afterwards there is exactly
one receipt, its verification passed, nothing of alice is left and bob is untouched.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import dss
from tests.erasure.test_erase import CANARY_TOKENS, NEEDLES, found, populate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("template") / "store"
    with dss.open(folder, encrypt=False) as store:  # plaintext, so a leftover byte would show in the scan
        populate(store)
    return folder


def job_recorded(folder: Path) -> bool:
    """Whether the killed victim got as far as recording its erasure job."""
    conn = sqlite3.connect(folder / "catalog.db")
    try:
        return conn.execute("SELECT COUNT(*) FROM erasures").fetchone()[0] > 0
    finally:
        conn.close()


def run_victim(folder: Path, point: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.erase_child", str(folder), point],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kill_at_every_step_then_finish(template: Path, tmp_path: Path) -> None:
    dry = tmp_path / "dry"
    shutil.copytree(template, dry)
    done = run_victim(dry, "sql:0")
    assert done.returncode == 0, done.stderr
    _, statements, unlinks, ok = done.stdout.split()
    statements, unlinks = int(statements), int(unlinks)
    assert ok == "True" and unlinks == 3 and statements >= 20
    points = [f"sql:{n}" for n in range(1, statements + 1, max(1, statements // 24))] + [
        f"unlink:{n}" for n in range(1, unlinks + 1)
    ]
    assert len(points) >= 20
    for n, point in enumerate(points):
        folder = tmp_path / f"kill-{n}"
        shutil.copytree(template, folder)
        victim = run_victim(folder, point)
        assert victim.returncode == -signal.SIGKILL, (point, victim.stdout, victim.stderr)
        started = job_recorded(folder)
        store = dss.open(folder, encrypt=False)  # opening finishes a recorded job
        if not started or n % 2 == 0:
            store.forget_user("alice", tenant_id="acme")  # running it again finishes (or starts) it too
        try:
            receipts = [e.receipt for e in store.audit() if e.user_id == "alice"]
            erased = [r for r in receipts if r.user_known]
            assert len(erased) == 1, point  # one erasure removed alice's data (a rerun after it finds none)
            assert erased[0].key_destroyed and erased[0].removed.sessions == 4, point
            assert [r.status for r in receipts] in (["verified"], ["verified", "no_such_user"]), point
            assert store.sessions(user_id="alice") == []
            assert store.resume("bob-1", [101] * 64).matched_tokens == 64
            assert store.check() == [], point
            assert store.resume("bob-0", CANARY_TOKENS).matched_tokens == 0
        finally:
            store.close()
        assert found(folder, NEEDLES) == [], point
