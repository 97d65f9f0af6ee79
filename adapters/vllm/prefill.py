"""The engine's prefill speed, measured on its own steps, and the connector's load-or-recompute
decision at that speed (:meth:`PrefillSpeed.decide`, :meth:`dss.ResumeResult.decision`).

The scheduler side times each step from the moment it built the step's metadata to the moment
the workers' output of that step came back (steps are matched first in, first out: with vLLM's
asynchronous scheduling the next step is built before this one is done, and on a GPU the
forward runs after its launch returns, so nothing earlier says the step is over); a step that
computes at least :data:`MIN_TOKENS` tokens and loads nothing synchronously (whose time
would count the load) is a prefill sample, and the speed is an exponential moving average of
their tokens per second. Until a step was measured the store's ``recompute_tokens_per_s`` is
used; the ``recompute_tokens_per_s`` setting fixes the speed instead (tests, or an engine
whose speed is known).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import dss

MIN_TOKENS = 256
"""Tokens a step must compute to count as a prefill sample (decode steps say nothing of prefill)."""
WEIGHT = 0.3
"""Weight of the newest sample in the moving average."""
MAX_IN_FLIGHT = 8
"""Steps remembered while their output has not come back (older ones are forgotten)."""


class PrefillSpeed:
    """Tokens per second of the engine's prefill steps (see the module docstring)."""

    def __init__(self, fixed: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.fixed = fixed
        self.measured: float | None = None
        self.samples = 0
        self._clock = clock
        self._steps: deque[tuple[int, float] | None] = deque(maxlen=MAX_IN_FLIGHT)

    @property
    def tokens_per_s(self) -> float | None:
        """The speed to decide with: the fixed one, else the measured one (``None``: neither yet)."""
        return self.fixed if self.fixed is not None else self.measured

    def decide(self, result: dss.ResumeResult, tiers: Sequence[str], page_tokens: int) -> dss.LoadDecision:
        """Load or recompute the pages planned from ``tiers`` (one tier name per page, of
        ``page_tokens`` tokens each), at this speed (the store's until one is known)."""
        counts: dict[str, int] = {}
        for tier in tiers:
            counts[tier] = counts.get(tier, 0) + page_tokens
        return result.decision(self.tokens_per_s, tiers=counts)

    def step_started(self, num_tokens: int, loads_sync: bool) -> None:
        """A step was scheduled: ``num_tokens`` to compute; ``loads_sync``: it loads pages first."""
        sample = num_tokens >= MIN_TOKENS and not loads_sync
        self._steps.append((num_tokens, self._clock()) if sample else None)

    def step_over(self) -> None:
        """The output of the oldest step in flight came back."""
        step = self._steps.popleft() if self._steps else None
        if step is None:
            return
        tokens, start = step
        seconds = self._clock() - start
        if seconds <= 0:
            return
        speed = tokens / seconds
        self.measured = speed if self.measured is None else WEIGHT * speed + (1 - WEIGHT) * self.measured
        self.samples += 1
