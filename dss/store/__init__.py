"""The embedded store: sessions, versions, resume, pages across host and disk.

:class:`Store` is the public API, a thin facade: it validates arguments, asks
:mod:`dss.sessions.versions` for the :class:`~dss.catalog.change.Change` a write makes, applies it
(:meth:`dss.writes.writer.Writer.apply`: segment files, one catalog transaction, this process's
caches), and answers reads from the mirror (:mod:`dss.sessions.mirror`) and the matcher (:mod:`dss.sessions.matcher`).
Every method is thread-safe (one lock per store) and several processes may open the same
store folder: each catches up with the others' writes before it answers.

Contracts that hold for every method:

* An argument that is wrong raises a :class:`dss.core.errors.DssError` subclass and changes
  nothing.
* A method that returns after a write has committed it durably (catalog transaction and
  fsynced page files); a process killed at any instant loses no returned commit and
  leaves no half-visible version.
* ``resume`` never counts a page unless some tier holds its bytes under this session's
  namespace and layout; bytes that fail their checksum on read are a miss and are
  quarantined, never returned. The remote tier (Redis, a cache shared by the nodes of a
  fleet) is the one exception to "holds": a page the catalog has on another node's disk
  is counted as ``remote`` without asking Redis, which may have evicted it; reading it then
  returns ``None`` (a miss), never other bytes.
"""

from __future__ import annotations

from dss.store.base import CACHE_PREFIX, policy_settings
from dss.store.prefixes import Prefixes
from dss.store.serving import Serving


class Store(Prefixes, Serving):
    """A dialogue state store opened in this process (see the module docstring): the parts
    (:mod:`dss.store.base`) with the methods of each role — sessions and versions
    (:mod:`dss.store.history`), what engines are served (:mod:`dss.store.serving`), what
    operators do (:mod:`dss.store.operations`), and shared prefixes, which need the first and
    the last (:mod:`dss.store.prefixes`)."""


__all__ = ["CACHE_PREFIX", "Store", "policy_settings"]
