"""Host buffers that pages pass through on their way into an engine's KV tensors.

Pages come out of the store as host bytes; a KV tensor may sit in GPU memory. A
:class:`StagingPool` serves both cases with one code path:

* :meth:`StagingPool.stage` copies the pages' bytes into a buffer taken from the pool,
  split into *parts* (one per layer, say): part ``j`` of every page lies contiguous in the
  buffer, so it moves to the device in one copy. On CUDA the buffers are pinned
  (page-locked) host memory, which the GPU reads by DMA without the CPU; elsewhere they
  are plain memory.
* :meth:`StagingPool.copy` runs the caller's copies out of the staged buffer: on CUDA on
  the pool's own stream, host-to-device with ``non_blocking=True`` (they return at once
  and overlap whatever the caller does next), ending with a CUDA event; elsewhere at
  once, synchronously. It returns a :class:`Transfer`.
* :meth:`Transfer.is_done` / :meth:`Transfer.wait` tell when the copies are complete (the
  event completed; on the CPU always). Only then does the buffer go back to the pool, so
  a buffer is never refilled while the GPU still reads it.

Buffers are reused (allocating pinned memory is slow: it maps and locks every page) and
grow to the largest batch seen; the pool holds at most ``max_buffers`` of them, and a
:meth:`StagingPool.stage` that finds them all in flight waits for the oldest.

This module is shared by the vLLM connector (:mod:`dss_adapters.vllm.copy`, whose
asynchronous loads count as finished when their transfer is done) and the transformers
adapter (:mod:`dss_adapters.transformers.cache`). The CUDA branch has not run on a GPU in
this repository's CI (it has none); ``tests/adapters/test_staging.py`` runs it when CUDA is present.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import numpy as np
import torch

from dss import ConfigError, InvalidInput

POLL_S = 0.0005
"""How often :meth:`Transfer.wait` with a timeout looks at its event."""


class Staged:
    """Pages staged in one buffer of the pool: ``parts[j]`` is a ``[num_pages, size_j]`` uint8
    host tensor, row ``k`` holding bytes ``[offset_j, offset_j + size_j)`` of page ``k``."""

    __slots__ = ("buffer", "num_pages", "parts")

    def __init__(self, buffer: torch.Tensor, num_pages: int, parts: list[torch.Tensor]) -> None:
        self.buffer = buffer
        self.num_pages = num_pages
        self.parts = parts


class Transfer:
    """Copies out of one staged buffer, started by :meth:`StagingPool.copy`."""

    __slots__ = ("_buffer", "_event", "_pool")

    def __init__(self, pool: StagingPool | None, buffer: torch.Tensor | None, event: torch.cuda.Event | None) -> None:
        self._pool = pool
        self._buffer = buffer
        self._event = event

    def is_done(self) -> bool:
        """Whether the copies are complete (their event completed; on the CPU, always). Does not wait."""
        event = self._event
        if event is not None and not event.query():
            return False
        self._release()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the copies are complete, at most ``timeout`` seconds (``None``: no limit);
        whether they are."""
        event = self._event
        if event is None:
            return self.is_done()
        if timeout is None:
            event.synchronize()
            return self.is_done()
        deadline = time.monotonic() + timeout
        while not self.is_done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _release(self) -> None:
        pool = self._pool
        if pool is not None:
            pool._finished(self)


DONE = Transfer(None, None, None)
"""A transfer that was complete when it was made (copies done synchronously)."""


class StagingPool:
    """Staging buffers for copies into tensors on ``device`` (see the module docstring). Thread-safe."""

    def __init__(self, device: torch.device | str, *, max_buffers: int = 2) -> None:
        if type(max_buffers) is not int or max_buffers < 1:
            raise ConfigError(f"a staging pool needs at least one buffer, not max_buffers={max_buffers!r}")
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self.max_buffers = max_buffers
        self._free: list[torch.Tensor] = []
        self._num_buffers = 0
        self._in_flight: list[Transfer] = []
        """Transfers whose buffer is not back yet, oldest first."""
        self._lock = threading.Condition()
        """Guards the lists; notified when a buffer comes back."""

    def stage(self, payloads: Sequence[bytes | memoryview | np.ndarray], parts: Sequence[tuple[int, int]]) -> Staged:
        """Copy ``payloads`` (pages of equal length) into a buffer of the pool, split into
        ``parts`` (``(offset, size)`` byte ranges of a page; see :class:`Staged`). Waits for the
        oldest transfer when every buffer is in flight. ``InvalidInput`` when a payload is too
        short for the parts."""
        staged = self.reserve(len(payloads), [size for _, size in parts])
        end = max((offset + size for offset, size in parts), default=0)
        views = [t.numpy() for t in staged.parts]
        for k, payload in enumerate(payloads):
            source = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload
            if source.size < end:
                self._give_back(staged.buffer)
                raise InvalidInput(f"page {k} has {source.size} bytes; the parts need {end}")
            for view, (offset, size) in zip(views, parts):
                view[k] = source[offset : offset + size]
        return staged

    def reserve(self, num_pages: int, sizes: Sequence[int]) -> Staged:
        """A buffer of the pool split into parts of ``sizes[j]`` bytes per page (see
        :class:`Staged`), its contents unspecified: the caller fills it (a conversion on the way
        in, say: it may order a part's bytes as its copy needs), then passes it to :meth:`copy`.
        Waits for the oldest transfer when every buffer is in flight."""
        buffer = self._take(num_pages * sum(sizes))
        tensors, at = [], 0
        for size in sizes:  # torch views of the buffer itself: pinned on CUDA, as the copies need
            tensors.append(buffer[at : at + num_pages * size].view(num_pages, size))
            at += num_pages * size
        return Staged(buffer, num_pages, tensors)

    def copy(self, staged: Staged, work: Callable[[Staged], None]) -> Transfer:
        """Run ``work(staged)`` — the caller's copies out of ``staged.parts`` into tensors on the
        device, typically ``part.to(device, non_blocking=True)`` and an ``index_copy_`` — on the
        pool's stream (CUDA; ``work`` returns once they are queued) or at once (elsewhere), and
        return their :class:`Transfer`. The buffer goes back to the pool when it is done (if
        ``work`` raises: once what it queued before the error is done, then the error propagates)."""
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                work(staged)
        except BaseException:
            if self.stream is not None:
                self.stream.synchronize()  # what was queued before the error still reads the buffer
            self._give_back(staged.buffer)
            raise
        if self.stream is None:
            self._give_back(staged.buffer)
            return DONE
        event = torch.cuda.Event()
        event.record(self.stream)
        transfer = Transfer(self, staged.buffer, event)
        with self._lock:
            self._in_flight.append(transfer)
        return transfer

    def wait_all(self) -> None:
        """Wait for every transfer in flight (before the tensors they write are read or freed)."""
        with self._lock:
            pending = list(self._in_flight)
        for transfer in pending:
            transfer.wait()

    @property
    def num_buffers(self) -> int:
        """Buffers the pool holds (free or in flight)."""
        return self._num_buffers

    # -- internals -------------------------------------------------------------------------

    def _take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes``: a free one if one is large enough, else a new one
        (replacing a free one that is too small when the pool is full), else — every buffer
        in flight — the oldest one's once its transfer is done."""
        while True:
            with self._lock:
                fits = [b for b in self._free if b.numel() >= nbytes]
                if fits:
                    buffer = min(fits, key=torch.Tensor.numel)
                    self._free.remove(buffer)
                    return buffer[:nbytes]
                if self._num_buffers < self.max_buffers:
                    self._num_buffers += 1
                    break
                if self._free:
                    self._free.pop(0)
                    break
                if not self._in_flight:  # every buffer staged by another thread, not yet copied
                    self._lock.wait()
                    continue
                oldest = self._in_flight[0]
            oldest.wait()
        try:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.is_cuda)[:nbytes]
        except BaseException:
            with self._lock:
                self._num_buffers -= 1
            raise

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer._base if buffer._base is not None else buffer)
            self._lock.notify_all()

    def _finished(self, transfer: Transfer) -> None:
        """A transfer is done: its buffer is free again (once, whichever thread saw it first)."""
        with self._lock:
            if transfer not in self._in_flight:
                return
            self._in_flight.remove(transfer)
            buffer = transfer._buffer
            assert buffer is not None
            self._free.append(buffer._base if buffer._base is not None else buffer)
            self._lock.notify_all()
            transfer._pool = transfer._buffer = transfer._event = None
