"""A re-rendered multi-turn conversation: the chat template puts a per-request line (a
timestamp) near the start of every prompt, and the requests carry no session id.

``prompts(n)[i]`` is request ``i``'s prompt: the system prompt's first ``SPLIT`` tokens, then
that request's own line (``LINE`` tokens, different in every request from its first token
on), then the rest of the system prompt and every turn so far. Each stored version is the
previous prompt and its answer, so request ``i`` first diverges from version ``i - 1`` at
position ``SPLIT`` and runs along it again from ``SPLIT + LINE`` to its end.
"""

from __future__ import annotations

import random

SPLIT = 8
LINE = 6
SYSTEM = [100 + i for i in range(40)]


def line(i: int) -> list[int]:
    return [5000 + 10 * i + j for j in range(LINE)]


def turns(n: int, seed: int = 0, length: int = 24) -> list[tuple[list[int], list[int]]]:
    """``n`` (user message, answer) pairs of random tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(1000, 4000) for _ in range(length)], [rng.randrange(1000, 4000) for _ in range(length)])
        for _ in range(n)
    ]


def prompt(i: int, history: list[tuple[list[int], list[int]]]) -> list[int]:
    """Request ``i``'s prompt: the re-rendered system prompt, turns ``0..i-1`` with answers, user turn ``i``."""
    out = SYSTEM[:SPLIT] + line(i) + SYSTEM[SPLIT:]
    for user, answer in history[:i]:
        out += user + answer
    return out + history[i][0]
