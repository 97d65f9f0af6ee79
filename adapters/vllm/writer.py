"""A background writer of pages for the worker side: copies leave the KV cache at once, the
store writes them (and fsyncs) off the engine's critical path.

Jobs are written in the order they were put, one at a time, so a request's pages reach
the store in prompt order. :meth:`PageWriter.take_done` tells the engine which jobs have
finished (written, or failed with a logged ``DssError``), how long each took from the copy
to the store, and (with ``report_pages``) the ids of the pages written, which are in this
process's host tier now; a failure that is not a ``DssError`` is a bug: it stops the
writer and is raised again in the engine's thread by the next :meth:`PageWriter.put` or
:meth:`PageWriter.raise_if_failed`.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import dataclass, field

import numpy as np
from dss_adapters.vllm.jobs import JobThread
from dss_adapters.vllm.settings import Scope

import dss
from dss import DssError, SessionExists, UnknownSession

log = logging.getLogger("vllm.dss.writer")


@dataclass(slots=True)
class WriteJob:
    """Pages ``first_page ..`` of ``tokens``, one row of ``payload`` each (a uint8 array)."""

    req_id: str
    scope: Scope
    tokens: array.array
    first_page: int
    payload: np.ndarray
    started: float = 0.0
    """``time.perf_counter()`` when the copy out of the KV cache began."""


@dataclass(slots=True)
class WriterDone:
    """What the writer finished since it was last asked."""

    saved: dict[str, int] = field(default_factory=dict)
    """Jobs finished (written or failed) per request."""
    page_ids: list[bytes] = field(default_factory=list)
    """Pages written (with ``report_pages``), in the order written."""
    seconds: list[float] = field(default_factory=list)
    """Per job, from the copy out of the KV cache to the end of the write."""
    num_pages: int = 0
    num_failed: int = 0


class PageWriter(JobThread[WriteJob, tuple[int, list[bytes]]]):
    """One writer thread over one store, with at most ``max_pending_bytes`` waiting."""

    def __init__(
        self, store: dss.Store, layout: dss.Layout, max_pending_bytes: int, *, report_pages: bool = False
    ) -> None:
        self.store = store
        self.layout = layout
        self.max_pending_bytes = max_pending_bytes
        self.report_pages = report_pages
        self.num_pages_written = 0
        self.num_failed_jobs = 0
        self._pending_bytes = 0
        self._done = WriterDone()
        self._sessions: set[tuple[str, str]] = set()
        super().__init__("dss-page-writer")

    def put(self, job: WriteJob) -> None:
        """Queue a job; waits while more than ``max_pending_bytes`` are queued."""
        with self._cond:
            while self._pending_bytes > self.max_pending_bytes and self._error is None:
                self._cond.wait()
            self._pending_bytes += job.payload.nbytes
        super().put(job)

    def take_done(self) -> WriterDone:
        """What finished since the last call (see :class:`WriterDone`)."""
        with self._cond:
            done, self._done = self._done, WriterDone()
            return done

    @property
    def pending_bytes(self) -> int:
        """Payload bytes queued and not yet written."""
        with self._cond:
            return self._pending_bytes

    def flush(self) -> None:
        """Wait until every queued job has finished."""
        self.wait_idle()

    # -- the thread ------------------------------------------------------------------------

    def _do(self, job: WriteJob) -> tuple[int, list[bytes]]:
        return self._write(job)

    def _finish(self, job: WriteJob, result: tuple[int, list[bytes]]) -> None:
        written, page_ids = result
        self._pending_bytes -= job.payload.nbytes
        done = self._done
        done.saved[job.req_id] = done.saved.get(job.req_id, 0) + 1
        done.page_ids.extend(page_ids)
        done.seconds.append(time.perf_counter() - job.started)
        done.num_pages += written
        done.num_failed += not written

    def _write(self, job: WriteJob) -> tuple[int, list[bytes]]:
        """Save the job's pages; (pages saved, their ids if reported), ``(0, [])`` if refused."""
        pages = {job.first_page + i: job.payload[i].tobytes() for i in range(job.payload.shape[0])}
        scope = job.scope
        saved = None
        try:
            if scope.session_id is not None and self._session(scope):
                try:
                    saved = self.store.save_pages(scope.session_id, job.tokens, pages, tenant_id=scope.tenant_id)
                except UnknownSession:  # deleted since: make it again
                    self._sessions.discard((scope.tenant_id, scope.session_id))
                    if self._session(scope):
                        saved = self.store.save_pages(scope.session_id, job.tokens, pages, tenant_id=scope.tenant_id)
            else:
                saved = self.store.save_pages(
                    None, job.tokens, pages, tenant_id=scope.tenant_id, user_id=scope.user_id, layout=self.layout
                )
            self.num_pages_written += len(pages)
        except DssError as exc:
            self.num_failed_jobs += 1
            log.error("saving %d pages of request %s failed: %s", len(pages), job.req_id, exc)
            return 0, []
        if not self.report_pages or saved is None:
            return len(pages), []
        return len(pages), [bytes(p) for p in saved.page_ids.values()]

    def _session(self, scope: Scope) -> bool:
        """Make sure the session exists; ``False`` if its id is taken by another owner or layout."""
        key = (scope.tenant_id, scope.session_id)
        if key in self._sessions:
            return True
        assert scope.session_id is not None
        try:
            self.store.create_session(
                scope.session_id, user_id=scope.user_id, tenant_id=scope.tenant_id, layout=self.layout
            )
        except SessionExists as exc:
            log.error("session %r: %s", scope.session_id, exc)
            return False
        self._sessions.add(key)
        return True
