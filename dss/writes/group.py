"""Group commit: concurrent writers of one process waiting for a leader to apply their
changes in one transaction (see :mod:`dss.writes.writer`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dss.catalog.change import Applied, Change, WrittenSegment


class Restart(Exception):
    """A member of a commit group failed part-way: roll the group's transaction back and go again without it."""


class Member:
    """One write waiting in a commit group: its change and files; once done, what it did or why not."""

    __slots__ = ("applied", "change", "error", "is_done", "wake", "written")

    def __init__(self, change: Change, written: list[WrittenSegment]) -> None:
        self.change = change
        self.written = written
        self.applied: Applied | None = None
        self.error: BaseException | None = None
        self.is_done = False
        self.wake = threading.Event()
        """Set when the member is done, or when it is to lead the next group."""


class CommitQueue:
    """Writers waiting for a leader (see the module docstring). Only the leader's thread runs
    a group; the others sleep on their own event until their member is done (or, for the
    first of the next group, until it is its turn to lead): no thundering herd."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Member] = []
        self._is_leading = False
        self.num_groups = 0
        """Groups led so far (for tests and metrics)."""

    @property
    def num_waiting(self) -> int:
        """Writers queued for the next group."""
        with self._lock:
            return len(self._waiting)

    def join(self, member: Member) -> list[Member] | None:
        """Queue ``member``. Returns the group to lead (every member queued so far, in arrival
        order, ``member`` among them), or ``None`` once another leader finished ``member``."""
        with self._lock:
            self._waiting.append(member)
            if not self._is_leading:
                self._is_leading = True
                return self._take()
        member.wake.wait()
        with self._lock:
            return None if member.is_done else self._take()

    def _take(self) -> list[Member]:
        group, self._waiting = self._waiting, []
        self.num_groups += 1
        return group

    def finish(self, group: Sequence[Member]) -> None:
        """The leader is done with ``group``: wake its members, and the first writer queued
        meanwhile to lead the next group."""
        with self._lock:
            for member in group:
                member.is_done = True
                member.wake.set()
            if self._waiting:
                self._waiting[0].wake.set()
            else:
                self._is_leading = False
