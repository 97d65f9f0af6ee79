"""MinHash-LSH index of stored versions: it proposes near-duplicates of a prompt, it never decides.

Terms: see :mod:`dss.approx.minhash` (shingles, Jaccard similarity, signatures).

Entries. For each indexed version: one *whole* entry (all its tokens) and one *window* entry
per page-aligned window of about ``window_tokens`` tokens, so a long shared stretch after an
early divergence is still found. A window already indexed for the same session (same start,
same tokens: the parent version's) is not indexed again.

Isolation. There is one ``datasketch.MinHashLSH`` per ``(namespace, layout)``; a query looks
only in the one it names, so no candidate ever crosses a namespace or a layout.

Size. At most ``max_entries`` entries in all; to make room, the least recently used other
index is dropped whole (it is rebuilt from the catalog when next used), else the oldest
entries of the same index go. With a Redis URL the indexes live in Redis (datasketch's Redis
storage, one basename per namespace and layout) and several nodes share them.

This module knows nothing of the catalog: :mod:`dss.approx.nearest` loads versions and feeds them in,
:mod:`dss.approx.upkeep` tells it what changed. ``datasketch`` is imported on first use only.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from dss.approx.minhash import Signer, datasketch_module, prefix_ends, shingle_hashes, window_starts
from dss.core.tokens import TOKEN_BYTES

WEIGHTS = (0.1, 0.9)
"""datasketch's weights of false positives and false negatives when it picks bands and rows
for the threshold: a false positive costs one exact comparison, a false negative loses reuse
(at the defaults, 11 bands of 11 rows: a version at Jaccard 0.9 is proposed with probability
0.984, at 0.85 with 0.867, at 0.5 with 0.005)."""

PREFIX_STEP = 1.08
"""Ratio of the lengths of consecutive prompt prefixes queried. A stored version of ``m``
shingles lies between two queried prefixes at most 8 % apart, one of them within 4 % of ``m``;
when the prompt holds the version but for a few shingles (a re-rendered line) that prefix's
Jaccard with it is still about 0.9 or more."""
MIN_PREFIX = 16
"""Fewest shingles of a queried prefix."""
CONTAINMENT_THRESHOLD = 0.7
"""The Jaccard threshold of the bands the prefixes are looked up in (20 bands of 6 rows: a
version at Jaccard 0.8 is proposed with probability 0.998, at 0.7 with 0.92, at 0.5 with 0.27).
A version the prompt holds but for 10 % of its shingles is within Jaccard 0.8 of the prefix
nearest its length; at the main threshold it would be missed one time in four."""


class Settings(NamedTuple):
    """The index's settings, checked by :class:`dss.core.config.StoreConfig`."""

    threshold: float = 0.85
    permutations: int = 128
    shingle_tokens: int = 4
    window_tokens: int = 256
    max_entries: int = 1_000_000


class Entry(NamedTuple):
    """One indexed sequence: tokens ``[start, start + num_tokens)`` of a version, the whole
    version or one of its windows."""

    session_ref: int
    version_id: int
    start: int
    num_tokens: int
    is_window: bool = False

    def key(self) -> str:
        return f"{self.session_ref}:{self.version_id}:{self.start}:{self.num_tokens}:{'w' if self.is_window else 'v'}"

    @classmethod
    def parse(cls, key: str | bytes) -> Entry:
        text = key.decode() if isinstance(key, bytes) else key
        s, v, a, n, kind = text.split(":")
        return cls(int(s), int(v), int(a), int(n), kind == "w")


class Hit(NamedTuple):
    """An entry a query proposed, and which part of the prompt found it (``0``: the whole)."""

    entry: Entry
    prompt_start: int


class Bucket:
    """The index of one namespace and layout."""

    __slots__ = ("by_session", "containment", "entries", "lsh", "name", "salt", "user_ref", "windows")

    def __init__(self, user_ref: int, name: bytes, salt: int, lsh: Any, containment: Any) -> None:
        self.user_ref = user_ref
        self.name = name
        self.salt = salt
        self.lsh = lsh
        self.containment = containment
        """The whole-version entries again, banded for :data:`CONTAINMENT_THRESHOLD` (queried by prefixes)."""
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.by_session: dict[int, set[str]] = {}
        """The keys of ``entries`` of each session."""
        self.windows: dict[int, dict[int, bytes]] = {}
        """``session_ref -> start -> digest`` of the windows indexed for each session."""


class LshIndex:
    """The MinHash-LSH indexes of this process (one per namespace and layout). Not thread-safe;
    the store locks. Every method that takes tokens takes them packed (``TOKEN_BYTES`` each)."""

    def __init__(self, settings: Settings, *, redis_url: str | None = None, redis_prefix: str = "dss-lsh") -> None:
        ds = datasketch_module()
        self.settings = settings
        self.signer = Signer(settings.permutations)
        self._ds = ds
        self._redis_url = redis_url
        self._prefix = redis_prefix
        self._redis: Any = None
        if redis_url is not None:
            import redis

            self._redis = redis.Redis.from_url(redis_url)
            kw = self._redis.connection_pool.connection_kwargs
            self._redis_config = {
                "host": kw.get("host", "127.0.0.1"),
                "port": kw.get("port", 6379),
                "db": kw.get("db", 0),
            }
            if kw.get("password"):
                self._redis_config["password"] = kw["password"]
        self.buckets: OrderedDict[tuple[int, bytes], Bucket] = OrderedDict()
        self.num_entries = 0
        self.num_dropped = 0
        probe = ds.MinHashLSH(threshold=settings.threshold, num_perm=settings.permutations, weights=WEIGHTS)
        self.bands = (probe.b, probe.r)

    @property
    def is_shared(self) -> bool:
        """Whether the indexes live in Redis (shared by every node of the store)."""
        return self._redis is not None

    # -- buckets ---------------------------------------------------------------------------

    def bucket(self, user_ref: int, layout_digest: bytes) -> Bucket | None:
        """The index of a namespace and layout, if this process holds it (marked recently used)."""
        key = (user_ref, layout_digest)
        bucket = self.buckets.get(key)
        if bucket is not None:
            self.buckets.move_to_end(key)
        return bucket

    def holds(self, user_ref: int) -> bool:
        """Whether this process holds an index of the namespace (any layout)."""
        return any(user_ref == key[0] for key in self.buckets)

    def open_bucket(self, user_ref: int, layout_digest: bytes, hash_key: bytes) -> tuple[Bucket, bool]:
        """Make (or attach to, in Redis) the index of a namespace and layout; also say whether
        it already holds the namespace's versions (an attached Redis index someone built)."""
        name = f"{self._prefix}:u{user_ref}:{layout_digest.hex()[:16]}:".encode()
        salt = int.from_bytes(hashlib.blake2b(hash_key, digest_size=8, person=b"dss-lsh").digest(), "little")
        config = None
        built = False
        if self._redis is not None:
            config = {"type": "redis", "basename": name, "redis": self._redis_config}
            built = bool(self._redis.exists(name + b"built"))
        bucket = Bucket(user_ref, name, salt, self._band(name, config), self._band(name + b"c:", config))
        self.buckets[(user_ref, layout_digest)] = bucket
        return bucket, built

    def _band(self, basename: bytes, config: dict[str, Any] | None) -> Any:
        """A ``MinHashLSH`` for ``basename`` (in Redis when ``config`` says so): the containment
        bands for a basename ending ``c:``, the main ones otherwise."""
        if config is not None:
            config = {**config, "basename": basename}
        threshold = CONTAINMENT_THRESHOLD if basename.endswith(b":c:") else self.settings.threshold
        return self._ds.MinHashLSH(
            threshold=threshold, num_perm=self.settings.permutations, weights=WEIGHTS, storage_config=config
        )

    def close_bucket(self, user_ref: int, layout_digest: bytes) -> None:
        """Let go of an index this process opened (Redis keeps a shared one)."""
        bucket = self.buckets.pop((user_ref, layout_digest), None)
        if bucket is not None:
            self.num_entries -= len(bucket.entries)

    def mark_built(self, bucket: Bucket) -> None:
        """Record (in Redis) that the namespace's versions are all in the shared index."""
        if self._redis is not None:
            self._redis.set(bucket.name + b"built", b"1")

    # -- writing ---------------------------------------------------------------------------

    def add(self, bucket: Bucket, session_ref: int, version_id: int, buf: bytes, page_tokens: int) -> int:
        """Index a version's packed tokens (whole and windows); return how many entries were added."""
        tokens = np.frombuffer(buf, dtype=np.uint32)
        n = len(tokens)
        if n == 0:
            return 0
        size = self.settings.shingle_tokens
        hashes = shingle_hashes(tokens, size, bucket.salt)
        starts = window_starts(n, self.settings.window_tokens, page_tokens, size)
        whole, parts = self.signer.values(hashes, starts)
        todo: list[tuple[Entry, np.ndarray]] = [(Entry(session_ref, version_id, 0, n), whole)]
        if parts is not None:
            ends = [*starts[1:], len(hashes)]
            for i, (start, end) in enumerate(zip(starts, ends)):
                length = end - start + size - 1
                digest = hashlib.blake2b(
                    buf[TOKEN_BYTES * start : TOKEN_BYTES * (start + length)], digest_size=8
                ).digest()
                seen = bucket.windows.setdefault(session_ref, {})
                if seen.get(start) == digest:
                    continue
                seen[start] = digest
                todo.append((Entry(session_ref, version_id, start, length, True), parts[:, i]))
        self._make_room(bucket, len(todo))
        for entry, values in todo:
            key = entry.key()
            if key in bucket.entries:
                continue
            signature = self.signer.minhash(values)
            bucket.lsh.insert(key, signature, check_duplication=False)
            if not entry.is_window:
                bucket.containment.insert(key, signature, check_duplication=False)
            bucket.entries[key] = entry
            bucket.by_session.setdefault(session_ref, set()).add(key)
            self.num_entries += 1
        return len(todo)

    def drop_session(self, session_ref: int, user_ref: int | None = None) -> None:
        """Remove every entry of a session (from every index of its namespace, or all indexes)."""
        for bucket in list(self.buckets.values()):
            if user_ref is not None and bucket.user_ref != user_ref:
                continue
            for key in sorted(bucket.by_session.pop(session_ref, ())):
                self._remove(bucket, key)
            bucket.windows.pop(session_ref, None)
        if self._redis is not None and user_ref is not None:
            self._drop_shared(user_ref, session_ref)

    def _drop_shared(self, user_ref: int, session_ref: int) -> None:
        """Remove a session's entries from every shared index of its namespace in Redis, whether
        this process opened them or not (another process may have indexed the session)."""
        prefix = f"{session_ref}:"
        pattern = f"{self._prefix}:u{user_ref}:*:_keys".encode()
        for name in self._redis.scan_iter(match=pattern, count=1000):
            basename = name[: -len(b"_keys")]
            lsh = self._band(basename, {"type": "redis", "redis": self._redis_config})
            for raw in self._redis.hkeys(name):
                key = pickle.loads(raw)
                if isinstance(key, str) and key.startswith(prefix) and key in lsh:
                    lsh.remove(key)

    def drop_namespace(self, user_ref: int) -> None:
        """Forget every index of a namespace (an erasure): in memory and, when shared, in Redis."""
        for key in [k for k in self.buckets if k[0] == user_ref]:
            bucket = self.buckets.pop(key)
            self.num_entries -= len(bucket.entries)
        if self._redis is not None:
            keys = list(self._redis.scan_iter(match=f"{self._prefix}:u{user_ref}:*".encode(), count=1000))
            if keys:
                self._redis.delete(*keys)

    def count(self, user_ref: int) -> tuple[int, int]:
        """Entries of a namespace this process holds, and keys of it in Redis (``0`` when not shared):
        what an erasure's verification inspects."""
        local = sum(len(b.entries) for b in self.buckets.values() if b.user_ref == user_ref)
        remote = 0
        if self._redis is not None:
            remote = sum(1 for _ in self._redis.scan_iter(match=f"{self._prefix}:u{user_ref}:*".encode(), count=1000))
        return local, remote

    def clear(self) -> None:
        """Forget every index this process holds (Redis keeps the shared ones)."""
        self.buckets.clear()
        self.num_entries = 0

    # -- reading ---------------------------------------------------------------------------

    def query(self, bucket: Bucket, buf: bytes | memoryview, page_tokens: int, *, prefixes: bool = True) -> list[Hit]:
        """Entries likely similar to the prompt (``buf``) as a whole or to one of its windows,
        and (unless ``prefixes`` is false) entries likely similar to one of its prefixes
        (:data:`PREFIX_STEP` apart): a stored version the prompt extends, however long the extension.

        Each entry once, with the first part of the prompt that found it (a prefix: ``0``).
        Changes nothing.
        """
        tokens = np.frombuffer(buf, dtype=np.uint32)
        if not len(tokens):
            return []
        size = self.settings.shingle_tokens
        hashes = shingle_hashes(tokens, size, bucket.salt)
        starts = window_starts(len(tokens), self.settings.window_tokens, page_tokens, size)
        phv = self.signer.permuted(hashes)
        whole, parts = self.signer.reduce(phv, starts)
        found = dict.fromkeys(self._lookup(bucket.lsh, whole[:, None]), 0)
        if prefixes:
            ends = prefix_ends(len(hashes), PREFIX_STEP, MIN_PREFIX)
            columns = np.column_stack([whole, self.signer.prefixes(phv, ends)])
            found.update(dict.fromkeys(self._lookup(bucket.containment, columns), 0))
        if parts is not None:
            for key, column in self._lookup(bucket.lsh, parts).items():
                found.setdefault(key, starts[column])
        return [Hit(Entry.parse(key), start) for key, start in found.items()]

    @staticmethod
    def _lookup(lsh: Any, columns: np.ndarray) -> dict[str, int]:
        """The key of every entry that shares a band with one of the signatures ``columns``,
        and the first column that found it (``MinHashLSH.query`` for many signatures at once:
        a band value the next column repeats is looked up once)."""
        assert lsh.hashfunc is None, "band keys are datasketch's byte-swapped values"
        found: dict[Any, int] = {}
        for (start, end), table in zip(lsh.hashranges, lsh.hashtables):
            band = np.ascontiguousarray(columns[start:end].T)
            changed = np.flatnonzero(np.any(band[1:] != band[:-1], axis=1)) + 1
            raw, width = band.byteswap().tobytes(), band.shape[1] * band.itemsize  # datasketch's band key
            for column in (0, *changed.tolist()):
                for key in table.get(raw[column * width : (column + 1) * width]):
                    if found.get(key, column) >= column:
                        found[key] = column
        if lsh.prepickle:
            return {pickle.loads(key): column for key, column in found.items()}
        return found

    def stats(self) -> dict[str, Any]:
        """Sizes, for ``Store.stats()``."""
        return {
            "indexes": len(self.buckets),
            "entries": self.num_entries,
            "capacity": self.settings.max_entries,
            "dropped_indexes": self.num_dropped,
            "bands": self.bands[0],
            "rows": self.bands[1],
            "storage": "redis" if self._redis is not None else "memory",
        }

    # -- internals -------------------------------------------------------------------------

    def _make_room(self, bucket: Bucket, n: int) -> None:
        cap = self.settings.max_entries
        while self.num_entries + n > cap:
            other = next((k for k, b in self.buckets.items() if b is not bucket), None)
            if other is not None:
                dropped = self.buckets.pop(other)
                self.num_entries -= len(dropped.entries)
                self.num_dropped += 1
                continue
            if not bucket.entries:
                return
            self._remove(bucket, next(iter(bucket.entries)))

    def _remove(self, bucket: Bucket, key: str) -> None:
        entry = bucket.entries.pop(key, None)
        if entry is not None:
            self.num_entries -= 1
            keys = bucket.by_session.get(entry.session_ref)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del bucket.by_session[entry.session_ref]
        for lsh in (bucket.lsh, bucket.containment):
            if key in lsh:
                lsh.remove(key)
