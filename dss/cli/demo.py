"""``dss demo``: a scripted multi-turn conversation showing what dss saves at every turn.

A stand-in engine computes one page of "KV" per ``page_tokens`` tokens (bytes derived from
the tokens, so a wrong page is detectable) and, before every turn, asks the store what it
can skip. The conversation grows for three turns, is rolled back and regenerated, is
branched, is started again in a new session of the same user, and survives a restart
(the host tier is per process, so after reopening the pages come from disk).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

from dss.core.types import Layout
from dss.store import Store

LAYOUT = Layout(name="demo-engine", page_tokens=32, page_bytes=4096, model="demo", dtype="bf16")
USER = "demo-user"
TENANT = "demo"


class FakeEngine:
    """Computes 'KV' pages deterministically from tokens, and checks pages it is given."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def page(self, tokens: list[int], index: int) -> bytes:
        n = self.layout.page_tokens
        seed = hashlib.blake2b(repr(tokens[: (index + 1) * n]).encode(), digest_size=32).digest()
        return (seed * (self.layout.page_bytes // len(seed) + 1))[: self.layout.page_bytes]

    def prefill(self, store: Store, session_id: str, prompt: list[int]) -> dict[str, Any]:
        """Load what the store holds, 'compute' the rest; return what happened."""
        started = time.perf_counter()
        result = store.resume(session_id, prompt)
        loaded = store.read_pages(result.pages)
        verified = all(p == self.page(prompt, ref.index) for p, ref in zip(loaded, result.pages))
        tiers = ", ".join(f"{tier} {n}" for tier, n in sorted(result.tiers.items())) or "-"
        return {
            "prompt": len(prompt),
            "reused": result.matched_tokens,
            "computed": result.num_new_tokens,
            "tiers": tiers,
            "verified": verified,
            "ms": (time.perf_counter() - started) * 1e3,
        }

    def finish(self, store: Store, session_id: str, tokens: list[int], label: str) -> int:
        """Commit prompt + answer with every full page of KV; return the version id."""
        pages = {i: self.page(tokens, i) for i in range(len(tokens) // self.layout.page_tokens)}
        return int(store.commit(session_id, tokens, pages, label=label).version_id)


def run(open_store: Callable[[], Store], echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run the scripted conversation; return one row per step (also echoed as a table)."""
    rng = random.Random(7)

    def words(n: int) -> list[int]:
        return [rng.randrange(1000, 50_000) for _ in range(n)]

    engine = FakeEngine(LAYOUT)
    rows: list[dict[str, Any]] = []
    store = open_store()
    for session in store.sessions(tenant_id=TENANT, user_id=USER):
        store.delete_session(session.session_id, tenant_id=TENANT)
    system = words(600)
    store.create_session("chat", user_id=USER, tenant_id=TENANT, layout=LAYOUT)

    def turn(step: str, session_id: str, prompt: list[int], answer_len: int, label: str) -> tuple[list[int], int]:
        row = engine.prefill(store, session_id, prompt)
        history = prompt + words(answer_len)
        version = engine.finish(store, session_id, history, label)
        rows.append({"step": step, "session": session_id, **row, "version": version})
        return history, version

    h1, v1 = turn("turn 1", "chat", system + words(40), 120, "turn 1")
    h2, v2 = turn("turn 2", "chat", h1 + words(30), 150, "turn 2")
    turn("turn 3", "chat", h2 + words(25), 90, "turn 3")
    store.rollback("chat", v2)
    turn("undo turn 3, ask again", "chat", h2 + words(35), 80, "turn 3b")
    h2b = store.tokens("chat", v2)
    store.rollback("chat", v2)
    turn("regenerate turn 3", "chat", h2b + words(35), 100, "turn 3c")
    store.branch("chat", v1, "chat-fork")
    turn("branch at turn 1", "chat-fork", h1 + words(50), 60, "fork turn 2")
    store.create_session("chat-new", user_id=USER, tenant_id=TENANT, layout=LAYOUT)
    turn("new chat, same user", "chat-new", system + words(40), 60, "turn 1")
    store.close()
    store = open_store()
    turn("after restart", "chat", store.tokens("chat") + words(30), 60, "turn 4")
    problems = store.check()
    store.close()
    _table(rows, echo)
    echo(f"integrity check: {'ok' if not problems else problems}")
    return rows


def _table(rows: list[dict[str, Any]], echo: Callable[[str], None]) -> None:
    columns = ["step", "session", "prompt", "reused", "computed", "tiers", "verified"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    echo("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        echo("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    total = sum(r["prompt"] for r in rows)
    reused = sum(r["reused"] for r in rows)
    echo(f"reused {reused} of {total} prompt tokens ({100 * reused / total:.0f}%) instead of recomputing them")
