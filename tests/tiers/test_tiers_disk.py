"""The disk tier: atomic segment files, verified batched reads, recovery of dead writers' files."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dss.core.hashing import checksum
from dss.core.types import PageId
from dss.tiers import segment
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


def test_large_runs_are_mapped_from_the_page_cache_small_ones_and_all_without_mapping_copied(
    tmp_path: Path, monkeypatch
) -> None:
    """Runs of 16 records of 512 KiB (8 MiB) are views of the segment's mapping, with no
    ``pread``; a run of small records is copied out with one; a tier told not to map copies both."""
    copies: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, off: copies.append(off) or real(fd, views, off))
    for map_reads, big_copies in ((True, 0), (False, 3)):
        disk = DiskTier(tmp_path / str(map_reads), map_reads=map_reads)
        for size, runs in ((512 << 10, big_copies), (1024, 1)):
            pages = records(40, size)
            _, _, located = disk.write(pages)
            requests = [ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)]
            del copies[:]
            got = {}
            for chunk in disk.read_chunks(requests, transient=True):
                assert chunk.failures == []
                for i, record in chunk.records:
                    assert isinstance(record.payload.obj, mmap.mmap) == (map_reads and size > 1024)
                    got[i] = bytes(record.payload)
            assert got == {i: p for i, (_, _, p, _) in enumerate(pages)}
            assert len(copies) == runs
        disk.close()


def test_a_mapped_payload_stays_readable_after_its_file_is_deleted(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    pages = records(4, 512 << 10)
    name, _, located = disk.write(pages)
    found, failures = disk.read([ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)])
    assert failures == [] and all(isinstance(r.payload.obj, mmap.mmap) for r in found if r is not None)
    disk.remove([name])
    assert not (tmp_path / "segments" / name).exists()
    assert [bytes(r.payload) for r in found if r is not None] == [p for _, _, p, _ in pages]
    disk.close()


@pytest.mark.parametrize("map_reads", [True, False])
def test_a_file_cut_short_fails_the_records_past_the_cut_alike_mapped_or_copied(
    tmp_path: Path, map_reads: bool
) -> None:
    disk = DiskTier(tmp_path, map_reads=map_reads)
    pages = records(4, 512 << 10)
    name, _, located = disk.write(pages)
    os.truncate(tmp_path / "segments" / name, located[2].offset + 100)  # record 2 torn, 3 gone
    found, failures = disk.read([ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)])
    assert [bytes(r.payload) if r else None for r in found] == [pages[0][2], pages[1][2], None, None]
    assert [(f.index, f.reason) for f in failures] == [
        (2, f"record at {name}:{located[2].offset} is truncated"),
        (3, f"record at {name}:{located[3].offset} is truncated"),
    ]
    disk.close()


def test_a_run_that_cannot_be_mapped_is_read_with_pread(tmp_path: Path, monkeypatch) -> None:
    """A run whose pages ``madvise`` cannot fault in (an I/O error comes back as ``EFAULT``:
    touching the page would raise ``SIGBUS``) is read with ``pread`` instead, which reports a
    failure if there is one; ``EINTR`` is asked again; a system without
    ``MADV_POPULATE_READ`` never maps."""
    disk = DiskTier(tmp_path)
    pages = records(4, 512 << 10)
    _, _, located = disk.write(pages)
    requests = [ReadRequest(*loc, pid, c) for loc, (pid, c, _, _) in zip(located, pages)]
    advised: list[int] = []

    def refusing(*codes: int) -> Callable[[int, int, int], int]:
        answers = list(codes)

        def call(address: int, length: int, advice: int) -> int:
            advised.append(advice)
            if not answers:
                return 0
            ctypes.set_errno(answers.pop(0))
            return -1

        return call

    for fake, mapping, calls in (
        (refusing(errno.EFAULT), False, 1),
        (refusing(errno.EINTR, errno.EINTR), True, 3),
        (None, False, 0),
    ):
        monkeypatch.setattr(segment, "_MADVISE", fake)
        del advised[:]
        found, failures = disk.read(requests)
        assert [bytes(r.payload) for r in found if r is not None] == [p for _, _, p, _ in pages] and failures == []
        assert all(isinstance(r.payload.obj, mmap.mmap) == mapping for r in found if r is not None)
        assert advised == [segment.MADV_POPULATE_READ] * calls
    disk.close()
