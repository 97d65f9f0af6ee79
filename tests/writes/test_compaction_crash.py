"""Crash safety of compaction and of a full disk: a real SIGKILL at each step of a compaction,
and writes that fail with ENOSPC, lose no acknowledged data and leave ``check()`` empty.

The victim (``tests/compaction_child.py``) builds the scenario of ``tests/writes/test_compaction.py``
and kills itself at the step named; this process then reopens the store and checks it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dss
from tests.conftest import _pg_schema
from tests.writes.test_compaction import COMPACTED, SEG_A, SEG_B, b_reads_back

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "sqlite":
        yield "-"
    else:
        yield from _pg_schema()


def run_victim(folder: Path, url: str, step: str) -> list[str]:
    child = subprocess.run(
        [sys.executable, "-m", "tests.compaction_child", str(folder), url, step],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    return [line for line in child.stdout.splitlines() if line.startswith("ack ")]


@pytest.mark.parametrize(
    "step, files_after",
    [
        ("before-copy", [SEG_A, SEG_B]),  # nothing written: the sparse file stays
        ("after-copy", [SEG_A, SEG_B]),  # the copy was never recorded: the next opener deletes it
        ("after-commit", [COMPACTED, SEG_B]),  # the old file was no longer recorded: the next opener deletes it
    ],
)
def test_a_kill_at_each_step_of_a_compaction_loses_nothing(
    tmp_path: Path, url: str, step: str, files_after: list[int]
) -> None:
    folder = tmp_path / "store"
    assert run_victim(folder, url, step) == ["ack built", "ack deleted"]
    with dss.open(folder, catalog_url=None if url == "-" else url, compact_auto=False) as store:
        assert store.check() == []
        assert sorted(store.disk.files().values()) == sorted(files_after)
        assert [name for name in store.disk.tmp_dir.iterdir()] == []
        assert b_reads_back(store)
        assert [s.session_id for s in store.sessions()] == ["b"]
        store.compact()  # finishes what the victim began
        assert sorted(store.disk.files().values()) == sorted([COMPACTED, SEG_B])
        assert b_reads_back(store) and store.check() == []


def test_a_full_disk_loses_nothing_acknowledged(tmp_path: Path, url: str) -> None:
    folder = tmp_path / "store"
    acks = run_victim(folder, url, "disk-full")
    assert acks[:2] == ["ack built", "ack deleted"]
    commits = [line.split() for line in acks if line.startswith("ack commit")]
    assert [int(n) for _, _, _, n in commits] == [16, 20, 24]
    assert acks[-1] == "ack compaction refused"
    with dss.open(folder, catalog_url=None if url == "-" else url) as store:
        assert store.check() == []
        assert [name for name in store.disk.tmp_dir.iterdir()] == []
        versions = {v.version_id for v in store.versions("b")}
        for _, _, version_id, num_tokens in commits:
            assert int(version_id) in versions
            assert len(store.tokens("b", int(version_id))) == int(num_tokens)
        assert b_reads_back(store)  # pages written before the disk filled up
        assert sorted(store.disk.files().values()) == sorted([SEG_A, SEG_B])  # none written after
