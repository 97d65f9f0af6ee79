"""Loading pages into KV blocks: one load job's work, and the thread that does asynchronous ones.

:func:`load_pages` reads one shard's pages of a job from the store and copies those it got
into their blocks; a page the store cannot return (gone, or corrupt and quarantined) is
reported, never copied. Pages no KV cache group needs (outside every sliding window) are
not read.

:class:`PageLoader` runs asynchronous jobs in a background thread, one at a time in the
order they came; it reads the pages through a :class:`PageReader` child process, so that the
checksum and decryption work never competes for the GIL with the forward pass. The blocks it writes belong to requests vLLM keeps waiting
(``WAITING_FOR_REMOTE_KVS``) until the job is reported done, so the running batch never
reads them; vLLM also keeps the blocks of a request aborted meanwhile until then. A job is
done when its copies are: on CUDA they run asynchronously from pinned staging buffers
(:meth:`BlockCopier.start_scatter`), so the thread reads the next job's pages while they
move, and the job is reported once their CUDA event completed; elsewhere at once. A page a
tier keeps at a lower precision is loaded where the copier dequantizes it
(:attr:`BlockCopier.decodes`: pages of vLLM's CPU backend, read unstaged), and counted in
the outcome's ``lossy_pages``; elsewhere it is a miss that vLLM recomputes. A
failure that is not a ``DssError`` is a bug: it stops the thread and is raised again in the
engine's thread by the next :meth:`PageLoader.put` or :meth:`PageLoader.take_done`
(:mod:`dss_adapters.vllm.jobs`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from dss_adapters.staging import DONE, Transfer
from dss_adapters.vllm.copy import BlockCopier, RowBuffer, RowFeed
from dss_adapters.vllm.jobs import JobThread
from dss_adapters.vllm.meta import NO_BLOCK, LoadJob
from dss_adapters.vllm.reader import PageReader

import dss
from dss import DssError

log = logging.getLogger("vllm.dss.loader")


@dataclass(slots=True)
class LoadOutcome:
    """What one load job did on this worker."""

    req_id: str
    failed_pages: list[int] = field(default_factory=list)
    """Indexes (in the job) of pages that could not be loaded."""
    loaded_page_ids: list[bytes] = field(default_factory=list)
    seconds: float = 0.0
    lossy_pages: dict[int, str] = field(default_factory=dict)
    """Indexes (in the job) of pages loaded from a lower-precision copy, and its encoding."""


class PageSource(Protocol):
    """Where payloads come from: a ``dss.Store`` or a :class:`PageReader` process; with ``into``
    (a ``dss.Store`` only: staged loads run in the worker's own process) each payload lands in
    its buffer, and ``ready`` hears which have (``Store.read_pages``)."""

    def read_pages(
        self,
        pages: Sequence[bytes],
        *,
        into: Sequence[memoryview] | None = None,
        ready: Callable[[list[int]], object] | None = None,
    ) -> Sequence[Any]: ...


def read_pages(
    store: PageSource,
    page_ids: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    req_id: str,
    layout: dss.Layout | None = None,
) -> tuple[list[int], list[bytes | memoryview], LoadOutcome]:
    """Read the pages some KV cache group needs: (their indexes, their payloads, the outcome so
    far: failed pages, loaded ids, lossy pages). A ``DssError`` from the store fails every page
    (logged). ``layout``: the layout whose encoded copies the caller dequantizes (``None``:
    none; a page that is not exact is then a miss, :func:`loadable`)."""
    start = time.perf_counter()
    needed = _needed(block_ids, len(page_ids))
    payloads = loadable(_read(store, [page_ids[k] for k in needed], req_id, None), layout)
    outcome = _outcome(req_id, page_ids, needed, payloads, start)
    if layout is not None:
        outcome.lossy_pages = {
            needed[i]: dss.page_encoding(p)
            for i, p in enumerate(payloads)
            if p is not None and len(p) != layout.page_bytes
        }
    rows = [needed[i] for i, payload in enumerate(payloads) if payload is not None]
    return rows, [payload for payload in payloads if payload is not None], outcome


def read_staged(
    store: PageSource, staging: RowBuffer, page_ids: Sequence[bytes], block_ids: Sequence[Sequence[int]], req_id: str
) -> tuple[np.ndarray, list[list[int]], LoadOutcome]:
    """:func:`read_pages` into the rows of ``staging`` (the store decrypts straight into them):
    (the rows of the pages read, each group's blocks for those rows, the outcome so far)."""
    start = time.perf_counter()
    needed = _needed(block_ids, len(page_ids))
    rows = staging.rows(len(needed))
    payloads = loadable(_read(store, [page_ids[k] for k in needed], req_id, [memoryview(row) for row in rows]), None)
    outcome = _outcome(req_id, page_ids, needed, payloads, start)
    got = [i for i, payload in enumerate(payloads) if payload is not None]
    blocks = [[group[needed[i]] for i in got] for group in block_ids]
    return (rows if len(got) == len(needed) else rows[got]), blocks, outcome


def load_fed(
    store: PageSource,
    feed: RowFeed,
    page_ids: Sequence[bytes],
    needed: list[int],
    req_id: str,
) -> LoadOutcome:
    """Read the pages ``page_ids[needed[i]]`` into the feed's rows ``i``, each batch copied into
    its blocks while the next is read (:class:`~dss_adapters.vllm.copy.RowFeed`); the copies
    are complete when it returns. When the read fails after some batches were copied (a
    ``DssError``), every page counts as failed: vLLM recomputes their blocks over the copies."""
    start = time.perf_counter()
    views = [memoryview(row) for row in feed.rows]
    try:
        payloads = loadable(_read(store, [page_ids[k] for k in needed], req_id, views, feed.ready), None)
    finally:
        feed.finish()
    return _outcome(req_id, page_ids, needed, payloads, start)


def _needed(block_ids: Sequence[Sequence[int]], count: int) -> list[int]:
    """The pages some KV cache group has a block for."""
    return [k for k in range(count) if any(group[k] != NO_BLOCK for group in block_ids)]


def _read(
    store: PageSource,
    page_ids: list[bytes],
    req_id: str,
    into: list[memoryview] | None,
    ready: Callable[[list[int]], object] | None = None,
) -> Sequence[bytes | memoryview | None]:
    """The store's payloads (into ``into`` if given, telling ``ready``); every page fails on a
    ``DssError`` (logged)."""
    try:
        if into is None:
            return store.read_pages(page_ids)
        return (
            store.read_pages(page_ids, into=into)
            if ready is None
            else store.read_pages(page_ids, into=into, ready=ready)
        )
    except DssError as exc:
        log.error("reading %d dss pages of request %s failed: %s", len(page_ids), req_id, exc)
        return [None] * len(page_ids)


def _outcome(
    req_id: str, page_ids: Sequence[bytes], needed: list[int], payloads: Sequence[object], start: float
) -> LoadOutcome:
    """The outcome of a read: failed pages (logged), loaded ids, seconds since ``start``."""
    outcome = LoadOutcome(req_id)
    outcome.failed_pages = [needed[i] for i, payload in enumerate(payloads) if payload is None]
    if outcome.failed_pages:
        log.warning(
            "%d of %d dss pages of request %s could not be read; vLLM recomputes them",
            len(outcome.failed_pages),
            len(needed),
            req_id,
        )
    outcome.loaded_page_ids = [page_ids[needed[i]] for i, payload in enumerate(payloads) if payload is not None]
    outcome.seconds = time.perf_counter() - start
    return outcome


def loadable(
    payloads: Sequence[bytes | memoryview | None], layout: dss.Layout | None
) -> list[bytes | memoryview | None]:
    """The payloads, a page that can be copied neither as it is nor dequantized made a miss
    (vLLM recomputes it, never loads wrong KV): with ``layout`` (its pages are encodable,
    :data:`~dss_adapters.vllm.formats.CPU_PAGE_FORMAT`, and the copier dequantizes them) an
    encoded copy of one of its pages is kept (a payload of another size than the layout's pages:
    no encoded copy ever has it); without, only exact pages are (``dss.page_encoding``)."""
    if layout is None:
        return [p if p is None or dss.page_encoding(p) == "exact" else None for p in payloads]
    out: list[bytes | memoryview | None] = []
    for payload in payloads:
        if payload is not None and len(payload) != layout.page_bytes:
            try:
                dss.page_views(payload, layout)
            except dss.InvalidPage:
                payload = None
        out.append(payload)
    return out


def load_pages(
    store: PageSource,
    copier: BlockCopier,
    page_ids: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    req_id: str,
    staging: RowBuffer | None = None,
) -> LoadOutcome:
    """Copy the pages ``page_ids[k]`` into the blocks ``block_ids[group][k]`` (see the module
    docstring), read through ``staging`` if given; the copies are complete when it returns.
    For a load the engine waits for: the copies of pages that are not staged are shared with a
    second thread (:meth:`BlockCopier.scatter_split`)."""
    outcome, transfer = start_load_pages(store, copier, page_ids, block_ids, req_id, staging, split=True)
    transfer.wait()
    return outcome


def start_load_pages(
    store: PageSource,
    copier: BlockCopier,
    page_ids: Sequence[bytes],
    block_ids: Sequence[Sequence[int]],
    req_id: str,
    staging: RowBuffer | None = None,
    *,
    split: bool = False,
) -> tuple[LoadOutcome, Transfer]:
    """:func:`load_pages`, returning once the copies are queued, with their transfer. With
    ``staging`` the pages are read into its rows and copied in: on the CPU each batch the store
    reports read while it reads the next (:func:`load_fed`), elsewhere all of them at once
    (:meth:`BlockCopier.scatter_rows`). ``split``: see :func:`load_pages` (for pages not
    staged)."""
    start = time.perf_counter()
    transfer = DONE
    if staging is not None:
        needed = _needed(block_ids, len(page_ids))
        rows = staging.rows(len(needed))
        feed = copier.feed(rows, [[group[k] for k in needed] for group in block_ids])
        if feed is not None:
            outcome = load_fed(store, feed, page_ids, needed, req_id)
            outcome.seconds = time.perf_counter() - start
            return outcome, DONE
        staged, blocks, outcome = read_staged(store, staging, page_ids, block_ids, req_id)
        if len(staged):
            transfer = copier.scatter_rows(staged, blocks)
        outcome.seconds = time.perf_counter() - start
        return outcome, transfer
    rows, payloads, outcome = read_pages(store, page_ids, block_ids, req_id, copier.decodes)
    if rows:
        scatter = copier.scatter_split if split else copier.start_scatter
        transfer = scatter(payloads, [[group[k] for k in rows] for group in block_ids])
    outcome.seconds = time.perf_counter() - start
    return outcome, transfer


class PageLoader(JobThread[LoadJob, tuple[LoadOutcome, Transfer]]):
    """One thread doing asynchronous load jobs for one worker, reading through a
    :class:`PageReader` process (see the module docstring), at a lower CPU priority."""

    background = True

    def __init__(self, reader: PageReader, copier: BlockCopier, shard: int) -> None:
        self.reader = reader
        self.copier = copier
        self.shard = shard
        self._done: list[tuple[LoadJob, LoadOutcome]] = []
        self._copying: list[tuple[LoadJob, LoadOutcome, Transfer]] = []
        """Jobs whose pages were read and whose copies are queued, oldest first."""
        reader.start()
        super().__init__("dss-page-loader")

    def close(self) -> None:
        """Finish the queued jobs and their copies, then stop the thread and the reader."""
        super().close()
        for _, _, transfer in self._copying:
            transfer.wait()
        self.reader.close()

    def wait_idle(self) -> None:
        """Wait until every job put so far has finished, its copies included."""
        super().wait_idle()
        with self._cond:
            copying = list(self._copying)
        for _, _, transfer in copying:
            transfer.wait()

    def take_done(self) -> list[tuple[LoadJob, LoadOutcome]]:
        """Jobs finished (copies complete) since the last call, in the order they finished."""
        with self._cond:
            self._check()
            self._reap()
            done, self._done = self._done, []
            return done

    def wait_done(self, timeout: float) -> None:
        """Wait until a job has finished since the last :meth:`take_done`, no job is queued or
        copying, or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(
                lambda: self._done or self._copying or not self._jobs or self._error is not None, timeout
            )
            self._reap()
            oldest = self._copying[0][2] if self._copying and not self._done else None
        if oldest is not None:
            oldest.wait(max(0.0, deadline - time.monotonic()))

    def _reap(self) -> None:
        """Move the jobs whose copies are complete to the done list (under the lock). The copies
        run on one stream, so they complete in the order they were queued."""
        while self._copying and self._copying[0][2].is_done():
            job, outcome, _ = self._copying.pop(0)
            self._done.append((job, outcome))

    def _do(self, job: LoadJob) -> tuple[LoadOutcome, Transfer]:
        if job.fail:
            return LoadOutcome(job.req_id, failed_pages=list(range(len(job.page_ids[self.shard])))), DONE
        # not staged: a mixed batch measured its decode steps slower while a staged load copied
        # (4.5x against 0.86x per page, one run each on a shared machine); kept as it was until
        # measured again
        return start_load_pages(self.reader, self.copier, job.page_ids[self.shard], job.block_ids, job.req_id)

    def _finish(self, job: LoadJob, result: tuple[LoadOutcome, Transfer]) -> None:
        outcome, transfer = result
        self._copying.append((job, outcome, transfer))
        self._reap()
