"""A Hypothesis state machine interleaves commits, engine loads, plain reads, prefetches, pins,
holds and mover runs on a store with small tiers, a host quota per user, and a clock it moves
itself, against a model of what was acknowledged. After every step:

* nothing acknowledged is lost: every session's tokens are what its last commit acknowledged,
  and every page a read returns is the payload committed for it;
* pinned versions' pages (and the registered shared prefix, which is pinned) never leave the
  last tier: they resume in full and disk holds them;
* a page held (being read, loaded or moved) is never dropped: the rule ``held_mover`` runs the
  mover and more writes while holding a session's pages in host, and they are all still there;
* the host quota per user holds, and no tier is over its capacity;
* ``check()`` is empty.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import dss
from dss.core.types import PageId

LAYOUT = dss.Layout(name="tm", page_tokens=2, page_bytes=256)
SEGMENT_PAGE = 32 + 28 + 256  # a sealed page's record in a segment file
USERS = ["u1", "u2", "u3"]
SESSIONS = ["a", "b", "c", "d", "e"]
PREFIX = [900, 901, 902, 903]
HOST_PAGES = 12
USER_QUOTA_PAGES = 6


def payload(session: str, tokens: list[int], index: int) -> bytes:
    key = f"{tokens[: (index + 1) * LAYOUT.page_tokens]}".encode()
    return (key * (LAYOUT.page_bytes // max(1, len(key)) + 1))[: LAYOUT.page_bytes]


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="dss-tiers-"))
        self.now = 0.0
        self.store = dss.open(
            self.tmp / "store",
            fsync=False,
            mover=False,
            clock=lambda: self.now,
            host_bytes=HOST_PAGES * LAYOUT.page_bytes,
            host_user_quota=USER_QUOTA_PAGES * LAYOUT.page_bytes,
            disk_bytes=40 * SEGMENT_PAGE + 400,
            move_batch_pages=8,
        )
        self.store.register_prefix(PREFIX, {0: payload("~", PREFIX, 0), 1: payload("~", PREFIX, 1)}, layout=LAYOUT)
        self.owner: dict[str, str] = {}
        self.tokens: dict[str, list[int]] = {}
        self.pinned: dict[str, list[int]] = {}  # session -> tokens of its pinned version

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- rules -----------------------------------------------------------------------------

    @rule(
        session=st.sampled_from(SESSIONS),
        user=st.sampled_from(USERS),
        extra=st.lists(st.integers(0, 50), min_size=1, max_size=9),
        dt=st.floats(0, 120),
    )
    def commit(self, session: str, user: str, extra: list[int], dt: float) -> None:
        self.now += dt
        if session not in self.owner:
            self.store.create_session(session, user_id=user, layout=LAYOUT)
            self.owner[session] = user
            base = list(PREFIX)
        else:
            base = self.tokens[session]
        tokens = base + extra
        full = len(tokens) // LAYOUT.page_tokens
        self.store.commit(session, tokens, {i: payload(session, tokens, i) for i in range(full)})
        self.tokens[session] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), load=st.booleans(), dt=st.floats(0, 120))
    def read(self, data: st.DataObject, load: bool, dt: float) -> None:
        self.now += dt
        session = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[session]
        refs = self.store.resume(session, tokens).pages
        got = self.store.read_pages(refs, load=load)
        for ref, value in zip(refs, got):
            assert value is None or value == payload(session, tokens, ref.index), "a read returned wrong bytes"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.tokens)))
        self.store.prefetch(session, wait=True)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.tokens)))
        if session in self.pinned:
            return
        head = self.store.session(session).head_id
        tokens = self.tokens[session]
        refs = self.store.resume(session, tokens).pages
        if len(refs) != len(tokens) // 2 or len(self.store.page_sizes([r.page_id for r in refs])) != len(refs):
            # pin only a version whose pages are all still stored, on disk: a pin keeps disk
            # eviction off a version's pages; it does not write a page only host holds (the
            # disk was full when it was written) to disk
            return
        self.store.pin(session, head)
        self.pinned[session] = tokens

    @rule(dt=st.floats(0, 300))
    def mover(self, dt: float) -> None:
        self.now += dt
        self.store.run_mover()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 50), min_size=2, max_size=12))
    def held_mover(self, data: st.DataObject, extra: list[int]) -> None:
        """Hold a session's host pages (as a read or a load does) while the mover runs and
        other sessions write: none of them leaves host."""
        session = data.draw(st.sampled_from(sorted(self.tokens)))
        refs = [r.page_id for r in self.store.resume(session, self.tokens[session]).pages if r.tier == "host"]
        with self.store.placement.hold(refs):
            self.now += 60
            self.store.run_mover()
            other = next((s for s in sorted(self.tokens) if s != session), None)
            if other is not None:
                self.commit(other, self.owner[other], extra, 1.0)
            self.store.run_mover()
            assert all(PageId(p) in self.store.host for p in refs), "a held page left host"

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def acknowledged_state_is_kept(self) -> None:
        for session, tokens in self.tokens.items():
            assert self.store.tokens(session) == tokens

    @invariant()
    def pinned_pages_stay_on_the_last_tier(self) -> None:
        for session, tokens in self.pinned.items():
            refs = self.store.resume(session, tokens).pages
            assert len(refs) == len(tokens) // 2, f"pinned version of {session} lost pages"
            stats = self.store.page_sizes([r.page_id for r in refs])
            assert len(stats) == len(refs)
        shared = self.store.lookup(PREFIX, layout=LAYOUT)
        assert shared.matched_tokens == len(PREFIX)

    @invariant()
    def quotas_and_capacities_hold(self) -> None:
        host = self.store.host
        assert host.used_bytes <= host.capacity_bytes
        assert all(b <= USER_QUOTA_PAGES * LAYOUT.page_bytes for b in host.owner_bytes.values())
        stats = self.store.stats()
        assert stats["disk"]["bytes"] <= stats["disk"]["capacity"]

    @invariant()
    def store_is_sound(self) -> None:
        assert self.store.check() == []


pytestmark = pytest.mark.slow

TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
