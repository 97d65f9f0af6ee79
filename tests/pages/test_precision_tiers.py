"""Tiers kept at a lower precision: opt-in per tier, recorded per copy, announced in every resume.

Layout: 2 layers, 1 KV head, head size 32, 4 tokens a page, bf16: a page is 2 x 2 x 4 x 32 x 2 =
1024 bytes exact; int8 is the 20-byte header plus 16 rows x (32 + 2) = 564 bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dss
from dss.core import packing
from tests import servers

FORMAT = "[layers][k,v]x[kv_heads,page_tokens,head_dim]"
LAYOUT = dss.Layout("transformers", 4, 1024, dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=32, format=FORMAT)
SHAPE = packing.shape_of(LAYOUT)
TOKENS = list(range(100, 109))  # two full pages and one token


def kv(seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(512).astype(ml_dtypes.bfloat16).tobytes()


PAGES = {0: kv(0), 1: kv(1)}


def save(store: dss.Store) -> None:
    store.create_session("s", tenant_id="t", user_id="u", layout=LAYOUT)
    store.save_pages("s", TOKENS, PAGES, tenant_id="t")
    store.commit("s", TOKENS, tenant_id="t")


def test_every_tier_exact_by_default_serves_the_saved_bytes(open_store: Callable[..., dss.Store]) -> None:
    store = open_store()
    save(store)
    r = store.resume("s", TOKENS, tenant_id="t")
    assert (r.matched_tokens, r.encodings, r.lossy_tokens) == (8, {}, 0)
    assert store.read_pages(r.pages) == [PAGES[0], PAGES[1]]
    assert store.sql("SELECT tier, encoding, num_pages FROM tier_encodings").rows == [("disk", "exact", 2)]


def test_int8_disk_is_recorded_and_announced_once_host_lets_go(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(disk_precision="int8")
    save(store)
    assert store.check() == []
    assert store.sql("SELECT tier, encoding, num_pages, bytes FROM tier_encodings").rows == [
        ("disk", "int8", 2, 2 * (32 + 564 + 28))
    ]  # records: header, page, seal
    assert store.sql("SELECT size FROM pages").rows == [(564,), (564,)]
    hot = store.resume("s", TOKENS, tenant_id="t")
    assert hot.tiers == {"host": 8} and hot.encodings == {}  # host keeps the exact copy it was given
    assert store.read_pages(hot.pages) == [PAGES[0], PAGES[1]]
    other = open_store(disk_precision="int8")  # another process: nothing in its host tier yet
    cold = other.resume("s", TOKENS, tenant_id="t")
    assert cold.tiers == {"disk": 8}
    assert (cold.encodings, cold.lossy_tokens) == ({"int8": 8}, 8)
    read = other.read_pages(cold.pages)
    assert [packing.encoding_of(p) for p in read if p is not None] == ["int8", "int8"]
    for payload, exact in zip(read, (PAGES[0], PAGES[1])):
        assert payload is not None
        back = packing.decode(payload, SHAPE).astype(np.float32).ravel()
        want = np.frombuffer(exact, dtype=ml_dtypes.bfloat16).astype(np.float32)
        assert np.abs(back - want).max() <= np.abs(want).max() / 127 + 0.05
    again = other.resume("s", TOKENS, tenant_id="t")
    assert again.tiers == {"host": 8} and again.encodings == {"int8": 8}  # promoted: never gains precision
    assert other.check() == []


def test_lossy_host_is_announced_at_once(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(host_precision="k8v4")
    save(store)
    assert (store.stats()["host"]["precision"], store.stats()["disk"]["precision"]) == ("k8v4", "exact")
    r = store.resume("s", TOKENS, tenant_id="t")
    assert (r.tiers, r.encodings) == ({"host": 8}, {"k8v4": 8})
    assert [packing.encoding_of(p) for p in store.read_pages(r.pages) if p is not None] == ["k8v4", "k8v4"]
    assert store.sql("SELECT encoding FROM page_locations").rows == [("exact",), ("exact",)]
    assert store.check() == []


def test_pages_of_opaque_layouts_stay_exact(open_store: Callable[..., dss.Store]) -> None:
    store = open_store(disk_precision="int8", host_precision="int8")
    opaque = dss.Layout("opaque", 4, 1024)
    store.create_session("o", tenant_id="t", user_id="u", layout=opaque)
    store.save_pages("o", TOKENS, PAGES, tenant_id="t")
    r = store.resume("o", TOKENS, tenant_id="t")
    assert r.encodings == {} and store.read_pages(r.pages) == [PAGES[0], PAGES[1]]
    assert store.sql("SELECT encoding FROM tier_encodings").rows == [("exact",)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"disk_precision": "int4"}, "disk_precision: Input should be 'exact', 'int8', 'fp8' or 'k8v4'"),
        ({"remote_precision": "int8"}, r"remote_precision \(int8\) is lossier than disk_precision \(exact\)"),
    ],
)
def test_bad_precision_settings(open_store: Callable[..., dss.Store], options: dict, message: str) -> None:
    with pytest.raises(dss.ConfigError, match=message):
        open_store(**options)


def test_the_remote_tier_holds_the_disk_copy_and_another_node_reads_it_lossy(
    tmp_path: Path, pg_url: str, redis_url: str
) -> None:
    """Node a keeps int8 on disk; its pages reach Redis as the disk copy; node b (another folder,
    the same catalog and Redis) resumes them from the remote tier, announced int8."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    common = {"catalog_url": pg_url, "remote_url": redis_url, "remote_prefix": prefix, "mover": False}
    try:
        with dss.open(tmp_path / "a", node_id="node-a", disk_precision="int8", remote_precision="int8", **common) as a:
            save(a)
            disk_copies = a.read_pages(a.resume("s", TOKENS, tenant_id="t").pages)
        with dss.open(tmp_path / "b", node_id="node-b", **common) as b:
            r = b.resume("s", TOKENS, tenant_id="t")
            assert (r.tiers, r.encodings) == ({"remote": 8}, {"int8": 8})
            read = b.read_pages(r.pages)
            assert [packing.encoding_of(p) for p in read if p is not None] == ["int8", "int8"]
            assert b.check() == []
        assert [packing.encoding_of(p) for p in disk_copies if p is not None] == ["exact", "exact"]  # a's host copies
    finally:
        servers.delete_prefix(redis_url, prefix)
