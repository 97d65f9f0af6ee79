"""Data keys in the catalog: created with a namespace, checked against the master key.

See :mod:`dss.crypto` for the scheme. A namespace gets its data key in the transaction that
creates it; a namespace under erasure gets none (its key was destroyed first).
"""

from __future__ import annotations

from pathlib import Path

from dss import records
from dss.catalog import Catalog, Tx
from dss.crypto import create_master_key, master_check, master_key_file, new_data_key, wrap
from dss.errors import ConfigError, ErasureInProgress


def owner_tag(user_ref: int) -> bytes:
    """What a wrapped data key is bound to."""
    return b"user:%d" % user_ref


def tokens_aad(session_ref: int) -> bytes:
    """What a sealed token history is bound to."""
    return b"dss-tokens v1\0session:%d" % session_ref


def name_aad(session_key: bytes) -> bytes:
    """What a sealed session id is bound to (its keyed hash, so names cannot be swapped)."""
    return b"dss-session-id v1\0" + session_key


def label_aad(session_ref: int) -> bytes:
    """What a sealed version label is bound to."""
    return b"dss-label v1\0session:%d" % session_ref


def ensure_key(tx: Tx, user_ref: int, master: bytes) -> None:
    """Give a namespace its data key; raises ``ErasureInProgress`` while the user is being erased."""
    if records.erasure_of(tx.conn, user_ref) is not None:
        raise ErasureInProgress("this user's data is being erased; try again when the erasure has finished")
    if records.wrapped_key(tx.conn, user_ref) is None:
        records.insert_key(tx.conn, user_ref, wrap(master, new_data_key(), owner_tag(user_ref)))


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
            if records.meta(conn, "master_check") is not None:
                raise ConfigError(f"this store was made with a master key, but the master key file "
                                  f"{master_key_file(key_file)} does not exist: restore it, or name the right one "
                                  "(master_key_file / DSS_MASTER_KEY_FILE / DSS_MASTER_KEY)")
        master = create_master_key(key_file)
    with catalog.read() as conn:
        if records.meta(conn, "master_check") == master_check(master) and not records.users_without_key(conn):
            return master  # the usual case: nothing to write
    with catalog.write() as tx:
        check = records.meta(tx.conn, "master_check")
        if check is None:
            records.set_meta(tx.conn, "master_check", master_check(master))
        elif check != master_check(master):
            raise ConfigError("this store was made with another master key (master_key_file / "
                              "DSS_MASTER_KEY_FILE / DSS_MASTER_KEY): without it no page or history is readable")
        for user_ref in records.users_without_key(tx.conn):
            records.insert_key(tx.conn, user_ref, wrap(master, new_data_key(), owner_tag(user_ref)))
    return master
