"""Page ids: a keyed chain over namespace, layout and tokens, worked out by hand."""

from __future__ import annotations

import hashlib
import hmac

from dss.core.crypto import namespace_hash_key
from dss.core.hashing import chain_ids, chain_root, checksum
from dss.core.tokens import pack
from dss.core.types import Layout


def test_chain_by_hand() -> None:
    """key = HMAC-SHA256(data key, "dss-namespace-hash v1")
    root = BLAKE2b-128(key, "dss-page v1" + layout digest)
    id0  = BLAKE2b-128(key, root + tokens 0..1 as uint32 LE), id1 = BLAKE2b-128(key, id0 + tokens 2..3)
    """
    data_key = b"s" * 32
    key = hmac.new(data_key, b"dss-namespace-hash v1", hashlib.sha256).digest()
    assert namespace_hash_key(data_key) == key
    layout = Layout(name="l", page_tokens=2, page_bytes=4)
    root = hashlib.blake2b(b"dss-page v1" + layout.digest, key=key, digest_size=16).digest()
    assert chain_root(key, layout.digest) == root
    id0 = hashlib.blake2b(root + b"\x05\x00\x00\x00\x06\x00\x00\x00", key=key, digest_size=16).digest()
    id1 = hashlib.blake2b(id0 + b"\x07\x00\x00\x00\x08\x00\x00\x00", key=key, digest_size=16).digest()
    assert chain_ids(key, root, pack([5, 6, 7, 8, 9]), 0, 2, 2) == [id0, id1]
    assert chain_ids(key, id0, pack([5, 6, 7, 8, 9]), 1, 1, 2) == [id1]


def test_namespace_and_layout_change_every_id() -> None:
    buf = pack(list(range(8)))
    layouts = [Layout(name="l", page_tokens=4, page_bytes=4), Layout(name="l", page_tokens=4, page_bytes=4, v=2)]
    seen = set()
    for data_key in (b"a" * 32, b"b" * 32, b"c" * 32):
        key = namespace_hash_key(data_key)
        for layout in layouts:
            seen.update(chain_ids(key, chain_root(key, layout.digest), buf, 0, 2, 4))
    assert len(seen) == 12


def test_checksum_fits_a_signed_bigint() -> None:
    values = [checksum(bytes([i]) * 100) for i in range(200)]
    assert all(-(1 << 63) <= v < (1 << 63) for v in values) and len(set(values)) == 200
