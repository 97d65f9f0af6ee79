"""A Hypothesis state machine drives the store against a plain-Python reference model.

The model keeps, per session, the list of versions (tokens, parent) and the head, and a
set of stored pages keyed by ``(namespace, layout, prefix tokens)`` with the sessions
holding each. After every step the store must give the same answers as the model and
``check()`` must be empty. A tiny token alphabet makes prefixes collide, so edges split,
pages dedup across sessions and branches share.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import dss
from tests.conftest import _pg_schema

LAYOUTS = [dss.Layout(name="two", page_tokens=2, page_bytes=8), dss.Layout(name="three", page_tokens=3, page_bytes=8)]
OWNERS = [("t1", "alice"), ("t1", "bob"), ("t2", "alice")]
NAMES = ["a", "b", "c", "d"]
tokens_st = st.lists(st.integers(0, 2), max_size=9)


def payload(key: tuple) -> bytes:
    return hashlib.blake2b(repr(key).encode(), digest_size=8).digest()


@dataclass
class ModelSession:
    tenant: str
    user: str
    layout: dss.Layout
    versions: dict[int, list[int]] = field(default_factory=dict)  # version id -> tokens
    parents: dict[int, int | None] = field(default_factory=dict)
    head: int | None = None


class StoreMachine(RuleBasedStateMachine):
    catalog_url: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="dss-sm-"))
        self.url_iter = _pg_schema() if type(self).catalog_url == "postgresql" else None
        self.url = next(self.url_iter) if self.url_iter else None
        self.store = self._open()
        self.sessions: dict[tuple[str, str], ModelSession] = {}  # (tenant, session id) -> model
        self.pages: dict[tuple, set[tuple[str, str]]] = {}  # page key -> sessions holding it

    def _open(self) -> dss.Store:
        # compact_dead_share=0.05: nearly every delete leaves segments to compact (automatically)
        return dss.open(self.folder, catalog_url=self.url, fsync=False, host_bytes=64, compact_dead_share=0.05)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.url_iter:
            for _ in self.url_iter:
                pass

    # -- model helpers ---------------------------------------------------------------------

    @staticmethod
    def key(s: ModelSession, tokens: list[int], index: int) -> tuple:
        n = s.layout.page_tokens
        return (s.tenant, s.user, s.layout.digest, tuple(tokens[: (index + 1) * n]))

    def stored(self, s: ModelSession, tokens: list[int], index: int) -> bool:
        return self.key(s, tokens, index) in self.pages

    def expected_resume(self, s: ModelSession, prompt: list[int]) -> tuple[int, int | None, int]:
        n = s.layout.page_tokens
        history = max((_lcp(prompt, v) for v in s.versions.values()), default=0)
        pages = 0
        while (pages + 1) * n <= history and self.stored(s, prompt, pages):
            pages += 1
        version = None
        if pages:
            depth = pages * n
            along = [vid for vid, v in s.versions.items() if len(v) >= depth and v[:depth] == prompt[:depth]]
            version = s.head if s.head in along else max(along)
        if history < (pages + 1) * n:
            while (pages + 1) * n <= len(prompt) and self.stored(s, prompt, pages):
                pages += 1
        return pages * n, version, history

    def hold(self, sid: tuple[str, str], s: ModelSession, tokens: list[int], indices: list[int]) -> None:
        for i in indices:
            self.pages.setdefault(self.key(s, tokens, i), set()).add(sid)

    # -- rules -----------------------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        assert self.store.check() == []

    @rule(name=st.sampled_from(NAMES), owner=st.sampled_from(OWNERS), layout=st.sampled_from(LAYOUTS))
    def create(self, name: str, owner: tuple[str, str], layout: dss.Layout) -> None:
        tenant, user = owner
        existing = self.sessions.get((tenant, name))
        if existing and (existing.user, existing.layout) != (user, layout):
            with pytest.raises(dss.SessionExists):
                self.store.create_session(name, user_id=user, tenant_id=tenant, layout=layout)
            return
        info = self.store.create_session(name, user_id=user, tenant_id=tenant, layout=layout)
        self.sessions.setdefault((tenant, name), ModelSession(tenant, user, layout))
        assert info.head_id == self.sessions[(tenant, name)].head

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), tail=tokens_st, stored=st.lists(st.booleans(), max_size=6))
    def commit(self, data: st.DataObject, tail: list[int], stored: list[bool]) -> None:
        sid, s = self._pick(data)
        base = self._base(data, s)
        tokens = base + tail
        if not tokens:
            with pytest.raises(dss.InvalidTokens):
                self.store.commit(sid[1], tokens, tenant_id=sid[0])
            return
        full = len(tokens) // s.layout.page_tokens
        indices = [i for i in range(full) if i < len(stored) and stored[i]]
        pages = {i: payload(self.key(s, tokens, i)) for i in indices}
        version = self.store.commit(sid[1], tokens, pages, tenant_id=sid[0])
        assert version.parent_id == s.head and version.num_tokens == len(tokens)
        s.versions[version.version_id] = tokens
        s.parents[version.version_id] = s.head
        s.head = version.version_id
        self.hold(sid, s, tokens, [i for i in range(full) if i in pages or self.stored(s, tokens, i)])

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), tail=tokens_st, index=st.integers(0, 5))
    def save(self, data: st.DataObject, tail: list[int], index: int) -> None:
        sid, s = self._pick(data)
        tokens = self._base(data, s) + tail
        if (index + 1) * s.layout.page_tokens > len(tokens):
            with pytest.raises(dss.InvalidPage):
                self.store.save_pages(sid[1], tokens, {index: b"x" * 8}, tenant_id=sid[0])
            return
        self.store.save_pages(sid[1], tokens, {index: payload(self.key(s, tokens, index))}, tenant_id=sid[0])
        self.hold(sid, s, tokens, [index])

    @precondition(lambda self: self.sessions)
    @rule(data=st.data(), tail=tokens_st)
    def resume(self, data: st.DataObject, tail: list[int]) -> None:
        sid, s = self._pick(data)
        prompt = self._base(data, s) + tail
        result = self.store.resume(sid[1], prompt, tenant_id=sid[0])
        matched, version, history = self.expected_resume(s, prompt)
        assert (result.matched_tokens, result.version_id, result.num_history_tokens) == (matched, version, history)
        assert [p.index for p in result.pages] == list(range(matched // s.layout.page_tokens))
        got = self.store.read_pages(result.pages)
        assert got == [payload(self.key(s, prompt, p.index)) for p in result.pages]

    @precondition(lambda self: any(s.versions for s in self.sessions.values()))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        sid, s = self._pick(data, with_versions=True)
        target = data.draw(st.sampled_from(sorted(s.versions)))
        assert self.store.rollback(sid[1], target, tenant_id=sid[0]).is_head
        s.head = target

    @precondition(lambda self: any(s.versions for s in self.sessions.values()))
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def branch(self, data: st.DataObject, name: str) -> None:
        sid, s = self._pick(data, with_versions=True)
        target = data.draw(st.sampled_from(sorted(s.versions)))
        new = (sid[0], name)
        if new in self.sessions:
            with pytest.raises(dss.SessionExists):
                self.store.branch(sid[1], target, name, tenant_id=sid[0])
            return
        info = self.store.branch(sid[1], target, name, tenant_id=sid[0])
        tokens = s.versions[target]
        model = ModelSession(s.tenant, s.user, s.layout, {info.head_id: tokens}, {info.head_id: target}, info.head_id)
        self.sessions[new] = model
        self.hold(
            new, model, tokens, [i for i in range(len(tokens) // s.layout.page_tokens) if self.stored(model, tokens, i)]
        )

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        sid, _ = self._pick(data)
        released = self.store.delete_session(sid[1], tenant_id=sid[0])
        del self.sessions[sid]
        gone = [k for k, holders in self.pages.items() if holders == {sid}]
        for holders in self.pages.values():
            holders.discard(sid)
        for k in gone:
            del self.pages[k]
        assert released == len(gone)

    @rule()
    def compact(self) -> None:
        """What a dry run predicts is what compaction then does; no page moves off the disk tier."""
        located = self.store.sql("SELECT COUNT(*) FROM page_locations").rows
        plan = self.store.compact(dry_run=True)
        done = self.store.compact()
        assert (
            done.segments,
            done.new_segments,
            done.pages,
            done.bytes_before,
            done.bytes_after,
            done.quarantined,
        ) == (plan.segments, plan.new_segments, plan.pages, plan.bytes_before, plan.bytes_after, 0)
        assert self.store.sql("SELECT COUNT(*) FROM page_locations").rows == located

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self._open()

    @invariant()
    def same_versions_and_sound(self) -> None:
        for (tenant, name), s in self.sessions.items():
            versions = self.store.versions(name, tenant_id=tenant)
            assert {v.version_id: v.num_tokens for v in versions} == {k: len(v) for k, v in s.versions.items()}
            assert [v.version_id for v in versions if v.is_head] == ([s.head] if s.head else [])
            assert {v.version_id: v.parent_id for v in versions} == s.parents
        assert self.store.check() == []

    # -- drawing helpers -------------------------------------------------------------------

    def _pick(self, data: st.DataObject, with_versions: bool = False) -> tuple[tuple[str, str], ModelSession]:
        choices = sorted(k for k, s in self.sessions.items() if s.versions or not with_versions)
        sid = data.draw(st.sampled_from(choices))
        return sid, self.sessions[sid]

    @staticmethod
    def _base(data: st.DataObject, s: ModelSession) -> list[int]:
        if not s.versions or not data.draw(st.booleans()):
            return []
        tokens = s.versions[data.draw(st.sampled_from(sorted(s.versions)))]
        return tokens[: data.draw(st.integers(0, len(tokens)))]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SqliteMachine(StoreMachine):
    catalog_url = None


class PostgresMachine(StoreMachine):
    catalog_url = "postgresql"


TestSqliteStore = SqliteMachine.TestCase
TestSqliteStore.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPostgresStore = PostgresMachine.TestCase
TestPostgresStore.settings = settings(
    max_examples=15, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
