"""The epoch file: a shared 8-byte counter that tells processes the catalog changed.

After each write transaction commits, its writer raises the value to the transaction's
sequence number (under an ``flock``, so the value only grows); a reader compares the value
with the one it saw last, and only when it differs asks the catalog what changed. Reading
costs a memory load, so ``resume`` can check it every time. Format ``dss-epoch v1``: an
8-byte tag, then a little-endian u64.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

TAG = b"dssep v1"
_VALUE = struct.Struct("<Q")


class Epoch:
    """A memory-mapped counter shared by every process that opens the same store folder."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        if os.fstat(self._fd).st_size < 16:
            os.pwrite(self._fd, TAG + bytes(8), 0)
        self._map = mmap.mmap(self._fd, 16)
        if self._map[:8] != TAG:
            raise ValueError(f"{path} is not a dss epoch file")

    def read(self) -> int:
        return _VALUE.unpack_from(self._map, 8)[0]

    def publish(self, seq: int) -> int:
        """Raise the value to ``seq`` (never lower it); return the value now stored."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            current = self.read()
            if seq > current:
                _VALUE.pack_into(self._map, 8, seq)
                return seq
            return current
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
