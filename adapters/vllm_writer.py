"""A background writer of pages for the worker side: copies leave the KV cache at once, the
store writes them (and fsyncs) off the engine's critical path.

Jobs are written in the order they were put, one at a time, so a request's pages reach
the store in prompt order. :meth:`PageWriter.take_done` tells the engine which jobs have
finished (written, or failed with a logged ``DssError``); a failure that is not a
``DssError`` is a bug: it stops the writer and is raised again in the engine's thread by
the next :meth:`PageWriter.put` or :meth:`PageWriter.raise_if_failed`.
"""

from __future__ import annotations

import array
import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
from dss_adapters.vllm_settings import Scope

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


class PageWriter:
    """One writer thread over one store, with at most ``max_pending_bytes`` waiting."""

    def __init__(self, store: dss.Store, layout: dss.Layout, max_pending_bytes: int) -> None:
        self.store = store
        self.layout = layout
        self.max_pending_bytes = max_pending_bytes
        self.num_pages_written = 0
        self.num_failed_jobs = 0
        self._jobs: deque[WriteJob | None] = deque()
        self._pending_bytes = 0
        self._done: dict[str, int] = {}
        self._sessions: set[tuple[str, str]] = set()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dss-page-writer", daemon=True)
        self._thread.start()

    def put(self, job: WriteJob) -> None:
        """Queue a job; waits while more than ``max_pending_bytes`` are queued."""
        with self._cond:
            while self._pending_bytes > self.max_pending_bytes and self._error is None:
                self._cond.wait()
            self._check()
            self._jobs.append(job)
            self._pending_bytes += job.payload.nbytes
            self._cond.notify_all()

    def take_done(self) -> dict[str, int]:
        """Jobs finished since the last call, per request id."""
        with self._cond:
            done, self._done = self._done, {}
            return done

    def raise_if_failed(self) -> None:
        """Raise the writer's unexpected error, if it stopped on one."""
        with self._cond:
            self._check()

    def flush(self) -> None:
        """Wait until every queued job has finished."""
        with self._cond:
            while (self._jobs or self._pending_bytes) and self._error is None:
                self._cond.wait()
            self._check()

    def close(self) -> None:
        """Finish the queued jobs and stop the thread. Idempotent."""
        if self._thread.is_alive():
            with self._cond:
                self._jobs.append(None)
                self._cond.notify_all()
            self._thread.join()

    # -- the thread ------------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the dss page writer stopped") from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs[0]
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as exc:  # a bug: stop, and raise it in the engine's thread
                log.exception("dss page writer stopped")
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.popleft()
                self._pending_bytes -= job.payload.nbytes
                self._done[job.req_id] = self._done.get(job.req_id, 0) + 1
                self._cond.notify_all()

    def _write(self, job: WriteJob) -> None:
        pages = {job.first_page + i: job.payload[i].tobytes() for i in range(job.payload.shape[0])}
        scope = job.scope
        try:
            if scope.session_id is not None and self._session(scope):
                try:
                    self.store.save_pages(scope.session_id, job.tokens, pages, tenant_id=scope.tenant_id)
                except UnknownSession:  # deleted since: make it again
                    self._sessions.discard((scope.tenant_id, scope.session_id))
                    if self._session(scope):
                        self.store.save_pages(scope.session_id, job.tokens, pages, tenant_id=scope.tenant_id)
            else:
                self.store.save_pages(None, job.tokens, pages, tenant_id=scope.tenant_id, user_id=scope.user_id,
                                      layout=self.layout)
            self.num_pages_written += len(pages)
        except DssError as exc:
            self.num_failed_jobs += 1
            log.error("saving %d pages of request %s failed: %s", len(pages), job.req_id, exc)

    def _session(self, scope: Scope) -> bool:
        """Make sure the session exists; ``False`` if its id is taken by another owner or layout."""
        key = (scope.tenant_id, scope.session_id)
        if key in self._sessions:
            return True
        assert scope.session_id is not None
        try:
            self.store.create_session(scope.session_id, user_id=scope.user_id, tenant_id=scope.tenant_id,
                                      layout=self.layout)
        except SessionExists as exc:
            log.error("session %r: %s", scope.session_id, exc)
            return False
        self._sessions.add(key)
        return True
