"""Cold reads for the benchmarks: make the kernel forget the cached pages of files."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def drop(files: Iterable[Path]) -> None:
    """Write each file's dirty pages back, then drop its pages from the page cache."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
