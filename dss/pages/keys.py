"""Data keys: made with a namespace, wrapped under the master key, unwrapped once per process.

See :mod:`dss.core.crypto` for the scheme. A namespace gets its data key in the transaction
that makes it (:func:`ensure_namespace`); a namespace under erasure gets none (its key was
destroyed first). :class:`DataKeys` unwraps a namespace's key on first use and keeps what it
yields (:class:`Keys`) until the namespace is forgotten. Nothing here decides what is sealed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NamedTuple

from dss.catalog import erasures, namespaces
from dss.catalog.database import Catalog
from dss.core.crypto import (
    Sealer,
    SealError,
    create_master_key,
    master_check,
    master_key_file,
    namespace_hash_key,
    new_data_key,
    session_key,
    session_lookup_key,
    unwrap,
    wrap,
)
from dss.core.errors import CatalogCorrupt, ConfigError, ErasureInProgress


def owner_tag(user_ref: int) -> bytes:
    """What a wrapped data key is bound to."""
    return b"user:%d" % user_ref


def tokens_aad(session_key: bytes) -> bytes:
    """What a sealed token history is bound to: its session (by the keyed hash of its id,
    known before the session's row exists; within one namespace it names one session)."""
    return b"dss-tokens v2\0" + session_key


def name_aad(session_key: bytes) -> bytes:
    """What a sealed session id is bound to (its keyed hash, so names cannot be swapped)."""
    return b"dss-session-id v1\0" + session_key


def label_aad(session_key: bytes) -> bytes:
    """What a sealed version label is bound to (its session, as for :func:`tokens_aad`)."""
    return b"dss-label v2\0" + session_key


def remote_tag(hash_key: bytes) -> bytes:
    """The remote tier's name for a namespace: a keyed hash of its page-id hashing key (so
    no key name says whose pages it holds, and the tag cannot be made again once the key
    is destroyed)."""
    return hashlib.blake2b(b"dss-remote-namespace v1", key=hash_key[:64], digest_size=12).digest()


class Keys(NamedTuple):
    """What a namespace's data key yields: the page-id hashing key, the sealer of pages and
    token histories (``None`` when the store does not encrypt), and the sealer of session ids
    and labels (always)."""

    hash_key: bytes
    sealer: Sealer | None
    names: Sealer


class DataKeys:
    """The unwrapped keys of the namespaces this process used. Not thread-safe; the store locks."""

    def __init__(self, catalog: Catalog, master: bytes, *, encrypt: bool) -> None:
        self.catalog = catalog
        self._master = master
        self._lookup = session_lookup_key(master)
        self._encrypt = encrypt
        self._keys: dict[int, Keys] = {}

    def of(self, user_ref: int, conn: Any = None) -> Keys:
        """The keys of a namespace (read on ``conn`` if given). Raises ``ErasureInProgress``
        when its data key was destroyed."""
        keys = self._keys.get(user_ref)
        if keys is None:
            data_key = self._data_key(user_ref, conn)
            names = Sealer(data_key)
            keys = self._keys[user_ref] = Keys(namespace_hash_key(data_key), names if self._encrypt else None, names)
        return keys

    def cached(self, user_ref: int) -> Keys | None:
        """The keys of a namespace if this process holds them, else ``None``; no I/O and no
        lock needed."""
        return self._keys.get(user_ref)

    def sealer_of(self, user_ref: int) -> Sealer | None:
        """The page sealer of a namespace, or ``None`` if its key is gone (its pages are unreadable)."""
        try:
            return self.of(user_ref).names
        except ErasureInProgress:
            return None

    def session_key(self, session_id: str) -> bytes:
        """The keyed hash the catalog finds a session id by."""
        return session_key(self._lookup, session_id)

    def forget(self, user_ref: int) -> None:
        """Drop a namespace's keys (its erasure destroyed them)."""
        self._keys.pop(user_ref, None)

    def clear(self) -> None:
        self._keys.clear()

    def _data_key(self, user_ref: int, conn: Any) -> bytes:
        if conn is None:
            with self.catalog.read() as own:
                wrapped = namespaces.wrapped_key(own, user_ref)
        else:
            wrapped = namespaces.wrapped_key(conn, user_ref)
        if wrapped is None:
            raise ErasureInProgress("this user's data key is destroyed: their data is being (or was) erased")
        try:
            return unwrap(self._master, wrapped, owner_tag(user_ref))
        except SealError:
            raise CatalogCorrupt(
                f"the data key of namespace {user_ref} does not authenticate under the master key: "
                "the catalog row is damaged"
            ) from None


def ensure_namespace(conn: Any, tenant_id: str, user_id: str, master: bytes) -> tuple[int, int, bool]:
    """``(tenant_ref, user_ref, made)`` of a namespace, made with its data key if absent, in the
    caller's write transaction (``made``: its key is new, and gone if that transaction rolls
    back). Raises ``ErasureInProgress`` while the user is being erased."""
    tenant_ref = namespaces.ensure_tenant(conn, tenant_id)
    user_ref = namespaces.ensure_user(conn, tenant_ref, user_id)
    if erasures.open_job_for(conn, tenant_id, user_id) is not None:  # by name: the job outlives the user's row
        raise ErasureInProgress("this user's data is being erased; try again when the erasure has finished")
    made = namespaces.wrapped_key(conn, user_ref) is None
    if made:
        namespaces.insert_key(conn, user_ref, wrap(master, new_data_key(), owner_tag(user_ref)))
    return tenant_ref, user_ref, made


def adopt_master_key(catalog: Catalog, master: bytes | None, key_file: Path | None) -> bytes:
    """Check the master key against the catalog (recording it on first use); give data keys
    to namespaces made before revision 0002; return the key.

    ``master`` is ``None`` when the key file does not exist yet: a new key is published
    there, unless the catalog already recorded a master key (which a new one could never
    open). Raises ``ConfigError`` for another master key, or a missing one; a refused
    store leaves no key file behind.
    """
    if master is None:
        with catalog.read() as conn:
            if namespaces.meta(conn, "master_check") is not None:
                raise ConfigError(
                    f"this store was made with a master key, but the master key file "
                    f"{master_key_file(key_file)} does not exist: restore it, or name the right one "
                    "(master_key_file / DSS_MASTER_KEY_FILE / DSS_MASTER_KEY)"
                )
        master = create_master_key(key_file)
    with catalog.read() as conn:
        if namespaces.meta(conn, "master_check") == master_check(master) and not namespaces.users_without_key(conn):
            return master  # the usual case: nothing to write
    with catalog.write() as tx:
        check = namespaces.meta(tx.conn, "master_check")
        if check is None:
            namespaces.set_meta(tx.conn, "master_check", master_check(master))
        elif check != master_check(master):
            raise ConfigError(
                "this store was made with another master key (master_key_file / "
                "DSS_MASTER_KEY_FILE / DSS_MASTER_KEY): without it no page or history is readable"
            )
        for user_ref in namespaces.users_without_key(tx.conn):
            namespaces.insert_key(tx.conn, user_ref, wrap(master, new_data_key(), owner_tag(user_ref)))
    return master
