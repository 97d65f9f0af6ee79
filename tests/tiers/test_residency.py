"""The device tier: which pages engine instances hold in their own memory, per process.

Unit tests of :class:`dss.tiers.device.Residency` on a hand-driven clock, then the store's API:
``resume`` reports pages an engine holds as ``device`` (only those host or disk holds too),
every store of the process on the same catalog sees the same engines, ``residency`` counts a
session's head pages per engine, and an engine that goes away (or stops reporting) no longer
counts.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import dss
from dss.core.types import PageId
from dss.tiers.device import Residency

LAYOUT = dss.Layout(name="device", page_tokens=4, page_bytes=64, model="tiny", dtype="int8")
T = list(range(300, 320))  # 5 pages
P = [PageId(bytes([i]) * 16) for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_marks_evictions_and_leases() -> None:
    clock = Clock()
    device = Residency(ttl_s=10, clock=clock)
    device.mark("e1", P[:3])
    device.mark("e2", P[2:])
    assert device.holders(P) == {"e1": 3, "e2": 2}
    assert set(device.held) == set(P)
    version = device.version
    device.mark("e1", P[:1])  # already held: nothing changes
    assert device.version == version
    device.evict("e1", [P[0], P[3]])  # P[3] was never e1's
    assert device.holders(P) == {"e1": 2, "e2": 2} and device.version == version + 1
    clock.now = 8
    device.mark("e2", [])  # a lease renewed, nothing else
    clock.now = 15  # e1 was last heard of at 0
    assert device.engines() == {"e2": 2}
    assert set(device.held) == {P[2], P[3]}
    assert device.forget("e2") == 2 and device.forget("e2") == 0
    assert device.holders(P) == {} and device.held == {}
    device.evict("nobody", P)  # an unknown engine: nothing


def build(store: dss.Store) -> list[PageId]:
    store.create_session("s", layout=LAYOUT)
    store.commit("s", T, {i: bytes([i + 1]) * 64 for i in range(5)})
    return [PageId(p.page_id) for p in store.resume("s", T).pages]


def test_resume_reports_pages_an_engine_holds_as_device(tmp_path: Path) -> None:
    with dss.open(tmp_path / "s") as store, dss.open(tmp_path / "s") as other:
        ids = build(store)
        assert store.resume("s", T).tiers == {"host": 20}
        store.mark_resident("engine-a", ids[:3])
        store.mark_resident("engine-b", ids[2:4])
        result = store.resume("s", T)
        assert result.tiers == {"device": 16, "host": 4}
        assert [p.tier for p in result.pages] == ["device"] * 4 + ["host"]
        assert result.load_seconds == pytest.approx(64 / (8.0 * 1e9))  # device pages cost no load
        assert other.resume("s", T).tiers == {"device": 16, "disk": 4}  # the same engines, this process
        assert other.residency("s") == {"engine-a": 3, "engine-b": 2}
        store.evicted("engine-a", ids[:1])
        assert other.resume("s", T).tiers == {"disk": 8, "device": 12} and other.residency("s") == {
            "engine-a": 2,
            "engine-b": 2,
        }
        assert other.forget_engine("engine-a") == 2
        assert store.resume("s", T).tiers == {"host": 12, "device": 8}
        assert store.residency("s") == {"engine-b": 2}
        assert store.check() == [] and other.check() == []


def test_a_page_only_an_engine_holds_is_no_match(tmp_path: Path) -> None:
    with dss.open(tmp_path / "s", disk_bytes=400) as store:  # the disk tier cannot take the pages
        store.create_session("s", layout=LAYOUT)
        store.commit("s", T, {i: bytes([i + 1]) * 64 for i in range(5)})
        ids = [PageId(p.page_id) for p in store.resume("s", T).pages]
        assert len(ids) == 5  # in host only
        store.mark_resident("engine-a", ids)
        store.host.discard(ids[3:])  # gone from every tier of the store, still in the engine
        store.index.forget(ids[3:])
        assert store.resume("s", T).tiers == {"device": 12}
        assert store.residency("s") == {"engine-a": 3}


def test_an_engine_that_stops_reporting_is_forgotten(tmp_path: Path) -> None:
    with dss.open(tmp_path / "s", residency_ttl_s=0.2) as store:
        ids = build(store)
        store.mark_resident("engine-a", ids)
        assert store.residency("s") == {"engine-a": 5}
        time.sleep(0.3)
        assert store.residency("s") == {}
        assert store.resume("s", T).tiers == {"host": 20}


def test_a_session_without_versions_has_no_residency(tmp_path: Path) -> None:
    with dss.open(tmp_path / "s") as store:
        store.create_session("empty", layout=LAYOUT)
        assert store.residency("empty") == {}
        with pytest.raises(dss.UnknownSession):
            store.residency("nope")


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), "soon"])
def test_a_nonsensical_lease_is_a_config_error(tmp_path: Path, ttl: object) -> None:
    with pytest.raises(dss.ConfigError, match="residency_ttl_s"):
        dss.open(tmp_path / "s", residency_ttl_s=ttl)
