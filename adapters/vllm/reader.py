"""A child process that reads pages from disk for a worker's asynchronous loads.

Reading a page from disk verifies its checksum and decrypts it, work that holds Python's
GIL much of the time. Done by a thread of the worker process, it makes every torch call of
the running batch's forward pass wait for the GIL (measured: decode steps 4x slower while
an 8K-token prompt loads). So the loader thread hands the page ids to this process, which
has its own store handle (no host tier: it keeps nothing) and runs at a lower CPU priority,
and gets the payloads back through a pipe; the worker only copies them into the KV blocks.

Protocol on the child's stdin and stdout, every message a 4-byte little-endian length and a
pickle: the parent sends the store's ``dss.open`` arguments once, then a list of page ids
per read; the child answers each read with the list of payload lengths (``-1`` for a page
it could not read) followed by the payloads, concatenated, as raw bytes. The child exits
when its stdin closes (the worker is gone).
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

log = logging.getLogger("vllm.dss.reader")
_LENGTH = struct.Struct("<I")


class PageReader:
    """The parent's end: one child process, one read at a time (see the module docstring)."""

    def __init__(self, store: str, options: Mapping[str, Any]) -> None:
        self._args = (store, {**options, "host_bytes": 0})
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the child now (it takes a moment to import dss), rather than at the first read."""
        with self._lock:
            self._start()

    def read_pages(self, page_ids: Sequence[bytes]) -> list[memoryview | None]:
        """The payloads of the pages, ``None`` for those the store could not return. A child that
        died is started again; the pages of the read it died in count as not returned."""
        with self._lock:
            proc = self._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, list(page_ids))
                lengths: list[int] = _receive(proc.stdout)
                data = memoryview(bytearray(sum(n for n in lengths if n > 0)))
                _read_exactly(proc.stdout, data)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                log.error("the dss page reader process failed (%s); %d pages count as not read", exc, len(page_ids))
                self._stop()
                return [None] * len(page_ids)
        out: list[memoryview | None] = []
        offset = 0
        for length in lengths:
            if length < 0:
                out.append(None)
            else:
                out.append(data[offset : offset + length])
                offset += length
        return out

    def close(self) -> None:
        """Stop the child. Idempotent."""
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "dss_adapters.vllm.reader"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=os.environ.copy(),
            )
            assert self._proc.stdin is not None
            _send(self._proc.stdin, self._args)
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _send(stream: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _LENGTH.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the other end closed the pipe")
    return pickle.loads(body)


def _read_exactly(stream: IO[bytes], into: memoryview) -> None:
    done = 0
    while done < len(into):
        count = stream.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            raise EOFError("the other end closed the pipe")
        done += count


def main() -> None:
    """The child: serve reads until stdin closes."""
    from dss_adapters.vllm.jobs import any_cpu, lower_priority

    import dss
    from dss import DssError

    any_cpu()
    lower_priority()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the parent's pipe
    try:
        store_arg, options = _receive(stdin)
    except EOFError:
        return
    with dss.open(store_arg, **options) as store:
        while True:
            try:
                page_ids = _receive(stdin)
            except EOFError:
                return
            try:
                payloads = store.read_pages(page_ids)
            except DssError as exc:
                log.error("reading %d dss pages failed: %s", len(page_ids), exc)
                payloads = [None] * len(page_ids)
            _send(stdout, [len(p) if p is not None else -1 for p in payloads])
            for payload in payloads:
                if payload is not None:
                    stdout.write(payload)
            stdout.flush()


if __name__ == "__main__":
    main()
