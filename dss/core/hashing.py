"""Page ids (keyed chain hashes of a namespace's token runs) and payload checksums.

A page id is a keyed chain hash::

    root     = BLAKE2b-128(key=namespace_key, "dss-page v1" || layout.digest)
    id(k)    = BLAKE2b-128(key=namespace_key, id(k-1) || tokens of page k)     (id(-1) = root)

so it depends on the namespace, the layout and every token up to and including page k.
Identical prefixes of one namespace therefore share pages, and nothing is shared across
namespaces or layouts. The namespace key is derived from the namespace's data key
(:func:`dss.core.crypto.namespace_hash_key`), so nobody without it can compute (or probe for) a
page id, and once the data key is destroyed no page id can be linked to any tokens.
Payload checksums are XXH3-64.
"""

from __future__ import annotations

import hashlib

import xxhash

from dss.core.tokens import TOKEN_BYTES
from dss.core.types import PageId

PAGE_ID_BYTES = 16
_ROOT_TAG = b"dss-page v1"


def chain_root(key: bytes, layout_digest: bytes) -> PageId:
    """The id before page 0 of every prompt in this namespace and layout."""
    return PageId(hashlib.blake2b(_ROOT_TAG + layout_digest, key=key, digest_size=PAGE_ID_BYTES).digest())


def chain_ids(
    key: bytes, prev: PageId, buf: bytes | memoryview, first: int, count: int, page_tokens: int
) -> list[PageId]:
    """Ids of pages ``first .. first+count-1`` of the packed tokens ``buf``.

    ``prev`` is the id of page ``first-1`` (or the chain root when ``first == 0``). The
    caller guarantees ``buf`` holds at least ``(first+count) * page_tokens`` tokens.
    """
    step = page_tokens * TOKEN_BYTES
    out: list[PageId] = []
    blake = hashlib.blake2b
    for k in range(first, first + count):
        prev = PageId(blake(prev + buf[k * step : (k + 1) * step], key=key, digest_size=PAGE_ID_BYTES).digest())
        out.append(prev)
    return out


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of a payload, as a signed 64-bit int (it fits a SQL BIGINT)."""
    value = xxhash.xxh3_64_intdigest(payload)
    return value - (1 << 64) if value >= 1 << 63 else value
