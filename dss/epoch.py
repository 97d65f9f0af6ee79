"""The epoch file: a shared 8-byte counter that tells processes the catalog changed.

After each write transaction commits, its writer stores the transaction's sequence number
here; a reader compares the value with the one it saw last, and only when it differs asks
the catalog what changed. Reading costs a memory load, so ``resume`` can check it every
time. The value may go backwards when writers race; any difference triggers a catch-up,
which is all that matters. Format ``dss-epoch v1``: 8-byte tag, then a little-endian u64.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

TAG = b"dssep v1"
_VALUE = struct.Struct("<Q")


class Epoch:
    """A memory-mapped counter shared by every process that opens the same store folder."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            if os.fstat(fd).st_size < 16:
                os.pwrite(fd, TAG + bytes(8), 0)
            self._map = mmap.mmap(fd, 16)
        finally:
            os.close(fd)
        if self._map[:8] != TAG:
            raise ValueError(f"{path} is not a dss epoch file")

    def read(self) -> int:
        return _VALUE.unpack_from(self._map, 8)[0]

    def publish(self, seq: int) -> None:
        _VALUE.pack_into(self._map, 8, seq)

    def close(self) -> None:
        self._map.close()
