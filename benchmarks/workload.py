"""A multi-turn chat workload, deterministic by seed: plain data and plain functions that
benchmarks (``benchmarks/tiers.py``, the fleet benchmark) and notebooks import.

The model of a busy chat product:

* **Conversation slots** with Zipf-distributed popularity (exponent ``zipf_s``): a few users
  chat all the time, most rarely. Each arrival of the global Poisson process (``rate`` turns a
  second) picks a slot by popularity and sends the next turn of that slot's conversation.
* **Think time** between the turns of a conversation: a turn is sent no sooner than an
  exponentially distributed think time (mean ``think_s``) after the previous one's reply;
  an arrival that comes too early is delayed until then.
* **Conversations end**: after each turn with probability ``end_p`` (and always after
  ``max_turns``); the slot's next arrival starts a new conversation (a new session id, same
  user).
* **One-off requests** (share ``one_off_share`` of arrivals): a single-turn session of a
  user seen once, never resumed, with a long message of its own (mean ``one_off_tokens``: a
  pasted document, an API call with context) — the traffic that flushes a recency-only cache.
* **Shared system prompts**: ``system_prompts`` prompts of ``system_tokens`` tokens, each
  conversation uses one (Zipf-popular too, exponent 1); a prompt's tokens are the same in
  every conversation that uses it, so a store can share its pages.

Everything is integers and floats, so the same seed gives the same workload on every machine
and Python version (``random.Random`` is stable). Typical use::

    from workload import WorkloadSpec, generate, prompt_tokens, reply_tokens
    for request in generate(WorkloadSpec(turns=2000), seed=1):
        tokens = prompt_tokens(request)          # what the engine receives
        ...                                       # resume / load / compute
        history = tokens + reply_tokens(request)  # what the store commits after the reply

A request's prompt is its system prompt, then each earlier turn's user message and reply, then
its own user message; ``prompt_tokens(r)`` always extends the previous turn's
``prompt_tokens + reply_tokens`` of the same session.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass, field

VOCAB = 32_000
"""Token ids are drawn from ``range(VOCAB)``."""


@dataclass(frozen=True)
class WorkloadSpec:
    """The knobs of the workload (defaults: a mid-sized chat service over about half an hour)."""

    turns: int = 2000
    """Requests in the trace (turns of conversations plus one-off requests)."""
    slots: int = 300
    """Conversation slots (returning users), Zipf-popular."""
    zipf_s: float = 1.1
    """Zipf exponent of slot popularity (higher: more skewed)."""
    rate: float = 1.0
    """Arrivals per second (Poisson)."""
    think_s: float = 20.0
    """Mean think time between a reply and the next turn of the same conversation, seconds."""
    end_p: float = 0.12
    """Probability that a conversation ends after a turn."""
    max_turns: int = 24
    """A conversation ends after this many turns at the latest."""
    one_off_share: float = 0.15
    """Share of arrivals that are one-off requests (a single-turn session, never resumed)."""
    one_off_tokens: int = 1500
    """Mean tokens of a one-off request's own message (a pasted document, an API call with
    context: at least 4), after the system prompt."""
    system_prompts: int = 4
    """Distinct shared system prompts."""
    system_tokens: int = 512
    """Tokens of each shared system prompt."""
    user_tokens: int = 60
    """Mean tokens of a user message (geometric-ish, at least 4)."""
    reply_tokens: int = 180
    """Mean tokens of a reply (at least 8)."""
    max_context: int = 8192
    """A conversation whose next prompt would exceed this many tokens ends instead."""
    tenant_id: str = "default"
    """Tenant of every request."""


@dataclass(frozen=True)
class Request:
    """One turn sent to the engine."""

    index: int
    """Position in the trace (0-based)."""
    t: float
    """Arrival time, seconds from the start of the trace."""
    session_id: str
    user_id: str
    tenant_id: str
    turn: int
    """Turn number within the conversation, 0-based."""
    system_id: int
    """Which shared system prompt the conversation uses."""
    system_tokens: int
    history: tuple[tuple[int, int], ...]
    """``(user, reply)`` token counts of the earlier turns of the conversation."""
    user_tokens: int
    """Tokens of this turn's user message."""
    reply_tokens: int
    """Tokens of this turn's reply (the engine generates them)."""
    last: bool
    """The conversation ends after this turn (nobody resumes this session again)."""
    one_off: bool
    """A single-turn request of a user seen once."""
    seed: int = field(repr=False, default=0)
    """The trace's seed (the token contents derive from it)."""

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt: system prompt, earlier turns, this user message."""
        return self.system_tokens + sum(u + r for u, r in self.history) + self.user_tokens

    @property
    def history_len(self) -> int:
        """Tokens of the prompt a previous turn of the session already had (system prompt included)."""
        return self.prompt_len - self.user_tokens if self.turn else self.system_tokens


def _zipf_cdf(n: int, s: float) -> list[float]:
    weights = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(weights)
    out, acc = [], 0.0
    for w in weights:
        acc += w / total
        out.append(acc)
    out[-1] = 1.0
    return out


def _pick(rng: random.Random, cdf: list[float]) -> int:
    return min(bisect.bisect_left(cdf, rng.random()), len(cdf) - 1)


def _length(rng: random.Random, mean: int, floor: int) -> int:
    return max(floor, int(rng.expovariate(1.0 / mean)) if mean > 0 else floor)


def generate(spec: WorkloadSpec | None = None, seed: int = 0) -> list[Request]:
    """The trace of ``spec`` for ``seed``, in arrival order (same seed, same trace)."""
    spec = spec or WorkloadSpec()
    rng = random.Random(seed)
    slot_cdf = _zipf_cdf(spec.slots, spec.zipf_s)
    system_cdf = _zipf_cdf(max(1, spec.system_prompts), 1.0)
    # per slot: current conversation (session id, turn, history, system id, earliest next time)
    conversations: dict[int, list] = {}
    started = [0] * spec.slots
    out: list[Request] = []
    t = 0.0
    one_offs = 0
    for index in range(spec.turns):
        t += rng.expovariate(spec.rate)
        if rng.random() < spec.one_off_share:
            one_offs += 1
            system = _pick(rng, system_cdf)
            u, r = _length(rng, spec.one_off_tokens, 4), _length(rng, spec.reply_tokens, 8)
            out.append(
                Request(
                    index,
                    t,
                    f"oneoff-{one_offs}",
                    f"visitor-{one_offs}",
                    spec.tenant_id,
                    0,
                    system,
                    spec.system_tokens,
                    (),
                    u,
                    r,
                    True,
                    True,
                    seed,
                )
            )
            continue
        slot = _pick(rng, slot_cdf)
        conv = conversations.get(slot)
        if conv is None:
            started[slot] += 1
            conv = conversations[slot] = [f"s{slot}-c{started[slot]}", 0, [], _pick(rng, system_cdf), 0.0]
        session_id, turn, history, system, ready = conv
        at = max(t, ready)
        u, r = _length(rng, spec.user_tokens, 4), _length(rng, spec.reply_tokens, 8)
        prompt = spec.system_tokens + sum(a + b for a, b in history) + u
        nxt = prompt + r + spec.user_tokens * 2
        last = turn + 1 >= spec.max_turns or nxt > spec.max_context or rng.random() < spec.end_p
        out.append(
            Request(
                index,
                at,
                session_id,
                f"user-{slot}",
                spec.tenant_id,
                turn,
                system,
                spec.system_tokens,
                tuple(history),
                u,
                r,
                last,
                False,
                seed,
            )
        )
        if last:
            del conversations[slot]
        else:
            history.append((u, r))
            conv[1] = turn + 1
            # the reply takes a moment; the user then thinks before the next turn
            conv[4] = at + 1.0 + rng.expovariate(1.0 / spec.think_s)
    out.sort(key=lambda q: (q.t, q.index))
    return [
        Request(
            i,
            q.t,
            q.session_id,
            q.user_id,
            q.tenant_id,
            q.turn,
            q.system_id,
            q.system_tokens,
            q.history,
            q.user_tokens,
            q.reply_tokens,
            q.last,
            q.one_off,
            seed,
        )
        for i, q in enumerate(out)
    ]


def _tokens(key: str, n: int) -> list[int]:
    """``n`` token ids derived from ``key`` alone (stable everywhere)."""
    rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))
    return [rng.randrange(VOCAB) for _ in range(n)]


def system_prompt(system_id: int, n: int, seed: int = 0) -> list[int]:
    """The tokens of shared system prompt ``system_id`` (``n`` tokens)."""
    return _tokens(f"system/{seed}/{system_id}", n)


def _turn(request: Request, turn: int, kind: str, n: int) -> list[int]:
    return _tokens(f"{kind}/{request.seed}/{request.session_id}/{turn}", n)


def prompt_tokens(request: Request) -> list[int]:
    """The prompt the engine receives for ``request``."""
    out = system_prompt(request.system_id, request.system_tokens, request.seed)
    for turn, (u, r) in enumerate(request.history):
        out += _turn(request, turn, "user", u)
        out += _turn(request, turn, "reply", r)
    out += _turn(request, request.turn, "user", request.user_tokens)
    return out


def reply_tokens(request: Request) -> list[int]:
    """The reply the engine generates for ``request``."""
    return _turn(request, request.turn, "reply", request.reply_tokens)


def working_set_tokens(requests: list[Request], page_tokens: int = 1) -> int:
    """Distinct tokens the trace stores in full pages of ``page_tokens``: every conversation's
    final history (prompt + reply), the system prompts once each."""
    final: dict[str, Request] = {}
    systems: dict[int, int] = {}
    for r in requests:
        final[r.session_id] = r
        systems[r.system_id] = r.system_tokens
    pages = sum(s // page_tokens for s in systems.values())
    for r in final.values():
        pages += (r.prompt_len + r.reply_tokens) // page_tokens - r.system_tokens // page_tokens
    return pages * page_tokens


def summary(requests: list[Request]) -> dict[str, float]:
    """Counts that describe a trace: requests, sessions, one-offs, mean turns, prompt tokens."""
    sessions = {r.session_id for r in requests}
    one_offs = sum(r.one_off for r in requests)
    prompt = sum(r.prompt_len for r in requests)
    reusable = sum(r.history_len for r in requests)
    return {
        "requests": len(requests),
        "sessions": len(sessions),
        "one_off": one_offs,
        "turns_per_conversation": (len(requests) - one_offs) / max(1, len(sessions) - one_offs),
        "prompt_tokens": prompt,
        "reusable_share": reusable / prompt if prompt else 0.0,
        "duration_s": requests[-1].t - requests[0].t if requests else 0.0,
        "working_set_tokens": working_set_tokens(requests),
    }


def _main() -> None:
    import sys

    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    for key, value in summary(generate(seed=seed)).items():
        print(
            f"{key:24} {value:,.2f}"
            if isinstance(value, float) and not math.isclose(value, round(value))
            else f"{key:24} {value:,}"
        )


if __name__ == "__main__":
    _main()
