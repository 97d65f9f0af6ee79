"""Replays through the real store with its clock injected (think times cost nothing), each
request as an engine's connector makes it: find the prompt's stored prefix, load it
(``read_pages``), store what was computed. Tokens are counted by the tier that served them
(host, disk) or recomputed.

* :func:`replay_chat` — the multi-turn chat workload (:mod:`workload`). With sessions, as a chat
  backend drives the store: ``resume`` the session, then ``commit`` prompt and reply with their
  new pages (``dss+prefetch``: and the backend's ``prefetch`` of the session ``PREFETCH_S``
  before each of its turns). Without sessions, as the vLLM connector serves a request that
  names none: ``lookup`` the prompt in one namespace (no session, no user), then ``save_pages``
  the new pages of prompt and reply. The mover runs after every request (``run_mover``).
* :func:`replay_blocks` — a published block-hash trace (:mod:`mooncake`), always without
  sessions (``lookup``, ``save_pages``); the store's own mover, stepped on the trace's clock
  every ``mover_interval_s``, as a store with default settings runs it.

Each returns a :class:`Row`; the chat replay also returns the page :class:`Trace` Belady's
optimum is computed from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mooncake import BLOCK_TOKENS, BlockRequest, tokens
from workload import Request, prompt_tokens, reply_tokens, system_prompt

import dss

PAGE_TOKENS = 32
PAGE_BYTES = 512
BLOCK_PAGE_TOKENS = 4
"""Tokens of the page standing for one block of a trace (the block's id, spelled out); the
figures count the block's own :data:`mooncake.BLOCK_TOKENS`."""
RECORD_BYTES = 32
"""A page's record header in a segment file (the disk's capacity is counted in records)."""
PREFETCH_S = 2.0
"""``dss+prefetch``: the chat backend calls ``store.prefetch(session)`` when the user starts
typing, this many seconds before the turn arrives."""
KV_BYTES_PER_TOKEN = 128 << 10
HOST_BPS, DISK_BPS, RECOMPUTE_TPS = 8e9, 1e9, 4000.0
LAYOUT = dss.Layout(name="bench-tiers", page_tokens=PAGE_TOKENS, page_bytes=PAGE_BYTES)
BLOCKS = dss.Layout(name="bench-blocks", page_tokens=BLOCK_PAGE_TOKENS, page_bytes=PAGE_BYTES)


@dataclass
class Row:
    """One policy (and setting) at one host and disk capacity."""

    capacity: float
    """Host capacity, a share of the working set."""
    disk: float
    """Disk capacity, a share of the working set."""
    policy: str
    host_pages: int
    prompt_tokens: int
    host_tokens: int
    disk_tokens: int
    recompute_tokens: int
    promotions: int = 0
    demotions: int = 0
    inline_evictions: int = 0
    """Pages a host put dropped that the mover had not demoted (the host's inline work)."""
    disk_inline_evictions: int = 0
    """Pages a disk write dropped that the mover had not demoted (ranked inline)."""
    prefetch_hits: int = 0
    prefetch_wasted: int = 0
    settings: dict = field(default_factory=dict)
    """Store settings this row was replayed with besides the policy (a watermark sweep's)."""

    @property
    def host_share(self) -> float:
        return self.host_tokens / self.prompt_tokens

    @property
    def disk_share(self) -> float:
        return self.disk_tokens / self.prompt_tokens

    @property
    def total_share(self) -> float:
        """Share of prompt tokens served from any tier (host or disk)."""
        return (self.host_tokens + self.disk_tokens) / self.prompt_tokens

    @property
    def recompute_share(self) -> float:
        return self.recompute_tokens / self.prompt_tokens

    @property
    def load_s(self) -> float:
        """Estimated time to get every prompt's KV: loads from host and disk, the rest recomputed."""
        kv = KV_BYTES_PER_TOKEN
        return (
            self.host_tokens * kv / HOST_BPS + self.disk_tokens * kv / DISK_BPS + self.recompute_tokens / RECOMPUTE_TPS
        )

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "host_share": self.host_share,
            "disk_share": self.disk_share,
            "total_share": self.total_share,
            "recompute_share": self.recompute_share,
            "load_s": self.load_s,
        }


@dataclass
class Trace:
    """What a chat replay saw, per request: the pages read (available ones, in prompt order) and
    the pages written; Belady's optimum is computed from it."""

    reads: list[list[bytes]]
    writes: list[list[bytes]]
    prompt_tokens: int
    recompute_tokens: int


def payload(i: int) -> bytes:
    return (i % 251).to_bytes(1, "big") * PAGE_BYTES


def open_store(
    folder: Path, policy: str, now: list[float], host_pages: int, disk_pages: int, **options: object
) -> dss.Store:
    """A fresh store in ``folder`` whose clock reads ``now[0]``, with a host of ``host_pages``
    pages and a disk of ``disk_pages`` page records."""
    options.setdefault("encrypt", False)
    options.setdefault("fsync", False)
    return dss.open(
        folder,
        policy=policy,
        clock=lambda: now[0],
        host_bytes=host_pages * PAGE_BYTES,
        disk_bytes=disk_pages * (PAGE_BYTES + RECORD_BYTES),
        segment_bytes=1 << 20,
        **options,
    )


def row_of(store: dss.Store, policy: str, host_pages: int, counted: tuple[int, int, int, int]) -> Row:
    """The row of a finished replay: ``counted`` is (prompt, host, disk, recomputed) tokens."""
    stats = store.stats()
    return Row(
        0.0,
        0.0,
        policy,
        host_pages,
        *counted,
        stats["host"]["promotions"],
        stats["host"]["demotions"],
        stats["host"]["inline_evictions"],
        stats["disk"]["inline_evictions"],
        stats["prefetch"]["hits"],
        stats["prefetch"]["wasted"],
    )


def replay_chat(
    requests: Sequence[Request],
    policy: str,
    host_pages: int,
    disk_pages: int,
    folder: Path,
    *,
    sessions: bool = True,
    progress: object = None,
    **options: object,
) -> tuple[Row, Trace]:
    """Replay the chat workload through a fresh store in ``folder`` (see the module docstring);
    returns the row and the page trace (its writes only for ``policy="lru"``)."""
    now = [0.0]
    name, prefetch = policy, policy.endswith("+prefetch")
    policy = policy.removesuffix("+prefetch")
    events: list[tuple[float, int, Request | None, str]] = [(r.t, 1, r, r.session_id) for r in requests]
    if prefetch:
        events += [(r.t - PREFETCH_S, 0, None, r.session_id) for r in requests if r.turn]
    events.sort(key=lambda e: (e[0], e[1]))
    store = open_store(folder, policy, now, host_pages, disk_pages, mover=False, **options)
    trace = Trace([], [], sum(r.prompt_len for r in requests), 0)
    host = disk = 0
    try:
        _register_systems(store, requests)
        for t, _, r, session_id in progress(events) if callable(progress) else events:
            now[0] = t
            if r is None:
                with contextlib.suppress(dss.UnknownSession):  # typing began before the first turn was in
                    store.prefetch(session_id, wait=True)
                continue
            got = _turn(store, r, now, policy == "lru", trace) if sessions else _sessionless_turn(store, r, now, trace)
            host += got[0]
            disk += got[1]
            store.run_mover()
        row = row_of(store, name, host_pages, (trace.prompt_tokens, host, disk, trace.recompute_tokens))
    finally:
        store.close()
    return row, trace


def _register_systems(store: dss.Store, requests: Sequence[Request]) -> None:
    """Register each shared system prompt the workload uses, as the operator would."""
    seen: set[int] = set()
    for r in requests:
        if r.system_id not in seen:
            seen.add(r.system_id)
            prompt = system_prompt(r.system_id, r.system_tokens, r.seed)
            pages = {i: payload(i) for i in range(len(prompt) // PAGE_TOKENS)}
            store.register_prefix(prompt, pages, layout=LAYOUT, tenant_id=r.tenant_id)


def _turn(store: dss.Store, r: Request, now: list[float], record_writes: bool, trace: Trace) -> tuple[int, int]:
    """One turn of a session: resume, load, commit; returns the tokens found on host and disk."""
    if r.turn == 0:
        store.create_session(r.session_id, user_id=r.user_id, tenant_id=r.tenant_id, layout=LAYOUT)
    prompt = prompt_tokens(r)
    result = store.resume(r.session_id, prompt, tenant_id=r.tenant_id)
    trace.recompute_tokens += len(prompt) - result.matched_tokens
    store.read_pages(result.pages, tenant_id=r.tenant_id)
    trace.reads.append([ref.page_id for ref in result.pages])
    history = prompt + reply_tokens(r)
    first = result.matched_tokens // PAGE_TOKENS
    now[0] = r.t + 0.5
    new = {i: payload(i) for i in range(first, len(history) // PAGE_TOKENS)}
    store.commit(r.session_id, history, new, tenant_id=r.tenant_id)
    if record_writes:  # Belady's trace: the pages the commit stored
        after = store.resume(r.session_id, history, tenant_id=r.tenant_id).pages
        trace.writes.append([ref.page_id for ref in after if ref.index >= first])
    return result.tiers.get("host", 0), result.tiers.get("disk", 0)


def _sessionless_turn(store: dss.Store, r: Request, now: list[float], trace: Trace) -> tuple[int, int]:
    """One request without a session or user: lookup, load, save the new pages of prompt and
    reply; returns the tokens found on host and disk."""
    prompt = prompt_tokens(r)
    result = store.lookup(prompt, layout=LAYOUT, tenant_id=r.tenant_id)
    trace.recompute_tokens += len(prompt) - result.matched_tokens
    store.read_pages(result.pages, tenant_id=r.tenant_id)
    trace.reads.append([ref.page_id for ref in result.pages])
    history = prompt + reply_tokens(r)
    first = result.matched_tokens // PAGE_TOKENS
    now[0] = r.t + 0.5
    new = {i: payload(i) for i in range(first, len(history) // PAGE_TOKENS)}
    saved = store.save_pages(None, history, new, tenant_id=r.tenant_id, user_id="anonymous", layout=LAYOUT)
    trace.writes.append([bytes(saved.page_ids[i]) for i in sorted(new)])
    return result.tiers.get("host", 0), result.tiers.get("disk", 0)


def replay_blocks(
    requests: Sequence[BlockRequest],
    policy: str,
    host_pages: int,
    disk_pages: int,
    folder: Path,
    *,
    progress: object = None,
    **options: object,
) -> Row:
    """Replay a block-hash trace through a fresh store in ``folder`` (see the module docstring)."""
    now = [0.0]
    store = open_store(folder, policy, now, host_pages, disk_pages, **options)
    total = host = disk = 0
    try:
        for r in progress(requests) if callable(progress) else requests:
            now[0] = r.t
            prompt = tokens(r.hash_ids, BLOCK_PAGE_TOKENS)
            result = store.lookup(prompt, layout=BLOCKS)
            total += len(r.hash_ids) * BLOCK_TOKENS
            host += result.tiers.get("host", 0) // BLOCK_PAGE_TOKENS * BLOCK_TOKENS
            disk += result.tiers.get("disk", 0) // BLOCK_PAGE_TOKENS * BLOCK_TOKENS
            store.read_pages(result.pages)
            first = result.matched_tokens // BLOCK_PAGE_TOKENS
            if first < len(r.hash_ids):
                new = {i: payload(i) for i in range(first, len(r.hash_ids))}
                store.save_pages(None, prompt, new, tenant_id="default", user_id="anonymous", layout=BLOCKS)
        row = row_of(store, policy, host_pages, (total, host, disk, total - host - disk))
    finally:
        store.close()
    return row
