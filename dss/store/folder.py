"""The store folder and its catalog: each folder is one node of the catalog, opened under a lock.

A store folder holds the page files of one node; the catalog records where they are, on
which node. Every folder keeps a random id (the file ``store-id``); the catalog registers
each folder as a node (table ``nodes``: the folder's id and a name, ``node_id``). The first
folder a catalog is opened with becomes its first node. Another folder joins only when its
opener names it (the ``node_id`` setting): a folder opened on some other store's catalog by
mistake is refused, not silently made a second node.

Opening a folder touches the file system; every failure there (a read-only file system, a
missing permission, a file where a folder should be) is a ``StoreFolderError`` naming the path
and the cause (:func:`file_errors`). :func:`has_store` tells whether a folder holds a store, for
openers that must not make one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from dss.catalog import nodes
from dss.catalog.database import Catalog, DuplicateRow
from dss.catalog.urls import sqlite_file
from dss.core.errors import ConfigError, StoreFolderError

ID_FILE = "store-id"
_TAG = "dss-store-id v1"


@contextmanager
def file_errors(action: str, path: Path) -> Iterator[None]:
    """Raise an ``OSError`` of the block as ``StoreFolderError``: ``cannot <action> <path>:
    <cause>``, the path being the one the failing call named (else ``path``)."""
    try:
        yield
    except OSError as exc:
        where = exc.filename if exc.filename is not None else path
        raise StoreFolderError(f"cannot {action} {where}: {exc.strerror or exc}") from None


def has_store(home: Path, catalog_url: str) -> bool:
    """Whether a store is at ``home``: the folder exists and, for a SQLite catalog, so does its
    database file (a folder without it holds no sessions). Creates nothing."""
    file = sqlite_file(catalog_url)
    return home.is_dir() and (file is None or file.is_file())


def open_catalog_file(url: str) -> None:
    """Make sure a SQLite catalog's file can be opened for writing (creating it if missing), so
    a read-only file system or a folder in its place is a ``StoreFolderError`` naming the file,
    not SQLite's "unable to open database file". Does nothing for other databases."""
    file = sqlite_file(url)
    if file is None:
        return
    with file_errors("open the catalog file", file):
        if file.is_file():
            # never open and close a catalog file that exists: closing any descriptor of it drops
            # the POSIX locks this process's SQLite connections hold on it
            if not os.access(file, os.R_OK | os.W_OK):
                raise PermissionError(errno.EACCES, "the file is not readable and writable")
            if not os.access(file.parent, os.W_OK | os.X_OK):  # SQLite makes its journal beside it
                raise PermissionError(errno.EACCES, "its folder is not writable")
            return
        os.close(os.open(file, os.O_CREAT | os.O_RDWR, 0o600))


@contextmanager
def folder_lock(home: Path) -> Iterator[None]:
    """Serialise store initialisation (schema, master key, store id) between processes."""
    with file_errors("open the lock file", home / ".lock"):
        fd = os.open(home / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Node(NamedTuple):
    """This folder as a node of its catalog: its row number and its name."""

    ref: int
    node_id: str


def adopt_folder(catalog: Catalog, home: Path, node_id: str | None = None) -> Node:
    """This folder's node, registered on first use; refuse a folder that was not asked to join.

    Call under :func:`folder_lock`. Raises ``ConfigError`` when the catalog belongs to other
    folders and ``node_id`` is not given, when ``node_id`` names another folder's node, or
    when this folder is a node of another name.
    """
    mine = _read_id(home)
    with catalog.read() as conn:
        known = nodes.all_nodes(conn)
    for node in known:
        if node.folder_id == mine:
            if node_id is not None and node_id != node.node_id:
                raise ConfigError(
                    f"the store folder {home} is node {node.node_id!r} of its catalog, not "
                    f"{node_id!r}: leave node_id unset or set it to {node.node_id!r}"
                )
            return Node(node.ref, node.node_id)
    if node_id is None and known:
        raise ConfigError(
            f"the catalog {catalog.url} belongs to another store folder (store id {known[0].folder_id.hex()}), "
            f"not to {home}" + (f" (store id {mine.hex()})" if mine else "") + ": one folder per catalog — open "
            "the store with its own folder (home=...), give this folder a catalog of its own, or set node_id to "
            "join it as another node of a fleet"
        )
    if node_id is not None and any(node.node_id == node_id for node in known):
        raise ConfigError(
            f"node id {node_id!r} is taken by another store folder of this catalog: give each node a name of its own"
        )
    if mine is None:
        mine = _write_id(home)
    try:
        with catalog.write() as tx:
            if node_id is not None or not nodes.all_nodes(tx.conn):  # writers are serialised: no race here
                nodes.insert_node(tx.conn, node_id or mine.hex()[:16], mine)
    except DuplicateRow:
        pass  # another folder took the name meanwhile, or the first node's place: check again
    return adopt_folder(catalog, home, node_id)


def _read_id(home: Path) -> bytes | None:
    try:
        text = (home / ID_FILE).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreFolderError(f"cannot read the store id file {home / ID_FILE}: {exc.strerror or exc}") from None
    tag, _, value = text.partition("\n")
    try:
        if tag == _TAG and len(bytes.fromhex(value.strip())) == 16:
            return bytes.fromhex(value.strip())
    except ValueError:
        pass
    raise ConfigError(f"{home / ID_FILE} is damaged: it should hold '{_TAG}' and a store id")


def _write_id(home: Path) -> bytes:
    """Publish a new store id in the folder atomically (temp file, fsync, rename, fsync of the folder);
    ``StoreFolderError`` when the folder cannot be written."""
    try:
        return _publish_id(home)
    except OSError as exc:
        raise StoreFolderError(f"cannot write the store id file {home / ID_FILE}: {exc.strerror or exc}") from None


def _publish_id(home: Path) -> bytes:
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
