"""The remote tier: page records in Redis, shared by every node of a fleet.

A cache, not a store of record: Redis may evict any key, may be slow or down, and dss never
depends on it. What a page costs and how it is found:

* **Keys** — ``<prefix>{<tag>}:<page id hex>``. The tag is a keyed hash of the namespace (made
  from the namespace's hash key by the caller); page ids are keyed chain hashes already. No
  tenant, user or session id appears in a key name. The braces are a Redis Cluster hash tag:
  every page of one namespace lives in one slot, so a resume's pages are read in one ``MGET``
  (in a cluster, one ``MGET`` per namespace, pipelined to the masters at once).
* **Values** — format ``dssr v1``: the 7-byte tag, a flags byte, the little-endian u64
  checksum (XXH3) of the stored bytes, then the stored bytes: the page sealed under its
  owner's data key exactly as in a disk segment record (so a copy in a Redis replica, an AOF
  or an RDB file is unreadable once the key is destroyed).
* **Writes** go through a background thread: :meth:`RemoteTier.put` queues and returns; the
  thread writes queued pages in pipelined batches. :meth:`RemoteTier.drop` queues deletions the
  same way, in order with the writes (the keys of pages gone from every tier). At most
  ``max_pending_bytes`` wait (a deletion counts its key's length); beyond that the oldest are
  let go (a later miss, or a key left to Redis's own eviction; never an error).
* **Reads** (:meth:`RemoteTier.get`) are one round trip for any number of keys; a missing
  key, a timeout or a refused connection is a miss.
* **Failures** — every call has a time limit; after :data:`BREAKER_FAILURES` failures in a row
  a circuit breaker opens for :data:`BREAKER_COOLDOWN_S` (reads miss at once, writes wait),
  then lets one call through to probe. ``is_up``, ``errors`` (per operation) and
  ``pending_bytes`` are what the service exports as ``dss_remote_up``,
  ``dss_remote_errors_total{op}`` and ``dss_remote_pending_bytes``; going down and coming
  back are logged once each.

Erasure needs to know: :meth:`delete` and :meth:`scan` raise :class:`RemoteUnavailable`
instead of pretending. In a Redis Cluster both cover every master (``DEL`` is split by slot,
``SCAN`` walks each master to its end).

**Fences.** :meth:`fence` sets ``<prefix>{<tag>}:fence`` (no data, :data:`FENCE_TTL_S`) before an
erasure sweeps the namespace's keys; every write checks for its namespace's fence and sets
its keys in one script (one ``EVAL`` per namespace and batch: the fence and the pages share a
hash slot), so a write-through that reaches Redis after the fence, from any node, is dropped,
and one that reached it before is deleted by the sweep.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from dss.core.errors import ConfigError

log = logging.getLogger("dss.tiers.remote")

TAG = b"dssr v1"
_HEAD = struct.Struct("<7sBq")
BATCH_BYTES = 8 << 20
"""Most bytes the writer thread sends in one pipeline."""
DELETE_BATCH = 500
"""Keys per ``DEL`` (and per ``SCAN`` page)."""
BREAKER_FAILURES = 3
BREAKER_COOLDOWN_S = 1.0
FENCE_TTL_S = 7 * 24 * 3600
"""How long a namespace's fence stays (a write queued on a node for longer is let go anyway)."""
_PUT_UNLESS_FENCED = (
    "if redis.call('exists', KEYS[1]) == 1 then return 0 end "
    "for i = 2, #KEYS do redis.call('set', KEYS[i], ARGV[i - 1]) end return #KEYS - 1"
)
"""Set KEYS[2:] to ARGV unless the fence KEYS[1] exists (all keys of one namespace, one slot)."""
OPS = ("get", "put", "delete", "scan", "verify")
"""The operations ``errors`` counts (``verify``: a value that is not the page's)."""


class RemoteUnavailable(Exception):
    """The remote tier could not be reached (erasure must not pretend it deleted anything)."""


def pack_value(checksum: int, flags: int, stored: bytes) -> bytes:
    """A page record as the remote tier keeps it (see the module docstring)."""
    return _HEAD.pack(TAG, flags, checksum) + stored


def unpack_value(raw: bytes) -> tuple[int, int, bytes] | None:
    """``(checksum, flags, stored)`` of a value, or ``None`` if it is not one."""
    if len(raw) < _HEAD.size or raw[: len(TAG)] != TAG:
        return None
    _, flags, checksum = _HEAD.unpack_from(raw)
    return checksum, flags, raw[_HEAD.size :]


def key_of(prefix: str, tag: bytes, page_id: bytes) -> str:
    """The key of a page of the namespace tagged ``tag``."""
    return f"{prefix}{{{tag.hex()}}}:{page_id.hex()}"


def fence_key_of(key: str) -> str:
    """The fence key of the namespace of a page's key (see the module docstring)."""
    return f"{key.rsplit(':', 1)[0]}:fence"


def page_id_of(key: str | bytes) -> bytes | None:
    """The page id a key names (``None`` for a key that is not a page's)."""
    text = key.decode() if isinstance(key, bytes) else key
    try:
        return bytes.fromhex(text.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _size(item: tuple[str, bytes | None]) -> int:
    """What a queued write (its value) or deletion (its key) counts towards ``pending_bytes``."""
    key, value = item
    return len(key) if value is None else len(value)


class RemoteTier:
    """Page records in a Redis (or Redis Cluster) shared by the fleet. Thread-safe."""

    def __init__(self, url: str, *, prefix: str, timeout_s: float, max_pending_bytes: int) -> None:
        """Connect lazily (nothing is sent before the first call) and start the writer thread.
        Needs redis-py (the ``server`` extra); raises ``ConfigError`` without it."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError("remote_url needs redis-py: pip install 'dss-store[server]'") from None
        self._error: tuple[type[Exception], ...] = (redis.RedisError, redis.exceptions.RedisClusterException)
        self.prefix = prefix
        self.max_pending_bytes = max_pending_bytes
        # one immediate retry: a pooled connection a restarted Redis dropped fails once
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 1),
        }
        self.is_cluster = "+cluster://" in url
        self._client: Any = None
        try:
            if self.is_cluster:  # connects at once to learn the slots: made on first use (see client)
                cluster_url = url.replace("+cluster://", "://", 1)
                redis.connection.parse_url(cluster_url)
                self._connect = lambda: redis.RedisCluster.from_url(cluster_url, **options)
            else:
                self._client = redis.Redis.from_url(url, **options)
        except ValueError as exc:  # never the URL itself: it may hold a password
            raise ConfigError(f"remote_url is not a Redis URL: {str(exc).split(':')[0]}") from None
        self.is_up = True
        self.errors = dict.fromkeys(OPS, 0)
        self.pending_bytes = 0
        self._failures = 0
        self._open_until = 0.0
        self._queue: deque[tuple[str, bytes | None]] = deque()
        """``(key, value)`` to write, ``(key, None)`` to delete."""
        self._cond = threading.Condition()
        self._writing = False
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="dss-remote-writer", daemon=True)
        self._thread.start()

    @property
    def client(self) -> Any:
        """The redis-py client (a Redis Cluster's is made on first use; raises while the
        cluster cannot be reached, which the calling operation counts as a failure)."""
        if self._client is None:
            self._client = self._connect()
        return self._client

    # -- writing ---------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Queue ``(key, value)`` pairs for the writer thread; never blocks, never raises."""
        self._enqueue(items)

    def drop(self, keys: Sequence[str]) -> None:
        """Queue the deletion of ``keys`` for the writer thread (after the writes queued before
        it); never blocks, never raises. A deletion that fails is retried like a write, and
        counted in ``errors["delete"]``."""
        self._enqueue([(key, None) for key in keys])

    def _enqueue(self, items: Sequence[tuple[str, bytes | None]]) -> None:
        if not items:
            return
        with self._cond:
            for item in items:
                self._queue.append(item)
                self.pending_bytes += _size(item)
            dropped = 0
            while self.pending_bytes > self.max_pending_bytes and self._queue:
                self.pending_bytes -= _size(self._queue.popleft())
                dropped += 1
            if dropped:
                log.warning(
                    "remote tier: %d queued writes and deletions let go (more than %d bytes waiting)",
                    dropped,
                    self.max_pending_bytes,
                )
            self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and deletion is done (or let go); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch: list[tuple[str, bytes | None]] = []
                size = 0
                while self._queue and (not batch or size + _size(self._queue[0]) <= BATCH_BYTES):
                    item = self._queue.popleft()
                    batch.append(item)
                    size += _size(item)
                self._writing = True
            ok = self._write(batch)
            with self._cond:
                self._writing = False
                if ok:
                    self.pending_bytes -= size
                else:  # back at the front, in order; the breaker paces the retries
                    self._queue.extendleft(reversed(batch))
                self._cond.notify_all()
            if not ok:
                time.sleep(min(BREAKER_COOLDOWN_S, max(0.0, self._open_until - time.monotonic())) or 0.05)

    def _write(self, batch: list[tuple[str, bytes | None]]) -> bool:
        if not self._allowed():
            return False
        try:
            self._send(batch)
        except self._error as exc:
            has_writes = any(value is not None for _, value in batch)
            if has_writes and any(value is None for _, value in batch):
                self.errors["delete"] += 1  # the breaker counts the batch once, as a put
            self._failed("put" if has_writes else "delete", exc)
            return False
        self._succeeded()
        return True

    def _send(self, batch: list[tuple[str, bytes | None]]) -> None:
        """Send a batch in order: each run of writes as one fenced script per namespace, each
        deletion as itself; pipelined on a single Redis. A cluster's pipeline takes no scripts:
        there the scripts go one by one (routed by their slot), then the deletions, pipelined."""
        pipe = self.client.pipeline(transaction=False)
        runs: dict[str, list[tuple[str, bytes]]] = {}
        num_deletions = 0

        def flush_runs() -> None:
            nonlocal pipe, num_deletions
            if self.is_cluster and runs and num_deletions:  # the deletions before these writes go first
                pipe.execute()
                pipe, num_deletions = self.client.pipeline(transaction=False), 0
            for fence, items in runs.items():
                keys, values = [fence, *(k for k, _ in items)], [v for _, v in items]
                (self.client if self.is_cluster else pipe).eval(_PUT_UNLESS_FENCED, len(keys), *keys, *values)
            runs.clear()

        for key, value in batch:
            if value is None:
                flush_runs()
                pipe.delete(key)
                num_deletions += 1
            else:
                runs.setdefault(fence_key_of(key), []).append((key, value))
        flush_runs()
        pipe.execute()

    # -- reading ---------------------------------------------------------------------------

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` in one round trip; ``None`` for a missing key, and for every
        key when Redis cannot answer in time (the breaker then counts a failure)."""
        if not keys:
            return []
        if not self._allowed():
            return [None] * len(keys)
        try:
            values = self.client.mget_nonatomic(list(keys)) if self.is_cluster else self.client.mget(list(keys))
        except self._error as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        self._succeeded()
        return list(values)

    def count_error(self, op: str) -> None:
        """Count a failure that is the value's, not the connection's (a record that does not verify)."""
        self.errors[op] += 1

    # -- erasure ---------------------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> int:
        """Delete keys in batches; return how many existed. Raises ``RemoteUnavailable``."""
        deleted = 0
        try:
            for start in range(0, len(keys), DELETE_BATCH):
                deleted += int(self.client.delete(*keys[start : start + DELETE_BATCH]))  # a cluster's: by slot
        except self._error as exc:
            self._failed("delete", exc)
            raise RemoteUnavailable(f"the remote tier cannot be reached: {exc}") from None
        self._succeeded()
        return deleted

    def scan(self, match: str) -> Iterator[bytes]:
        """Every key matching the glob ``match`` (Redis ``SCAN``). Raises ``RemoteUnavailable``."""
        try:
            yield from self.client.scan_iter(match=match, count=DELETE_BATCH)
        except self._error as exc:
            self._failed("scan", exc)
            raise RemoteUnavailable(f"the remote tier cannot be reached: {exc}") from None

    def fence(self, tag: bytes) -> None:
        """Fence the namespace tagged ``tag``: from now on no write of its pages lands (see the
        module docstring). Raises ``RemoteUnavailable``."""
        try:
            self.client.set(f"{self.prefix}{{{tag.hex()}}}:fence", b"1", ex=FENCE_TTL_S)
        except self._error as exc:
            self._failed("put", exc)
            raise RemoteUnavailable(f"the remote tier cannot be reached: {exc}") from None
        self._succeeded()

    def namespace_pattern(self, tag: bytes) -> str:
        """The glob matching every key of the namespace tagged ``tag``."""
        return f"{self.prefix}{{{tag.hex()}}}:*"

    # -- the breaker -----------------------------------------------------------------------

    def _allowed(self) -> bool:
        return time.monotonic() >= self._open_until

    def _failed(self, op: str, exc: Exception) -> None:
        self.errors[op] += 1
        self._failures += 1
        if self._failures >= BREAKER_FAILURES:
            self._open_until = time.monotonic() + BREAKER_COOLDOWN_S
        if self.is_up:
            self.is_up = False
            log.warning(
                "remote tier unreachable (%s: %s): resumes use local tiers, writes wait",
                op,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )

    def _succeeded(self) -> None:
        self._failures = 0
        self._open_until = 0.0
        if not self.is_up:
            self.is_up = True
            log.info("remote tier reachable again")

    def close(self) -> None:
        """Stop the writer thread (queued writes and deletions not yet done are let go) and disconnect."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if self._client is not None:
            self._client.close()
