"""The remote tier (:mod:`dss.tiers.remote`) on a real Redis and a real three-master Redis Cluster.

Every test runs on both (``remote_url``, see ``tests/conftest.py``), under a key prefix of
its own. In the cluster, a namespace's keys share one slot (the hash tag) and different
namespaces' keys lie on different masters: reads, deletions and scans must cross them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import pytest

from dss.tiers.remote import BREAKER_FAILURES, RemoteTier, key_of, pack_value, unpack_value
from tests import servers

NAMESPACES = 24
"""Namespaces per test: enough that their slots fall on every master of a three-master cluster."""


@pytest.fixture
def tier(remote_url: str) -> Iterator[RemoteTier]:
    """A remote tier under a prefix of this test's own (its keys are deleted afterwards)."""
    tier = RemoteTier(remote_url, prefix=f"t{uuid.uuid4().hex[:10]}:", timeout_s=0.5, max_pending_bytes=1 << 20)
    yield tier
    tier.close()
    servers.delete_prefix(remote_url, tier.prefix)


def tag(n: int) -> bytes:
    return n.to_bytes(12, "big")


def page_id(n: int, i: int) -> bytes:
    return bytes([n, i]) * 16


def value(n: int, i: int) -> bytes:
    return pack_value(n * 100 + i, 0, bytes([n, i]) * 40)


def written(tier: RemoteTier, pages: int = 3) -> list[str]:
    """Write ``pages`` pages of each of :data:`NAMESPACES` namespaces through the tier; their keys."""
    items = [(key_of(tier.prefix, tag(n), page_id(n, i)), value(n, i)) for n in range(NAMESPACES) for i in range(pages)]
    tier.put(items)
    assert tier.flush()
    return [key for key, _ in items]


def masters_of(remote_url: str, keys: list[str]) -> set[str]:
    """The masters holding ``keys`` (one name for a single Redis)."""
    client = servers.redis_client(remote_url)
    try:
        if "+cluster://" not in remote_url:
            return {"single"}
        return {client.get_node_from_key(key).name for key in keys}
    finally:
        client.close()


def test_pages_written_through_are_read_back_in_one_call_across_slots(tier: RemoteTier, remote_url: str) -> None:
    keys = written(tier)
    if tier.is_cluster:
        client = servers.redis_client(remote_url)
        slots = [client.keyslot(key) for key in keys]
        client.close()
        assert all(len(set(slots[n * 3 : n * 3 + 3])) == 1 for n in range(NAMESPACES))  # a namespace: one slot
        assert len(masters_of(remote_url, keys)) == 3  # the namespaces: every master
    missing = key_of(tier.prefix, tag(99), page_id(99, 0))
    wanted = [*reversed(keys), missing]
    got = tier.get(wanted)
    assert got == [*(value(n, i) for n in reversed(range(NAMESPACES)) for i in reversed(range(3))), None]
    assert unpack_value(got[0]) == ((NAMESPACES - 1) * 100 + 2, 0, bytes([NAMESPACES - 1, 2]) * 40)
    assert tier.is_up and tier.errors == dict.fromkeys(tier.errors, 0) and tier.pending_bytes == 0


def test_a_missing_key_is_a_miss(tier: RemoteTier, remote_url: str) -> None:
    keys = written(tier, pages=2)
    client = servers.redis_client(remote_url)
    client.delete(keys[0])  # evicted by Redis, say
    client.close()
    assert tier.get(keys[:3]) == [None, value(0, 1), value(1, 0)]
    assert tier.is_up and tier.errors["get"] == 0


def test_delete_and_scan_cover_every_master(tier: RemoteTier, remote_url: str) -> None:
    keys = written(tier)
    assert len(masters_of(remote_url, keys)) == (3 if tier.is_cluster else 1)
    assert sorted(tier.scan(f"{tier.prefix}*")) == sorted(k.encode() for k in keys)
    assert sorted(tier.scan(tier.namespace_pattern(tag(5)))) == sorted(k.encode() for k in keys[15:18])
    assert tier.delete(keys[:30] + [key_of(tier.prefix, tag(99), page_id(99, 0))]) == 30
    assert sorted(tier.scan(f"{tier.prefix}*")) == sorted(k.encode() for k in keys[30:])
    assert tier.delete(keys) == len(keys) - 30
    assert list(tier.scan(f"{tier.prefix}*")) == []


def test_a_deletion_is_done_after_the_writes_queued_before_it(tier: RemoteTier) -> None:
    first, second = key_of(tier.prefix, tag(1), page_id(1, 0)), key_of(tier.prefix, tag(2), page_id(2, 0))
    tier.put([(first, value(1, 0)), (second, value(2, 0))])
    tier.drop([first, key_of(tier.prefix, tag(3), page_id(3, 0))])
    tier.put([(first, value(1, 1))])
    tier.drop([second])
    assert tier.flush()
    assert tier.get([first, second]) == [value(1, 1), None]
    assert tier.pending_bytes == 0 and tier.errors == dict.fromkeys(tier.errors, 0)


def test_a_stopped_cluster_master_opens_the_breaker_and_the_tier_recovers(
    redis_cluster: servers.RedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Reads that need the stopped master miss (no error), writes wait; once it is back (empty:
    no persistence) the waiting writes land and reads hit again."""
    tier = RemoteTier(redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:10]}:", timeout_s=0.5, max_pending_bytes=1 << 20)
    caplog.set_level(logging.INFO, logger="dss.tiers.remote")
    try:
        keys = written(tier, pages=1)
        stopped = 1
        client = servers.redis_client(redis_cluster.url)
        on_stopped = [k for k in keys if client.get_node_from_key(k).port == redis_cluster.ports[stopped]]
        client.close()
        assert on_stopped
        redis_cluster.stop_node(stopped)
        try:
            for _ in range(BREAKER_FAILURES):
                assert tier.get(keys) == [None] * len(keys)
            assert not tier.is_up and tier.errors["get"] == BREAKER_FAILURES
            started = time.monotonic()
            assert tier.get(keys) == [None] * len(keys)  # the breaker is open: no connection attempt
            assert time.monotonic() - started < 0.05 and tier.errors["get"] == BREAKER_FAILURES
            tier.put([(on_stopped[0], b"again")])
            assert not tier.flush(0.5) and tier.pending_bytes == len(b"again")
        finally:
            redis_cluster.start_node(stopped)
            redis_cluster.wait_ok()
        assert tier.flush(20)
        deadline = time.monotonic() + 20
        while tier.get(on_stopped[:1]) != [b"again"]:
            assert time.monotonic() < deadline, "the tier did not recover"
            time.sleep(0.1)
        assert tier.is_up
        assert [v for k, v in zip(keys, tier.get(keys)) if k not in on_stopped] == [
            value(n, 0) for n, k in enumerate(keys) if k not in on_stopped
        ]  # the other masters kept theirs
        messages = [r.getMessage() for r in caplog.records]
        assert sum("remote tier unreachable (get" in m for m in messages) == 1
        assert "remote tier reachable again" in messages
    finally:
        tier.close()
        servers.delete_prefix(redis_cluster.url, tier.prefix)
