"""Load or recompute (``ResumeResult.decision``): the estimates from each tier's speed against
the store's prefill speed or one the caller measured; nothing matched is never loaded."""

from __future__ import annotations

import pytest

from dss import LoadDecision
from dss.core.types import PageId, PageRef, VersionId
from dss.sessions.resume import Rates, ResumeResult

RATES = Rates({"host": 8e9, "disk": 1e9}, 4000.0)
PAGE_TOKENS, PAGE_BYTES = 32, 32 * 23040  # SmolLM2-135M: 23,040 bytes of KV per token


def result(tiers: list[str], rates: Rates | None = RATES) -> ResumeResult:
    pages = [PageRef(i, PageId(bytes([i]) * 16), tier) for i, tier in enumerate(tiers)]
    n = len(tiers) * PAGE_TOKENS
    return ResumeResult("s", VersionId(1), n, n + 1, n, PAGE_TOKENS, PAGE_BYTES, pages=pages, rates=rates)


def test_a_cpu_prefill_speed_loads_a_gpu_like_one_recomputes_from_disk() -> None:
    r = result(["disk"] * 128)  # 4,096 tokens, 94 MB
    cpu = r.decision()
    assert cpu == (True, pytest.approx(0.09437184), pytest.approx(1.024), 4000.0)
    assert r.should_load and r.load_seconds == cpu.load_seconds and r.recompute_seconds == cpu.recompute_seconds
    gpu = r.decision(400_000.0)
    assert gpu == (False, pytest.approx(0.09437184), pytest.approx(0.01024), 400_000.0)
    host = result(["host"] * 128).decision(400_000.0)  # 94 MB at 8 GB/s: 11.8 ms against 10.2 ms
    assert host.load is False and host.load_seconds == pytest.approx(0.01179648)
    assert result(["host"] * 128).decision(300_000.0).load is True  # 13.7 ms of prefill


def test_a_part_of_the_match_is_decided_by_its_own_tiers() -> None:
    r = result(["disk"] * 4)
    part = r.decision(4000.0, tiers={"host": 64, "disk": 32})
    assert part.load and part.recompute_seconds == pytest.approx(96 / 4000)
    assert part.load_seconds == pytest.approx(64 * 23040 / 8e9 + 32 * 23040 / 1e9)
    assert r.decision(tiers={}).load is False
    assert result([]).decision() == LoadDecision(False, 0.0, 0.0, 4000.0)


def test_pages_on_the_engines_device_cost_nothing_to_load() -> None:
    assert result(["device"] * 2).decision(1e9) == (True, 0.0, pytest.approx(64 / 1e9), 1e9)


def test_without_speeds_whatever_matched_is_loaded() -> None:
    assert result(["disk"], rates=None).decision() == LoadDecision(True, 0.0, 0.0, 0.0)
    assert result([], rates=None).should_load is False
