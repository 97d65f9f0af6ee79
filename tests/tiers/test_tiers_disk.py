"""The disk tier: atomic segment files, verified batched reads, recovery of dead writers' files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.tiers.base import ReadRequest
from dss.tiers.disk import DiskTier
from dss.tiers.segment import HEADER_BYTES, MAGIC, RECORD

PAGES = [(PageId(bytes([i]) * 16), checksum(bytes([i]) * 100), bytes([i]) * 100, i % 2) for i in range(5)]


def test_segment_format_and_round_trip(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    name, size, located = disk.write(PAGES)
    data = (tmp_path / "segments" / name).read_bytes()
    assert data[:32] == MAGIC and data.startswith(b"dss-segment v1\n")
    assert size == len(data) == HEADER_BYTES + 5 * (RECORD.size + 100)
    assert [loc.offset for loc in located] == [HEADER_BYTES + i * (RECORD.size + 100) for i in range(5)]
    requests = [ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, PAGES)]
    records, failures = disk.read(requests[::-1])
    assert [(bytes(r.payload), r.flags) for r in records] == [(p, f) for _, _, p, f in PAGES][::-1]
    assert failures == []
    assert list((tmp_path / "tmp").iterdir()) == []
    disk.close()


def test_reads_are_coalesced_into_few_preads(tmp_path: Path, monkeypatch) -> None:
    disk = DiskTier(tmp_path)
    _, _, located = disk.write(PAGES)
    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append((n, off)) or real(fd, n, off))
    disk.read([ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, PAGES)])
    assert calls == [(5 * (RECORD.size + 100), HEADER_BYTES)]
    disk.close()


def test_recovery_removes_only_files_of_dead_writers(tmp_path: Path) -> None:
    script = (
        f"import os; from pathlib import Path; from dss.tiers.disk import DiskTier; "
        f"d = DiskTier(Path({str(tmp_path)!r})); print(d.write([(b'x' * 16, 0, b'', 0)])[0]); os._exit(0)"
    )
    dead = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    alive = DiskTier(tmp_path)
    mine, _, _ = alive.write(PAGES[:1])
    (tmp_path / "tmp" / f"{dead.split('-')[0]}-0000000009.seg").write_bytes(b"partial")
    other = DiskTier(tmp_path)
    assert sorted(other.recover(recorded=set())) == sorted([dead, f"{dead.split('-')[0]}-0000000009.seg"])
    assert mine in other.files()  # its writer (alive) still holds its lock
    assert not (tmp_path / "locks" / f"{dead.split('-')[0]}.lock").exists()
    alive.close()
    assert other.recover(recorded=set()) == [mine]
    other.close()


def records(count: int, size: int, flags: int = 0) -> list[tuple[PageId, int, bytes, int]]:
    out = []
    for i in range(count):
        payload = i.to_bytes(4, "little") * (size // 4)
        out.append((PageId(i.to_bytes(16, "little")), checksum(payload), payload, flags))
    return out


def test_pages_move_sixteen_per_io(tmp_path: Path) -> None:
    """A segment of 40 records goes out in 3 writes (8, 16, 16: the first one short, so the disk
    starts while the next records are produced); reading big records back takes
    16 per pread, small ones as many as fit 4 MiB; the result is the same either way."""
    disk = DiskTier(tmp_path)
    for size, reads in ((512 << 10, 3), (1024, 1)):
        before = (disk.io.writes, disk.io.reads)
        pages = records(40, size)
        _, _, located = disk.write(pages)
        assert (disk.io.writes - before[0], disk.io.pages_written) == (3, 40 if size > 1024 else 80)
        requests = [ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)]
        for transient in (False, True):
            got: dict[int, bytes] = {}
            for chunk in disk.read_chunks(requests, transient=transient):
                assert chunk.failures == []
                got.update((i, bytes(record.payload)) for i, record in chunk.records)
            assert got == {i: p for i, (_, _, p, _) in enumerate(pages)}
        assert disk.io.reads - before[1] == 2 * reads
    disk.close()


def test_a_sealed_record_is_left_to_its_reader_to_authenticate(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    pages = records(2, 64, flags=1)
    name, _, located = disk.write(pages)
    path = tmp_path / "segments" / name
    data = bytearray(path.read_bytes())
    data[located[1].offset + RECORD.size] ^= 0xFF  # a payload byte of the second (sealed) record
    path.write_bytes(bytes(data))
    requests = [ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)]
    found, failures = disk.read(requests)
    assert found[0] is not None and found[1] is None
    assert [f.reason.split()[-2:] for f in failures] == [["its", "checksum"]]
    found, failures = disk.read(requests, sealed_verified_by_caller=True)
    assert [r is not None for r in found] == [True, True] and failures == []  # its tag will fail instead
    disk.close()
