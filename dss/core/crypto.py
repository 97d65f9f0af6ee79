"""Keys and encryption at rest (crypto-shredding).

Every namespace (one user of one tenant) has a random 256-bit **data key**. Its pages on
disk and its token histories in the catalog are sealed with AES-256-GCM under that key,
and its page ids are hashed with a key derived from it (:func:`namespace_hash_key`). The
data key is stored only wrapped (AES-256-GCM) under the store's **master key**, which lives
outside the store folder (config ``master_key_file``, ``DSS_MASTER_KEY_FILE``, or
``DSS_MASTER_KEY`` as 64 hex digits). Destroying a user's wrapped data key therefore makes
every copy of their data that could not be deleted at once — unreclaimed file space, a
backup, a replica — unreadable, and their page ids unlinkable to any tokens.

Session ids and version labels are sealed the same way; the catalog finds a session by a
keyed hash of its id (:func:`session_key`, keyed by a key derived from the master key).

Sealed format: 12-byte random nonce, then ciphertext and 16-byte tag; the associated data
binds a sealed blob to where it belongs (a page id, a session), so blobs cannot be swapped.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dss.core.errors import ConfigError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
"""Bytes a sealed blob has beyond its plaintext."""


class SealError(Exception):
    """A sealed blob failed authentication: corrupt, swapped, or sealed under another key."""


class Sealer:
    """AES-256-GCM under one key."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("AES-256 keys are 32 bytes")
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, aad)

    def seal_into(self, plaintext: bytes | memoryview, aad: bytes, blob: bytearray | None = None) -> bytearray:
        """:meth:`seal` for large payloads: encrypted straight into ``blob`` (reused when it
        has the right size, so its memory is not faulted in again), no copy after."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        if blob is None or len(blob) != len(plaintext) + OVERHEAD:
            blob = bytearray(len(plaintext) + OVERHEAD)
        blob[:NONCE_BYTES] = nonce
        self._aead.encrypt_into(nonce, plaintext, aad, memoryview(blob)[NONCE_BYTES:])
        return blob

    def open(self, blob: bytes | memoryview, aad: bytes) -> bytes:
        """The plaintext of a sealed blob; raises :class:`SealError` if it does not authenticate."""
        view = memoryview(blob)
        if len(view) < OVERHEAD:
            raise SealError("sealed blob is too short")
        try:
            return self._aead.decrypt(bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], aad)
        except InvalidTag:
            raise SealError("sealed blob does not authenticate") from None

    def open_into(self, blob: bytes | memoryview, aad: bytes, into: memoryview) -> memoryview:
        """:meth:`open` for large payloads: the plaintext decrypted straight into ``into``
        (exactly the plaintext's size; ``ValueError`` otherwise), no copy after; returns
        ``into``. Raises :class:`SealError` if the blob does not authenticate (``into`` then
        holds garbage, never a plaintext that failed)."""
        view = memoryview(blob)
        if len(view) < OVERHEAD:
            raise SealError("sealed blob is too short")
        if len(into) != len(view) - OVERHEAD:
            raise ValueError(f"the plaintext has {len(view) - OVERHEAD} bytes; the buffer {len(into)}")
        try:
            self._aead.decrypt_into(bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], aad, into)
        except InvalidTag:
            raise SealError("sealed blob does not authenticate") from None
        return into


def new_data_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def wrap(master: bytes, data_key: bytes, owner: bytes) -> bytes:
    """The data key sealed under the master key, bound to its owner (the namespace)."""
    return Sealer(master).seal(data_key, b"dss-data-key v1\0" + owner)


def unwrap(master: bytes, wrapped: bytes, owner: bytes) -> bytes:
    """The data key of ``owner``; raises :class:`SealError` under a wrong master key."""
    return Sealer(master).open(wrapped, b"dss-data-key v1\0" + owner)


def namespace_hash_key(data_key: bytes) -> bytes:
    """The key of a namespace's page-id chain, derived from its data key (HMAC-SHA256)."""
    return hmac.new(data_key, b"dss-namespace-hash v1", hashlib.sha256).digest()


def session_lookup_key(master: bytes) -> bytes:
    """The key of session-id hashes, derived from the master key (HMAC-SHA256)."""
    return hmac.new(master, b"dss-session-lookup v1", hashlib.sha256).digest()


def session_key(lookup_key: bytes, session_id: str) -> bytes:
    """What the catalog finds a session by: a keyed hash of its id (16 bytes, BLAKE2b).

    The id itself is stored only sealed under the owner's data key; this hash reveals
    nothing about it without the master key.
    """
    return hashlib.blake2b(session_id.encode(), key=lookup_key, digest_size=16).digest()


def master_check(master: bytes) -> bytes:
    """A value the catalog keeps to recognise its master key (reveals nothing about it)."""
    return hmac.new(master, b"dss-master-check v1", hashlib.sha256).digest()


DEFAULT_MASTER_KEY_FILE = Path("~/.config/dss/master.key")


def master_key_file(path: Path | None) -> Path:
    """The master key file to use (``path``, else the default), as an absolute path."""
    return (path or DEFAULT_MASTER_KEY_FILE).expanduser().resolve()


def read_master_key(path: Path | None, store_folder: Path, hex_value: str | None = None) -> bytes | None:
    """The master key: from ``hex_value`` (``DSS_MASTER_KEY``), else from the key file at
    ``path``; ``None`` when that file does not exist yet (:func:`create_master_key` makes it).

    Refuses (``ConfigError``) a malformed hex value, a key file inside the store folder (the
    key must never sit next to the data it protects), a folder or an unreadable file in its
    place, and a file that does not hold exactly 32 bytes. Creates nothing.
    """
    if hex_value:
        try:
            key = bytes.fromhex(hex_value)
        except ValueError:
            raise ConfigError("DSS_MASTER_KEY must be 64 hexadecimal digits") from None
        if len(key) != KEY_BYTES:
            raise ConfigError("DSS_MASTER_KEY must be 64 hexadecimal digits (32 bytes)")
        return key
    file = master_key_file(path)
    folder = store_folder.expanduser().resolve()
    if file == folder or folder in file.parents:
        raise ConfigError(
            f"the master key file {file} lies inside the store folder {folder}: keep it elsewhere "
            "(master_key_file / DSS_MASTER_KEY_FILE)"
        )
    if file.is_dir():
        raise ConfigError(
            f"the master key file {file} is a folder: name a file (master_key_file / DSS_MASTER_KEY_FILE)"
        )
    try:
        key = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the master key file {file}: {exc.strerror}") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the master key file {file} must hold exactly 32 bytes")
    return key


def create_master_key(path: Path | None) -> bytes:
    """Publish a new random master key at the key file (mode 0600, atomically: a complete file
    or none; if another process published one first, that one wins) and return the key the
    file holds. Raises ``ConfigError`` when the file cannot be made."""
    file = master_key_file(path)
    try:
        _create_key_file(file)
        key = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot create the master key file {file}: {exc.strerror or exc}") from None
    if len(key) != KEY_BYTES:
        raise ConfigError(f"the master key file {file} must hold exactly 32 bytes")
    return key


def _create_key_file(file: Path) -> None:
    """Publish a new random key at ``file`` atomically (a complete file or none; first one wins)."""
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = file.with_name(f".{file.name}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, new_data_key())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, file)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
