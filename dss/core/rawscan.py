"""The raw-byte scan of an erasure: are sampled page ids anywhere in the catalog's files?

A process must never open the SQLite catalog's files itself: closing such a file drops
every POSIX lock the process holds on it, SQLite's included, and another process may then
checkpoint and delete the WAL under a live connection (its later commits would go to a
deleted file). So :func:`scan` runs this module as a short-lived child process
(``python -I rawscan.py``, standard library only), which reads the files and exits; its
opens and closes cannot touch the parent's locks.

The scan never holds a page id. A :func:`needle` keeps a page id's first
:data:`PREFIX_BYTES` bytes and its SHA-256 digest; the child finds candidate offsets by the
prefix, in binary and in hex (lower and upper case), and confirms a candidate by hashing the
id-sized window there. Protocol: stdin one JSON object ``{"files": [path, ...], "needles":
[{"prefix": hex, "sha256": hex}, ...]}``; stdout one JSON object ``{"found": {path: n}}``,
``n`` the number of distinct needles found in that file (absent files are skipped).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ID_BYTES = 16
"""The length of a page id."""
PREFIX_BYTES = 4
"""How much of an id a needle keeps, to find candidates (the rest is known only by digest)."""
CHUNK_BYTES = 1 << 24
SCAN_TIMEOUT_S = 3600.0

Needle = dict[str, str]


class ScanFailed(RuntimeError):
    """The scanner could not run or did not finish; nothing is known about the files."""


def needle(page_id: bytes) -> Needle:
    """What the erasure keeps of a sampled page id: its prefix and its SHA-256, both hex."""
    return {"prefix": page_id[:PREFIX_BYTES].hex(), "sha256": hashlib.sha256(page_id).hexdigest()}


def scan(files: Sequence[str], needles: Sequence[Needle]) -> dict[str, int]:
    """Distinct needles found per file, read by a child process; raises :class:`ScanFailed`."""
    request = json.dumps({"files": list(files), "needles": list(needles)})
    try:
        done = subprocess.run(
            [sys.executable, "-I", str(Path(__file__).resolve())],
            input=request,
            capture_output=True,
            text=True,
            timeout=SCAN_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ScanFailed(f"the raw-byte scanner did not run: {exc}") from None
    if done.returncode != 0:
        raise ScanFailed(f"the raw-byte scanner failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    try:
        return {str(k): int(v) for k, v in json.loads(done.stdout)["found"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ScanFailed(f"the raw-byte scanner answered {done.stdout[:200]!r}: {exc}") from None


def found_in(path: str, needles: Iterable[Needle]) -> int:
    """Distinct needles in the file at ``path``, binary or hex: the child's work (a process with
    the store open must never run this on a catalog file)."""
    forms: dict[bytes, list[tuple[int, bytes]]] = {}  # prefix form -> (window size, digest) candidates
    for n in needles:
        prefix, digest = bytes.fromhex(n["prefix"]), bytes.fromhex(n["sha256"])
        forms.setdefault(prefix, []).append((ID_BYTES, digest))
        for text in {prefix.hex(), prefix.hex().upper()}:
            forms.setdefault(text.encode(), []).append((2 * ID_BYTES, digest))
    overlap = 2 * ID_BYTES - 1
    hits: set[bytes] = set()
    with open(path, "rb") as f:
        data = b""
        while True:
            block = f.read(CHUNK_BYTES)
            data = data[-overlap:] + block if data else block
            for form, candidates in forms.items():
                at = data.find(form)
                while at >= 0:
                    for size, digest in candidates:
                        hits.update(_confirm(data[at : at + size], size, digest))
                    at = data.find(form, at + 1)
            if not block:
                return len(hits)


def _confirm(window: bytes, size: int, digest: bytes) -> list[bytes]:
    """``[digest]`` if ``window`` is the id (binary when ``size`` is an id's length, else hex)."""
    if len(window) < size:
        return []
    if size != ID_BYTES:
        try:
            window = bytes.fromhex(window.decode("ascii"))
        except ValueError:
            return []
    return [digest] if hashlib.sha256(window).digest() == digest else []


def main() -> None:
    request = json.loads(sys.stdin.read())
    found = {}
    for path in request["files"]:
        try:
            found[path] = found_in(path, request["needles"])
        except FileNotFoundError:
            continue
    print(json.dumps({"found": found}))


if __name__ == "__main__":
    main()
