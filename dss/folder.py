"""The store folder and its catalog: one folder per catalog, opened under a lock.

A store folder holds the page files; its catalog records where they are. Two folders on one
catalog would each find the other's files missing and quarantine their pages, so the first
folder a catalog is opened with becomes its folder: both keep a random store id (the file
``store-id`` in the folder, ``store_id`` in the catalog's ``store_meta``), and a folder whose
id differs, or a new folder, is refused at open. (Several nodes sharing one catalog is the
fleet's business, not this module's.)
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dss.catalog import namespaces
from dss.catalog.database import Catalog
from dss.core.errors import ConfigError

ID_FILE = "store-id"
_TAG = "dss-store-id v1"


@contextmanager
def folder_lock(home: Path) -> Iterator[None]:
    """Serialise store initialisation (schema, master key, store id) between processes."""
    fd = os.open(home / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def adopt_folder(catalog: Catalog, home: Path) -> None:
    """Bind the folder and the catalog to each other on first use; refuse another folder.

    Call under :func:`folder_lock`. Raises ``ConfigError`` when the catalog belongs to
    another folder (or the folder to another catalog).
    """
    mine = _read_id(home)
    with catalog.read() as conn:
        theirs = namespaces.meta(conn, "store_id")
    if theirs is not None and mine == theirs:
        return
    if theirs is not None:
        raise ConfigError(
            f"the catalog {catalog.url} belongs to another store folder (store id {theirs.hex()}), not to {home}"
            + (f" (store id {mine.hex()})" if mine else "") + ": one folder per catalog — open the store with "
            "its own folder (home=...), or give this folder a catalog of its own")
    if mine is None:
        mine = _write_id(home)
    with catalog.write() as tx:
        if namespaces.meta(tx.conn, "store_id") is None:
            namespaces.set_meta(tx.conn, "store_id", mine)
    adopt_folder(catalog, home)  # another folder may have won the race: check again


def _read_id(home: Path) -> bytes | None:
    try:
        text = (home / ID_FILE).read_text()
    except FileNotFoundError:
        return None
    tag, _, value = text.partition("\n")
    try:
        if tag == _TAG and len(bytes.fromhex(value.strip())) == 16:
            return bytes.fromhex(value.strip())
    except ValueError:
        pass
    raise ConfigError(f"{home / ID_FILE} is damaged: it should hold '{_TAG}' and a store id")


def _write_id(home: Path) -> bytes:
    """Publish a new store id in the folder atomically (temp file, fsync, rename, fsync of the folder)."""
    value = secrets.token_bytes(16)
    tmp = home / f".{ID_FILE}.{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, f"{_TAG}\n{value.hex()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, home / ID_FILE)
    dir_fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return value
