"""The device tier: which pages engine instances still hold in their own KV memory.

dss does not copy pages into an engine's memory (GPU HBM in production); the engine's adapter
tells the store which of its pages the engine holds (:meth:`Residency.mark`, e.g. when a
request finished and vLLM keeps its blocks in its prefix cache) and which it let go
(:meth:`Residency.evict`, when vLLM reused the blocks). The store then reports such pages
as on the ``device`` tier in ``resume`` (only pages some other tier also holds: a page only an
engine holds is that engine's own prefix-cache hit, and no other engine could load it), and a
router asks :meth:`Residency.holders` which engine holds most of a session.

Residency lives in this process's memory, shared by every store opened on the same catalog
in the process (:func:`for_catalog`): it describes engines running now, not data, so nothing
of it is written anywhere. An engine that goes away says so (:meth:`Residency.forget`); one
that stops reporting for ``ttl_s`` seconds (it crashed) is forgotten when next looked at. Every
mark or evict of an engine renews its lease (an empty mark just renews it).
Thread-safe. ``version`` moves on whenever what is resident changes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dss.core.types import PageId


@dataclass(slots=True)
class _Engine:
    pages: set[PageId] = field(default_factory=set)
    seen: float = 0.0


class Residency:
    """Pages held per engine instance (see the module docstring)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.version = 0
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        self._holders: dict[PageId, set[str]] = {}
        self._expired_at = float("-inf")

    def mark(self, engine_id: str, page_ids: Iterable[PageId]) -> None:
        """Engine ``engine_id`` holds these pages (and is alive)."""
        with self._lock:
            engine = self._engines.setdefault(engine_id, _Engine())
            engine.seen = self.clock()
            new = [p for p in page_ids if p not in engine.pages]
            if new:
                engine.pages.update(new)
                for page_id in new:
                    self._holders.setdefault(page_id, set()).add(engine_id)
                self.version += 1

    def evict(self, engine_id: str, page_ids: Iterable[PageId]) -> None:
        """Engine ``engine_id`` no longer holds these pages (and is alive)."""
        with self._lock:
            engine = self._engines.get(engine_id)
            if engine is None:
                return
            engine.seen = self.clock()
            gone = [p for p in page_ids if p in engine.pages]
            if gone:
                self._drop(engine_id, engine, gone)

    def forget(self, engine_id: str) -> int:
        """The engine went away: forget what it held; returns how many pages that was."""
        with self._lock:
            engine = self._engines.pop(engine_id, None)
            if engine is None:
                return 0
            pages = list(engine.pages)
            self._drop(engine_id, engine, pages)
            return len(pages)

    @property
    def held(self) -> dict[PageId, set[str]]:
        """Every page some engine holds, with its engines (read without the lock: the hot path
        of ``resume`` only asks ``page_id in held``)."""
        return self._holders

    def holders(self, page_ids: Iterable[PageId]) -> dict[str, int]:
        """How many of these pages each live engine holds (engines holding none are left out)."""
        self.expire()
        counts: dict[str, int] = {}
        with self._lock:
            for page_id in page_ids:
                for engine_id in self._holders.get(page_id, ()):
                    counts[engine_id] = counts.get(engine_id, 0) + 1
        return counts

    def engines(self) -> dict[str, int]:
        """Every live engine with the number of pages it holds."""
        self.expire()
        with self._lock:
            return {engine_id: len(engine.pages) for engine_id, engine in self._engines.items()}

    def expire(self, *, at_most_every_s: float = 0.0) -> list[str]:
        """Forget the engines not heard from for ``ttl_s`` seconds; returns their ids. With
        ``at_most_every_s``, does nothing if it looked less than that long ago (the hot path)."""
        now = self.clock()
        if now - self._expired_at < at_most_every_s:
            return []
        self._expired_at = now
        with self._lock:
            stale = [e for e, engine in self._engines.items() if now - engine.seen > self.ttl_s]
        for engine_id in stale:
            self.forget(engine_id)
        return stale

    def _drop(self, engine_id: str, engine: _Engine, page_ids: list[PageId]) -> None:
        engine.pages.difference_update(page_ids)
        for page_id in page_ids:
            holders = self._holders.get(page_id)
            if holders is not None:
                holders.discard(engine_id)
                if not holders:
                    del self._holders[page_id]
        self.version += 1


_registry: dict[str, Residency] = {}
_registry_lock = threading.Lock()


def for_catalog(key: str, ttl_s: float) -> Residency:
    """The residency of this process's engines for the catalog named ``key`` (made on first use)."""
    with _registry_lock:
        residency = _registry.get(key)
        if residency is None:
            residency = _registry[key] = Residency(ttl_s)
        return residency
