"""API keys of the service: each maps to one tenant (and maybe admin rights); only hashes are stored.

A key looks like ``dss_3f9a0c1b2d4e_<43 url-safe characters>``: ``3f9a0c1b2d4e`` is its
public ``key_id`` (shown by ``dss keys list``, used to revoke it), the rest is 256 random
bits. The keys file keeps the SHA-256 of the whole key, never the key: a key is printed
once, when it is made. (Keys carry 256 bits of entropy, so a fast hash is safe here.)

The keys file is JSON, first member ``"format": "dss-api-keys v1"``, written atomically
(temp file, fsync, rename, fsync of the folder) with mode 0600, and serialised between
concurrent writers by a lock file. A running service accepts a new key at once and stops
accepting a removed one within a second.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dss.core.errors import ConfigError, InvalidInput, NotFound
from dss.core.validate import check_name
from dss.service.problems import Unauthorized

log = logging.getLogger("dss.service.apikeys")

KEYS_FORMAT = "dss-api-keys v1"
KEY_PREFIX = "dss_"


class ApiKey(BaseModel):
    """One stored key: its public id, the SHA-256 of the key, its tenant and rights."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str = Field(pattern=r"^[0-9a-f]{12}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant_id: str
    is_admin: bool = False
    label: str | None = None
    created_at: dt.datetime


class KeysFile(BaseModel):
    """The keys file as stored."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["dss-api-keys v1"]
    keys: list[ApiKey]


class Principal(NamedTuple):
    """Who sent a request: the key's id, its tenant and whether it is an admin key."""

    key_id: str
    tenant_id: str
    is_admin: bool


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as stored."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def read_keys(path: Path) -> list[ApiKey]:
    """The keys in ``path`` (``[]`` if the file does not exist); ``ConfigError`` if it is malformed."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read the API keys file {path}: {exc}") from None
    try:
        keys = KeysFile.model_validate_json(raw).keys
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ConfigError(
            f"the API keys file {path} is not a valid {KEYS_FORMAT!r} file: {where}: {first['msg']}"
        ) from None
    ids = [k.key_id for k in keys]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"the API keys file {path} lists a key id twice")
    return keys


def add_key(path: Path, tenant_id: str, *, is_admin: bool = False, label: str | None = None) -> tuple[str, ApiKey]:
    """Make a new key for ``tenant_id`` and store its hash; returns ``(key, stored entry)``.

    The key itself is returned only here: nothing can recover it later.
    """
    check_name("tenant_id", tenant_id)
    if label is not None and (len(label) > 256 or not label.isprintable()):
        raise InvalidInput("label must be a printable string of at most 256 characters")
    with _locked(path):
        keys = read_keys(path)
        key_id = secrets.token_hex(6)
        while any(k.key_id == key_id for k in keys):
            key_id = secrets.token_hex(6)
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        entry = ApiKey(
            key_id=key_id,
            sha256=hash_key(key),
            tenant_id=tenant_id,
            is_admin=is_admin,
            label=label,
            created_at=dt.datetime.now(dt.UTC),
        )
        _write(path, [*keys, entry])
    return key, entry


def remove_key(path: Path, key_id: str) -> ApiKey:
    """Revoke the key ``key_id``; returns its entry. Raises ``NotFound`` if there is none."""
    with _locked(path):
        keys = read_keys(path)
        gone = [k for k in keys if k.key_id == key_id]
        if not gone:
            raise NotFound(f"no API key {key_id!r} in {path}")
        _write(path, [k for k in keys if k.key_id != key_id])
    return gone[0]


class KeyRing:
    """The keys a running service accepts, re-read when the keys file changes. Thread-safe.

    The file is checked (one ``stat``) at most every ``reload_interval_s``, and at once when
    a key is not known. If a changed file cannot be read, the keys read before stay in force
    and an error is logged.
    """

    def __init__(self, path: Path, *, reload_interval_s: float = 1.0) -> None:
        self.path = path
        self.reload_interval_s = reload_interval_s
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._by_hash = self._index(read_keys(path))
        self._checked = time.monotonic()

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, key: str | None) -> Principal:
        """The principal of ``key``; raises ``Unauthorized`` for a missing or unknown key."""
        if not key:
            raise Unauthorized("this endpoint needs an API key: send 'Authorization: Bearer <key>'")
        digest = hash_key(key)
        self._maybe_reload(force=False)
        entry = self._by_hash.get(digest)
        if entry is None:  # perhaps added a moment ago
            self._maybe_reload(force=True)
            entry = self._by_hash.get(digest)
        if entry is None:
            raise Unauthorized("unknown API key")
        return Principal(entry.key_id, entry.tenant_id, entry.is_admin)

    def _maybe_reload(self, *, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._checked < self.reload_interval_s:
            return
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return
            try:
                keys = read_keys(self.path)
            except ConfigError as exc:
                log.error("keeping the previous API keys: %s", exc)
                return
            self._stamp = stamp
            self._by_hash = self._index(keys)
            log.info("reloaded %d API keys from %s", len(keys), self.path)

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    @staticmethod
    def _index(keys: list[ApiKey]) -> dict[str, ApiKey]:
        return {k.sha256: k for k in keys}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise writers of one keys file (a lock file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write(path: Path, keys: list[ApiKey]) -> None:
    """Publish a new keys file atomically (temp, fsync, rename, fsync folder), mode 0600."""
    body = {"format": KEYS_FORMAT, "keys": [k.model_dump(mode="json") for k in keys]}
    data = json.dumps(body, indent=2).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=".api-keys-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
