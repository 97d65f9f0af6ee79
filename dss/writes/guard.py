"""The guard every store call holds: the store's lock and open state.

Every method of the store holds the :class:`Guard` while it reads or changes this process's
caches, caught up with other processes first (:meth:`Guard.reading`): the mirror's events
from the feed, and with them the MinHash-LSH index (:mod:`dss.approx.upkeep`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from dss.approx.upkeep import Upkeep
from dss.catalog.database import catalog_errors
from dss.core.errors import StoreClosed
from dss.pages.store import PageStore
from dss.sessions.mirror import Mirror


class Guard:
    """The store's lock and open state (see the module docstring)."""

    def __init__(self, mirror: Mirror, upkeep: Upkeep, pages: PageStore) -> None:
        self.lock = threading.RLock()
        self.is_closed = False
        self._mirror = mirror
        self._upkeep = upkeep
        self._pages = pages
        self._forgotten = mirror.forgotten

    def check_open(self) -> None:
        if self.is_closed:
            raise StoreClosed("this store is closed")

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the lock, caught up with other processes and nodes (after another node's
        erasure, this node's files of the erased namespace are deleted first); catalog
        failures surface as ``CatalogUnavailable`` or ``CatalogCorrupt``."""
        with self.lock:
            self.check_open()
            with catalog_errors():
                self._upkeep.apply(self._mirror.sync())
                if self._mirror.forgotten != self._forgotten:  # an erasure elsewhere: drop this node's files of it
                    self._forgotten = self._mirror.forgotten
                    self._pages.sweep()
                yield
