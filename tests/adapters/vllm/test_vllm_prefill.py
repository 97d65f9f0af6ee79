"""The engine's prefill speed as the connector measures it: prefill steps only (enough tokens,
no synchronous load), each timed until its own output came back, averaged; a set speed wins."""

from __future__ import annotations

import pytest
from dss_adapters.vllm.prefill import MIN_TOKENS, PrefillSpeed


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefill_steps_are_measured_and_averaged() -> None:
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    assert speed.tokens_per_s is None
    speed.step_started(4096, loads_sync=False)
    clock.now = 2.0
    speed.step_over()
    speed.step_over()  # no step in flight: nothing
    assert (speed.tokens_per_s, speed.samples) == (2048.0, 1)
    speed.step_started(1024, loads_sync=False)
    clock.now = 2.1
    speed.step_started(1, loads_sync=False)  # scheduled before the previous step is done
    clock.now = 2.25
    speed.step_over()  # the 1024-token step's output: 0.25 s
    assert speed.tokens_per_s == pytest.approx(0.3 * 4096 + 0.7 * 2048)
    clock.now = 3.0
    speed.step_over()  # the 1-token step's output: a decode step, not a sample
    assert speed.samples == 2


def test_decode_steps_and_steps_that_load_are_not_samples() -> None:
    clock = Clock()
    speed = PrefillSpeed(clock=clock)
    speed.step_started(MIN_TOKENS - 1, loads_sync=False)
    clock.now = 1.0
    speed.step_started(4096, loads_sync=True)
    clock.now = 5.0
    speed.step_over()
    assert (speed.tokens_per_s, speed.samples) == (None, 0)


def test_a_set_speed_is_used_whatever_is_measured() -> None:
    clock = Clock()
    speed = PrefillSpeed(400_000.0, clock=clock)
    speed.step_started(4096, loads_sync=False)
    clock.now = 1.0
    speed.step_over()
    assert (speed.tokens_per_s, speed.measured) == (400_000.0, 4096.0)


def test_the_decision_weighs_the_planned_tiers_at_this_speed() -> None:
    from dss.core.types import PageId, PageRef, VersionId
    from dss.sessions.resume import Rates, ResumeResult

    pages = [PageRef(i, PageId(bytes([i]) * 16), "disk") for i in range(4)]
    result = ResumeResult(
        "s", VersionId(1), 128, 129, 128, 32, 32 * 23040, pages=pages, rates=Rates({"host": 8e9, "disk": 1e9}, 4000.0)
    )
    planned = ["host", "host", "disk", "disk"]
    assert PrefillSpeed().decide(result, planned, 32) == result.decision(4000.0, tiers={"host": 64, "disk": 64})
    assert PrefillSpeed().decide(result, planned, 32).load is True
    assert PrefillSpeed(400_000.0).decide(result, planned, 32).load is False
