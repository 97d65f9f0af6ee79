"""Why exact reuse stopped where it did: the :class:`Explanation` ``Store.explain`` returns, and
the alignment of a prompt with a stored version it is made of (where they part, where they run
together again). Pure computation over token arrays."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dss.sessions.resume import Candidate


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a prompt's exact reuse stopped where it did (see :meth:`Nearest.explain`)."""

    num_prompt_tokens: int
    matched_tokens: int
    """What resume reuses now (exact paths)."""
    source: str | None
    nearest: Candidate | None
    """The stored version most similar to the prompt (the session's own versions and LSH candidates)."""
    divergence: int | None
    """First position where the prompt differs from ``nearest`` (``None``: no divergence)."""
    prompt_window: list[int] = field(default_factory=list)
    stored_window: list[int] = field(default_factory=list)
    window_start: int = 0
    prompt_text: str | None = None
    stored_text: str | None = None
    resync_prompt: int | None = None
    """Where, after the divergence, the prompt runs along the stored version again (prompt position)."""
    resync_stored: int | None = None
    """The same place in the stored version."""
    num_shared_after: int = 0
    """Tokens the prompt and the stored version share from the resync on, in one run."""
    would_reuse_tokens: int = 0
    """Page-aligned tokens with stored pages that resume would reuse had the prompt not diverged."""
    lost_tokens: int = 0
    """``would_reuse_tokens - matched_tokens`` (never negative): the reuse the divergence costs."""
    recurring: list[tuple[int, int]] = field(default_factory=list)
    """``(position, count)`` of the tenant's most frequent divergence positions, most frequent first."""


def divergence_windows(
    prompt: np.ndarray, stored: np.ndarray, pos: int, context: int
) -> tuple[list[int], list[int], int]:
    """The tokens of both sides around a divergence at ``pos``, ``context`` on each side, and
    where the windows start."""
    start = max(pos - context, 0)
    return prompt[start : pos + context].tolist(), stored[start : pos + context].tolist(), start


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def realign(prompt: np.ndarray, stored: np.ndarray, pos: int, size: int) -> tuple[int, int, int] | None:
    """After a divergence at ``pos``: the first place ``(i, j)`` with ``prompt[i:]`` and
    ``stored[j:]`` running together for at least ``2 * size`` tokens, and that run's length
    (``None`` if there is none)."""
    need = 2 * size
    tail = stored[pos:]
    if len(tail) < need or len(prompt) - pos < need:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(tail, size)
    first: dict[bytes, int] = {}
    for j in range(len(windows) - 1, -1, -1):
        first[windows[j].tobytes()] = j
    probe = np.lib.stride_tricks.sliding_window_view(prompt[pos:], size)
    for i in range(len(probe)):
        at = first.get(probe[i].tobytes())
        if at is None:
            continue
        run = common_prefix(prompt[pos + i :], tail[at:])
        if run >= need:
            return pos + i, pos + at, run
    return None
