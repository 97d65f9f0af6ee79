"""One background thread that does a queue of jobs in order: the base of the page writer and loader.

A subclass says how to do a job (:meth:`JobThread._do`, in the thread, without the lock)
and what to record when it is done (:meth:`JobThread._finish`, under the lock). A subclass
with ``background = True`` runs at a lower CPU priority (nice +10) than the engine's threads:
on a busy machine the forward pass goes first and its work fills the gaps. Every such thread
may run on any CPU (:func:`any_cpu`). A failure
that is not handled in ``_do`` is a bug: it stops the thread and is raised again in the
engine's thread by the next :meth:`JobThread.put` or :meth:`JobThread.raise_if_failed`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Generic, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")

log = logging.getLogger("vllm.dss.jobs")


BACKGROUND_NICE = 10
"""How much lower than the engine the connector's background threads and processes run."""


def lower_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`BACKGROUND_NICE` (Linux: per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except (AttributeError, OSError):  # no per-thread priorities here: the thread runs as the engine does
        pass


def any_cpu() -> None:
    """Let the calling thread run on any CPU of the machine.

    vLLM's CPU workers bind their threads to the cores of their OpenMP team; a thread (or a
    child process) started from them inherits that binding, so background work would only
    ever compete with the forward pass on those cores.
    """
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no affinities here, or a cpuset forbids: keep the inherited ones
        pass


class JobThread(Generic[Job, Result]):
    """A queue of jobs and the thread that does them (see the module docstring)."""

    background = False
    """Whether the thread runs at a lower CPU priority (:func:`lower_priority`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: deque[Job | None] = deque()
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        """Queue a job."""
        with self._cond:
            self._check()
            self._jobs.append(job)
            self._cond.notify_all()

    def raise_if_failed(self) -> None:
        """Raise the thread's unexpected error, if it stopped on one."""
        with self._cond:
            self._check()

    def wait_idle(self) -> None:
        """Wait until every job put so far has finished."""
        with self._cond:
            while self._jobs and self._error is None:
                self._cond.wait()
            self._check()

    def close(self) -> None:
        """Finish the queued jobs and stop the thread. Idempotent."""
        if self._thread.is_alive():
            with self._cond:
                self._jobs.append(None)
                self._cond.notify_all()
            self._thread.join()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the {self.name} thread stopped") from self._error

    def _do(self, job: Job) -> Result:
        raise NotImplementedError

    def _finish(self, job: Job, result: Result) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        any_cpu()
        if self.background:
            lower_priority()
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs[0]
            if job is None:
                return
            try:
                result = self._do(job)
            except BaseException as exc:  # a bug: stop, and raise it in the engine's thread
                log.exception("%s stopped", self.name)
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._jobs.popleft()
                self._finish(job, result)
                self._cond.notify_all()
