"""The segment file format ``dss-segment v1`` and its I/O: records, one ``writev``, coalesced runs
read with ``pread`` or mapped from the page cache, and the check of each record read back (see
:mod:`dss.tiers.disk`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dss.core.hashing import checksum as page_checksum
from dss.tiers.base import ReadFailure, ReadRequest, StoredPage

MAGIC = b"dss-segment v1\n".ljust(32, b"\0")
RECORD = struct.Struct("<16sIIq")
HEADER_BYTES = len(MAGIC)
COALESCE_GAP = 256 << 10
"""Records closer than this are read with one ``pread``."""
IO_PAGES = 16
"""Records per ``writev`` and (at most, unless they are small) per ``pread``."""
FIRST_IO_PAGES = IO_PAGES // 2
"""Records of a segment's first ``writev``: fewer, so the disk starts sooner while the records
after them are still being produced (sealed); see :meth:`DiskTier.write`."""
IO_BYTES = 4 << 20
"""A ``pread`` of small records may hold more than :data:`IO_PAGES` of them, up to this many bytes."""
SEALED_FLAG = 1
"""Record flag bit 0: the payload is sealed (authenticated by its reader)."""


class Chunk(NamedTuple):
    """What one ``pread`` yielded: ``(request index, record)`` of the good records, and the failures."""

    records: list[tuple[int, StoredPage]]
    failures: list[ReadFailure]


def write_all(fd: int, parts: list[Any]) -> None:
    """Write every byte of ``parts`` in order (``writev``, again after a short write)."""
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= len(parts[0]):
            written -= len(parts[0])
            parts = parts[1:]
        if parts and written:
            parts = [memoryview(parts[0])[written:], *parts[1:]]


def pread(fd: int, size: int, offset: int, into: bytearray | None = None) -> memoryview | OSError:
    """``size`` bytes at ``offset`` (fewer at the end of the file), into ``into`` if given."""
    try:
        if into is None:
            return memoryview(os.pread(fd, size, offset))
        view = memoryview(into)[:size]
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return view[:got]
    except OSError as exc:
        return exc


MAP_BYTES = 1 << 20
"""Runs of at least this many bytes are mapped from the OS page cache (:func:`mapped`) rather
than copied out of it with ``pread``, where the system can."""
MADV_POPULATE_READ = 22
"""Linux's ``madvise`` advice (5.14 and later) that faults a mapping's pages in and reports an
error where touching one would raise ``SIGBUS`` (an I/O error, a page past the end of the file)."""


def _address(region: mmap.mmap) -> int:
    """Where a mapping starts in memory (a read-only one too, which ctypes cannot take)."""
    return int(np.frombuffer(region, dtype=np.uint8).ctypes.data)


def _madvise() -> Any:
    """libc's ``madvise`` through ctypes (which lets go of the GIL while it runs), where it takes
    :data:`MADV_POPULATE_READ`; else ``None`` (not Linux, a kernel before 5.14)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
        probe = mmap.mmap(-1, mmap.PAGESIZE)
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    try:
        works = call(_address(probe), mmap.PAGESIZE, MADV_POPULATE_READ) == 0
    finally:
        probe.close()
    return call if works else None


_MADVISE = _madvise()


def mapped(fd: int, size: int, offset: int) -> memoryview | None:
    """``size`` bytes at ``offset`` (fewer at the end of the file) as a read-only view of the
    file's pages in the OS page cache: no copy (a ``pread`` copies every byte once more). The
    pages are faulted in here, with the GIL free, so a helper thread can do it as it would
    :func:`pread`; those not cached yet are asked for first in one read-ahead (faults alone
    read them a little at a time: a cold 4K-token load in vLLM took 71 ms, against 48).

    The mapping lives as long as a view of it does, and segments are never changed or
    truncated once published, so the view stays readable. ``None`` where the run cannot be
    mapped so — the system cannot (not Linux, a kernel before 5.14), the file system refuses, or
    a page cannot be faulted in (an I/O error, which touching it would raise as ``SIGBUS``): the
    caller preads it, and a read that fails fails there, as it always did. (A page the kernel
    drops and then fails to read again, in the moments between, would still raise ``SIGBUS``.)"""
    if _MADVISE is None:
        return None
    try:
        end = min(offset + size, os.fstat(fd).st_size)
        if end <= offset:
            return None
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        with contextlib.suppress(OSError):  # advice only
            os.posix_fadvise(fd, offset, end - offset, os.POSIX_FADV_WILLNEED)
        region = mmap.mmap(fd, end - base, prot=mmap.PROT_READ, offset=base)
    except OSError:
        return None
    address = _address(region)
    while _MADVISE(address, end - base, MADV_POPULATE_READ) != 0:
        if ctypes.get_errno() != errno.EINTR:
            region.close()
            return None
    return memoryview(region)[offset - base :]


def read_mapped(fd: int, size: int, offset: int) -> memoryview | OSError:
    """:func:`mapped`, else :func:`pread`."""
    view = mapped(fd, size, offset)
    return pread(fd, size, offset) if view is None else view


def runs_of(indices: list[int], requests: Sequence[ReadRequest]) -> list[list[int]]:
    """Split offset-sorted request indices into runs read at once (one ``pread`` or mapping): records
    close together, at most :data:`IO_PAGES` of them unless the run is under :data:`IO_BYTES`."""
    runs: list[list[int]] = []
    start = end = -1
    for i in indices:
        req = requests[i]
        grown = max(end, req.offset + req.length) - start
        if runs and req.offset <= end + COALESCE_GAP and (len(runs[-1]) < IO_PAGES or grown <= IO_BYTES):
            runs[-1].append(i)
            end = max(end, req.offset + req.length)
        else:
            runs.append([i])
            start, end = req.offset, req.offset + req.length
    return runs


def verify_record(record: memoryview, req: ReadRequest, sealed_verified_by_caller: bool = False) -> str | None:
    """Why a record read back is not the page the request expects (``None``: it is)."""
    if len(record) < req.length:
        return f"record at {req.segment}:{req.offset} is truncated"
    page_id, size, flags, stored = RECORD.unpack_from(record)
    if page_id != req.page_id:
        return f"record at {req.segment}:{req.offset} holds another page"
    if size != req.length - RECORD.size or stored != req.checksum:
        return f"record at {req.segment}:{req.offset} has a corrupt header"
    if sealed_verified_by_caller and flags & SEALED_FLAG:
        return None
    if page_checksum(record[RECORD.size :]) != req.checksum:
        return f"record at {req.segment}:{req.offset} fails its checksum"
    return None


def chunk_of(
    data: memoryview | OSError,
    start: int,
    run: list[int],
    requests: Sequence[ReadRequest],
    sealed_verified_by_caller: bool,
) -> Chunk:
    """The :class:`Chunk` of the records ``requests[i]`` for ``i`` in ``run``, read as ``data``
    (the file's bytes from ``start``, or the error that read raised), each checked
    (:func:`verify_record`)."""
    if isinstance(data, OSError):
        return Chunk([], [ReadFailure(i, f"read failed: {data.strerror}") for i in run])
    records: list[tuple[int, StoredPage]] = []
    failures: list[ReadFailure] = []
    for i in run:
        req = requests[i]
        record = data[req.offset - start : req.offset - start + req.length]
        problem = verify_record(record, req, sealed_verified_by_caller)
        if problem:
            failures.append(ReadFailure(i, problem))
        else:
            records.append((i, StoredPage(record[RECORD.size :], RECORD.unpack_from(record)[2])))
    return Chunk(records, failures)
