"""The disk tier: page records in segment files, written in batches, read in batches.

Segment file format ``dss-segment v1`` (all integers little-endian)::

    header   32 bytes   b"dss-segment v1\\n" + 17 zero bytes
    record   32 bytes   page id (16) | payload length u32 | flags u32 | XXH3-64 of payload i64
             payload    (flags bit 0: the payload is sealed, see dss.core.crypto)

A segment is written to ``tmp/``, fsynced, renamed into ``segments/`` and the directory
fsynced, so it is either whole or absent. Files are never changed after that; deleting
pages means deleting whole segments (the store rewrites live pages elsewhere first when it
compacts). Every read checks the record's page id, length and checksum against what the
catalog expects.

Each process writes under a writer id and holds an exclusive ``flock`` on
``locks/<writer>.lock`` while it lives; a segment without a catalog row is an orphan only
once its writer's lock can be taken, i.e. the writer is dead.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from dss.core.hashing import checksum as page_checksum
from dss.tiers.base import DurableTier, Located, ReadFailure, ReadRequest, StoredPage
from dss.core.types import PageId

MAGIC = b"dss-segment v1\n".ljust(32, b"\0")
RECORD = struct.Struct("<16sIIq")
HEADER_BYTES = len(MAGIC)
COALESCE_GAP = 256 << 10
"""Records closer than this are read with one ``pread``."""


class DiskTier(DurableTier):
    """Segment files under ``root``; see the module docstring for the format and protocol."""

    name = "disk"

    def __init__(self, root: Path, *, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self.segments_dir = root / "segments"
        self.tmp_dir = root / "tmp"
        self.locks_dir = root / "locks"
        for folder in (self.segments_dir, self.tmp_dir, self.locks_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self.writer = secrets.token_hex(8)
        # locked before it gets its name: another process's recover() never sees it unlocked
        tmp = self.locks_dir / f".{self.writer}.tmp"
        self._lock_fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, self.locks_dir / f"{self.writer}.lock")
        self._counter = itertools.count()
        self._in_flight: set[str] = set()
        """Segments this process wrote whose catalog transaction has not ended yet."""

    def close(self) -> None:
        """Release the writer lock; the tier must not be used afterwards."""
        if self._lock_fd >= 0:
            os.unlink(self.locks_dir / f"{self.writer}.lock")
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- writing ---------------------------------------------------------------------------

    def write(self, pages: Sequence[tuple[PageId, int, bytes, int]], *,
              publish: bool = True) -> tuple[str, int, list[Located]]:
        """Publish ``(page_id, checksum, payload, flags)`` records as one new segment; see DurableTier.

        ``publish=False`` skips the folder's fsync: the rename is durable only once
        :meth:`publish` ran (group commit fsyncs the folder once for a whole group), and
        until then a crash may lose the file, which nothing refers to yet."""
        name = f"{self.writer}-{next(self._counter):010d}.seg"
        self._in_flight.add(name)
        parts: list[bytes] = [MAGIC]
        locations: list[Located] = []
        offset = HEADER_BYTES
        for page_id, checksum, payload, flags in pages:
            parts.append(RECORD.pack(page_id, len(payload), flags, checksum))
            parts.append(payload)
            length = RECORD.size + len(payload)
            locations.append(Located(name, offset, length))
            offset += length
        tmp = self.tmp_dir / name
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                f.writelines(parts)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, self.segments_dir / name)
        if publish:
            self._sync_dir(self.segments_dir)
        return name, offset, locations

    def publish(self) -> None:
        """Make the renames of segments written with ``publish=False`` durable (fsync the folder)."""
        self._sync_dir(self.segments_dir)

    def remove(self, segments: Iterable[str]) -> None:
        """Delete segments (absent ones are ignored), then fsync the directory."""
        removed = False
        for name in segments:
            self._in_flight.discard(name)
            try:
                (self.segments_dir / name).unlink()
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            self._sync_dir(self.segments_dir)

    # -- reading ---------------------------------------------------------------------------

    def read(self, requests: Sequence[ReadRequest]) -> tuple[list[StoredPage | None], list[ReadFailure]]:
        """Verified records in request order; see DurableTier. Never raises for bad files."""
        out: list[StoredPage | None] = [None] * len(requests)
        failures: list[ReadFailure] = []
        order = sorted(range(len(requests)), key=lambda i: (requests[i].segment, requests[i].offset))
        for segment, group in itertools.groupby(order, key=lambda i: requests[i].segment):
            indices = list(group)
            try:
                fd = os.open(self.segments_dir / segment, os.O_RDONLY)
            except OSError as exc:
                failures.extend(ReadFailure(i, f"segment {segment}: {exc.strerror}") for i in indices)
                continue
            try:
                for run in _runs(indices, requests):
                    self._read_run(fd, run, requests, out, failures)
            finally:
                os.close(fd)
        return out, failures

    def _read_run(self, fd: int, run: list[int], requests: Sequence[ReadRequest],
                  out: list[StoredPage | None], failures: list[ReadFailure]) -> None:
        start = requests[run[0]].offset
        end = max(requests[i].offset + requests[i].length for i in run)
        try:
            data = memoryview(os.pread(fd, end - start, start))
        except OSError as exc:
            failures.extend(ReadFailure(i, f"read failed: {exc.strerror}") for i in run)
            return
        for i in run:
            req = requests[i]
            record = data[req.offset - start : req.offset - start + req.length]
            problem = _verify(record, req)
            if problem:
                failures.append(ReadFailure(i, problem))
            else:
                out[i] = StoredPage(record[RECORD.size :], RECORD.unpack_from(record)[2])

    # -- inventory and recovery ------------------------------------------------------------

    def files(self) -> dict[str, int]:
        """Every segment file present, with its size in bytes."""
        return {entry.name: entry.stat().st_size for entry in os.scandir(self.segments_dir) if entry.is_file()}

    def is_orphan(self, name: str) -> bool:
        """Whether the writer of segment ``name`` is gone (so an unrecorded file is garbage)."""
        return not self._alive(name.split("-", 1)[0])

    def _alive(self, writer: str) -> bool:
        if writer == self.writer:
            return True
        path = self.locks_dir / f"{writer}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return True
            raise
        finally:
            os.close(fd)
        return False

    def settled(self, segments: Iterable[str]) -> None:
        """The transaction recording these segments (written by this process) committed."""
        for name in segments:
            self._in_flight.discard(name)

    def sweep(self, recorded: set[str]) -> list[str]:
        """Delete the segments this process wrote that the catalog no longer records (another
        node's erasure purged their rows), then what :meth:`recover` deletes. ``recorded`` is
        every segment name the catalog holds for this node. Returns the names deleted."""
        mine = f"{self.writer}-"
        in_flight = set(self._in_flight)
        gone = [name for name in self.files() if name.startswith(mine) and name not in recorded
                and name not in in_flight]
        for name in gone:
            (self.segments_dir / name).unlink(missing_ok=True)
        if gone:
            self._sync_dir(self.segments_dir)
        return gone + self.recover(recorded)

    def recover(self, recorded: set[str]) -> list[str]:
        """Delete unrecorded segments and temp files of dead writers, and their stale locks.

        ``recorded`` is every segment name the catalog holds. Returns the names deleted.
        """
        deleted: list[str] = []
        for name in self.files():
            if name not in recorded and self.is_orphan(name):
                (self.segments_dir / name).unlink(missing_ok=True)
                deleted.append(name)
        for entry in os.scandir(self.tmp_dir):
            if self.is_orphan(entry.name):
                Path(entry.path).unlink(missing_ok=True)
                deleted.append(entry.name)
        for entry in os.scandir(self.locks_dir):
            if entry.name.startswith("."):  # a lock being made (see __init__)
                continue
            writer = entry.name.removesuffix(".lock")
            if not self._alive(writer):
                Path(entry.path).unlink(missing_ok=True)
        if deleted:
            self._sync_dir(self.segments_dir)
        return deleted

    def _sync_dir(self, folder: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _runs(indices: list[int], requests: Sequence[ReadRequest]) -> list[list[int]]:
    """Split offset-sorted request indices into runs close enough to read at once."""
    runs: list[list[int]] = []
    end = -1
    for i in indices:
        req = requests[i]
        if runs and req.offset <= end + COALESCE_GAP:
            runs[-1].append(i)
            end = max(end, req.offset + req.length)
        else:
            runs.append([i])
            end = req.offset + req.length
    return runs


def _verify(record: memoryview, req: ReadRequest) -> str | None:
    if len(record) < req.length:
        return f"record at {req.segment}:{req.offset} is truncated"
    page_id, size, _flags, stored = RECORD.unpack_from(record)
    if page_id != req.page_id:
        return f"record at {req.segment}:{req.offset} holds another page"
    if size != req.length - RECORD.size or stored != req.checksum:
        return f"record at {req.segment}:{req.offset} has a corrupt header"
    if page_checksum(record[RECORD.size :]) != req.checksum:
        return f"record at {req.segment}:{req.offset} fails its checksum"
    return None
