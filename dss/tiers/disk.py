"""The disk tier: page records in segment files, written in batches, read in batches.

Segment file format ``dss-segment v1`` (all integers little-endian; :mod:`dss.tiers.segment`)::

    header   32 bytes   b"dss-segment v1\\n" + 17 zero bytes
    record   32 bytes   page id (16) | payload length u32 | flags u32 | XXH3-64 of payload i64
             payload    (flags bit 0: the payload is sealed, see dss.core.crypto)

A segment is written to ``tmp/``, fsynced, renamed into ``segments/`` and the directory
fsynced, so it is either whole or absent. Files are never changed after that; deleting
pages means deleting whole segments (the store rewrites live pages elsewhere first when it
compacts). Every read checks the record's page id, length and checksum against what the
catalog expects.

I/O is batched both ways: a segment is written with one ``writev`` per :data:`~dss.tiers.segment.IO_PAGES`
records, and reads coalesce neighbouring records into one ``pread`` of at most
:data:`~dss.tiers.segment.IO_PAGES` records (more when they are small, up to :data:`~dss.tiers.segment.IO_BYTES`), the next one
issued by a helper thread while the caller verifies and opens the last (``read_chunks``). A
run of :data:`~dss.tiers.segment.MAP_BYTES` or more is mapped from the OS page cache instead
of copied out of it (:func:`~dss.tiers.segment.mapped`; ``map_reads``).
Records flagged sealed may be returned unverified (``sealed_verified_by_caller``): their
AES-GCM tag authenticates them, so hashing them as well would be done twice.

Each process writes under a writer id and holds an exclusive ``flock`` on
``locks/<writer>.lock`` while it lives; a segment without a catalog row is an orphan only
once its writer's lock can be taken, i.e. the writer is dead.

:attr:`DiskTier.inactive` lists the segments the mover demoted (:mod:`dss.tiers.inactive`);
deleting a file takes it off that list.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dss.core.types import PageId
from dss.tiers.base import DurableTier, Located, ReadFailure, ReadRequest, StoredPage
from dss.tiers.inactive import InactiveSegments
from dss.tiers.segment import (
    FIRST_IO_PAGES,
    HEADER_BYTES,
    IO_PAGES,
    MAGIC,
    MAP_BYTES,
    RECORD,
    Chunk,
    chunk_of,
    pread,
    read_mapped,
    runs_of,
    write_all,
)


class IoCounts:
    """This tier's I/O calls and the records they moved, since it was opened."""

    __slots__ = ("pages_read", "pages_written", "reads", "writes")

    def __init__(self) -> None:
        self.reads = self.pages_read = self.writes = self.pages_written = 0


class DiskTier(DurableTier):
    """Segment files under ``root``; see the module docstring for the format and protocol."""

    name = "disk"

    def __init__(self, root: Path, *, fsync: bool = True, map_reads: bool = True) -> None:
        """``map_reads``: read runs of :data:`~dss.tiers.segment.MAP_BYTES` or more by mapping
        them (:func:`~dss.tiers.segment.mapped`) where the system can, else ``pread`` them."""
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
        self.io = IoCounts()
        self.inactive = InactiveSegments()
        """Segments the mover demoted: the first to leave when a write needs room."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-disk-io")
        self._pool_pid = os.getpid()
        self._buffers: list[bytearray] = [bytearray(), bytearray()]
        self._buffers_lock = threading.Lock()
        self.map_reads = map_reads
        """Whether large runs are mapped from the page cache."""

    def close(self) -> None:
        """Release the writer lock; the tier must not be used afterwards."""
        if self._lock_fd >= 0:
            os.unlink(self.locks_dir / f"{self.writer}.lock")
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._pool.shutdown(wait=True)

    # -- writing ---------------------------------------------------------------------------

    def write(
        self, pages: Iterable[tuple[PageId, int, Any, int]], *, publish: bool = True
    ) -> tuple[str, int, list[Located]]:
        """Publish ``(page_id, checksum, payload, flags)`` records as one new segment; see DurableTier.

        The records go out with one ``writev`` per :data:`~dss.tiers.segment.IO_PAGES` of them (no copy into a
        buffer), each issued by the helper thread while the next ones are taken from
        ``pages`` (which may be produced lazily: sealed as they are asked for) and written
        back to the disk right away, then one ``fsync`` of the file and one of the folder.
        ``publish=False`` skips the folder's fsync: the rename is durable only once
        :meth:`publish` ran (group commit fsyncs the folder once for a whole group), and
        until then a crash may lose the file, which nothing refers to yet.
        """
        name = f"{self.writer}-{next(self._counter):010d}.seg"
        self._in_flight.add(name)
        tmp = self.tmp_dir / name
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            offset, locations = self._write_records(fd, name, pages)
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

    def _write_records(
        self, fd: int, name: str, pages: Iterable[tuple[PageId, int, Any, int]]
    ) -> tuple[int, list[Located]]:
        """Write the header and the records of ``pages`` to ``fd``, each batch by the helper
        thread while the next is taken from ``pages``; returns the file's size and where each
        record lies. A failure waits for the batch in flight (the fd must outlive it)."""
        locations: list[Located] = []
        offset = HEADER_BYTES
        pending: Future[None] | None = None
        parts: list[Any] = [MAGIC]
        count = written = 0
        try:
            for page_id, checksum, payload, flags in pages:
                parts.append(RECORD.pack(page_id, len(payload), flags, checksum))
                parts.append(payload)
                length = RECORD.size + len(payload)
                locations.append(Located(name, offset, length))
                offset += length
                count += 1
                if count == (IO_PAGES if written else FIRST_IO_PAGES):
                    if pending is not None:
                        pending.result()
                    pending = self._io().submit(self._write_parts, fd, parts, count, written, offset - written)
                    parts, count, written = [], 0, offset
            if pending is not None:
                pending.result()
                pending = None
        except BaseException:
            if pending is not None:
                pending.exception()
            raise
        if parts:
            self._write_parts(fd, parts, count, written, offset - written)
        return offset, locations

    def _write_parts(self, fd: int, parts: list[Any], records: int, start: int, length: int) -> None:
        """Write ``parts`` (``length`` bytes from file offset ``start``) in order with ``writev``
        (again for what a short write left); with ``fsync``, start writing them back to the
        disk at once (``POSIX_FADV_DONTNEED``, which also keeps their bytes out of the page
        cache: the host tier has the pages), so the final ``fsync`` has little left to wait for."""
        self.io.writes += 1
        self.io.pages_written += records
        write_all(fd, parts)
        if self.fsync and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)

    def publish(self) -> None:
        """Make the renames of segments written with ``publish=False`` durable (fsync the folder)."""
        self._sync_dir(self.segments_dir)

    def remove(self, segments: Iterable[str]) -> None:
        """Delete segments (absent ones are ignored), then fsync the directory."""
        removed = False
        for name in segments:
            self._in_flight.discard(name)
            self.inactive.discard([name])
            try:
                (self.segments_dir / name).unlink()
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            self._sync_dir(self.segments_dir)

    # -- reading ---------------------------------------------------------------------------

    def read(
        self, requests: Sequence[ReadRequest], *, sealed_verified_by_caller: bool = False
    ) -> tuple[list[StoredPage | None], list[ReadFailure]]:
        """Verified records in request order; see DurableTier. Never raises for bad files."""
        out: list[StoredPage | None] = [None] * len(requests)
        failures: list[ReadFailure] = []
        for chunk in self.read_chunks(requests, sealed_verified_by_caller=sealed_verified_by_caller):
            for i, record in chunk.records:
                out[i] = record
            failures.extend(chunk.failures)
        return out, failures

    def read_chunks(
        self, requests: Sequence[ReadRequest], *, sealed_verified_by_caller: bool = False, transient: bool = False
    ) -> Iterator[Chunk]:
        """The records of ``requests``, one :class:`Chunk` per run read (each record in exactly
        one chunk), in file order. While the caller works on a chunk, a helper thread reads
        the next. Records that are missing, torn or corrupt are failures; so are records
        flagged sealed whose header is wrong, but their payloads are not hashed when
        ``sealed_verified_by_caller`` (the caller authenticates them). Never raises for bad files.

        ``transient``: the caller is done with a chunk's payloads when it asks for the next one
        (it copies or opens them), so the tier ``pread``s into two buffers it keeps and reuses
        rather than into fresh memory for every read (a mapped run needs neither)."""
        if not requests:
            return
        plan, failures, fds = self._plan(requests)
        buffers = self._buffers if transient and self._buffers_lock.acquire(blocking=False) else None
        pending: Future[memoryview | OSError] | None = None
        try:
            if failures:
                yield Chunk([], failures)
            if not plan:
                return

            def submit(k: int) -> Future[memoryview | OSError]:
                segment, start, end, _ = plan[k]
                if self.map_reads and end - start >= MAP_BYTES:
                    return self._io().submit(read_mapped, fds[segment], end - start, start)
                into = None
                if buffers is not None:
                    if len(buffers[k % 2]) < end - start:
                        buffers[k % 2] = bytearray(end - start)
                    into = buffers[k % 2]
                return self._io().submit(pread, fds[segment], end - start, start, into)

            pending = submit(0)
            for k, (_, start, _, run) in enumerate(plan):
                assert pending is not None  # submitted for every k
                data = pending.result()
                pending = submit(k + 1) if k + 1 < len(plan) else None
                self.io.reads += 1
                self.io.pages_read += len(run)
                yield chunk_of(data, start, run, requests, sealed_verified_by_caller)
        finally:
            if pending is not None:
                pending.exception()  # wait: the read in flight needs its file and buffer
            for fd in fds.values():
                os.close(fd)
            if buffers is not None:
                self._buffers_lock.release()

    def _io(self) -> ThreadPoolExecutor:
        """The helper thread's executor (a fresh one in a process forked from the one that made it)."""
        if self._pool_pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-disk-io")
            self._pool_pid = os.getpid()
            self._buffers_lock = threading.Lock()
        return self._pool

    def _plan(
        self, requests: Sequence[ReadRequest]
    ) -> tuple[list[tuple[str, int, int, list[int]]], list[ReadFailure], dict[str, int]]:
        """The preads to make ``(segment, start, end, request indices)``, the requests of
        segments that cannot be opened, and the open segments' file descriptors."""
        plan: list[tuple[str, int, int, list[int]]] = []
        failures: list[ReadFailure] = []
        fds: dict[str, int] = {}
        order = sorted(range(len(requests)), key=lambda i: (requests[i].segment, requests[i].offset))
        for segment, group in itertools.groupby(order, key=lambda i: requests[i].segment):
            indices = list(group)
            try:
                fds[segment] = os.open(self.segments_dir / segment, os.O_RDONLY)
            except OSError as exc:
                failures.extend(ReadFailure(i, f"segment {segment}: {exc.strerror}") for i in indices)
                continue
            for run in runs_of(indices, requests):
                start = requests[run[0]].offset
                plan.append((segment, start, max(requests[i].offset + requests[i].length for i in run), run))
        return plan, failures, fds

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
        gone = [
            name for name in self.files() if name.startswith(mine) and name not in recorded and name not in in_flight
        ]
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
