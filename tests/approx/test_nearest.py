"""Approximate matching through the store (dss/nearest.py): nearest, explain, resume(approximate=True),
prefetch_candidates; the index kept current on commit, branch, delete, other processes' writes
and erasure; in memory and in Redis. Every reuse reported is an exact prefix of the prompt."""

from __future__ import annotations

import hashlib
import uuid

import numpy as np
import pytest

import dss
from dss.approx.explanation import common_prefix, realign
from dss.core.errors import InvalidInput
from tests import rerender

L = dss.Layout(name="near", page_tokens=4, page_bytes=16, model="m1")
L2 = dss.Layout(name="near", page_tokens=4, page_bytes=16, model="m2")


def kv(tokens: list[int], k: int) -> bytes:
    """The 'KV' of page ``k`` of ``tokens``: a digest of every token up to the page's end, so a
    page is the right one for a prompt only if the prompt's prefix is exactly these tokens."""
    return hashlib.blake2b(np.asarray(tokens[: 4 * (k + 1)], np.uint32).tobytes(), digest_size=16).digest()


def kv_pages(tokens: list[int]) -> dict[int, bytes]:
    return {k: kv(tokens, k) for k in range(len(tokens) // 4)}


def assert_exact(store: dss.Store, result: dss.ResumeResult, prompt: list[int]) -> None:
    """Every page the result reports is the prompt's own page (an exact prefix)."""
    assert [p.index for p in result.pages] == list(range(result.matched_tokens // 4))
    assert store.read_pages(result.pages) == [kv(prompt, k) for k in range(result.matched_tokens // 4)]


def play(store: dss.Store, n: int, *, user: str = "u", approximate: bool = True) -> list[dss.ResumeResult]:
    """The re-rendered conversation: request ``i`` in a fresh session ``req{i}`` (its id dropped),
    resumed, then committed with its answer and KV."""
    history = rerender.turns(n, length=128)
    results = []
    for i in range(n):
        prompt = rerender.prompt(i, history)
        store.create_session(f"req{i}", user_id=user, layout=L)
        result = store.resume(f"req{i}", prompt, approximate=approximate)
        assert_exact(store, result, prompt)
        results.append(result)
        full = prompt + history[i][1]
        store.commit(f"req{i}", full, kv_pages(full))
    return results


def test_rerendered_conversation_explain_names_the_divergence_and_its_cost(open_store) -> None:
    """Every request diverges from the previous one's stored version at position 8 (the
    per-request line): exact reuse stops at 8 tokens (2 pages); explain says so, shows the
    two lines, where they run together again (14) and what the line costs."""
    store = open_store()
    n = 6
    results = play(store, n)
    assert [r.matched_tokens for r in results] == [0] + [8] * (n - 1)
    assert [r.source for r in results] == [None] + ["namespace"] * (n - 1)
    near = [r.near for r in results]
    assert near[0] is None
    for i in range(2, n):  # prompts long enough for a window to match
        assert near[i] is not None and near[i].session_id == f"req{i - 1}"
        assert (near[i].divergence, near[i].common_prefix, near[i].matched_tokens) == (8, 8, 8)
    history = rerender.turns(n + 1, length=128)
    prompt = rerender.prompt(n, history)
    store.create_session("next", user_id="u", layout=L)
    stored = store.tokens(f"req{n - 1}")
    why = store.explain("next", prompt)
    assert why.nearest is not None and why.nearest.session_id == f"req{n - 1}"
    assert (why.divergence, why.matched_tokens, why.source) == (8, 8, "namespace")
    assert why.window_start == 0
    assert why.prompt_window == rerender.SYSTEM[:8] + rerender.line(n) + rerender.SYSTEM[8:10]
    assert why.stored_window == rerender.SYSTEM[:8] + rerender.line(n - 1) + rerender.SYSTEM[8:10]
    assert (why.resync_prompt, why.resync_stored) == (14, 14)
    assert why.num_shared_after == len(stored) - 14
    assert why.would_reuse_tokens == len(stored) // 4 * 4
    assert why.lost_tokens == why.would_reuse_tokens - 8
    counts = dict(why.recurring)
    assert counts == {8: sum(r.near is not None for r in results) + 1}  # each near-duplicate found, and this explain
    assert why.recurring[0][0] == 8
    texts = store.explain("next", prompt, decode=lambda ids: " ".join(map(str, ids)), context=2)
    assert texts.prompt_text == f"106 107 {5000 + 10 * n} {5001 + 10 * n}"
    assert texts.stored_text == f"106 107 {5000 + 10 * (n - 1)} {5001 + 10 * (n - 1)}"
    assert store.check() == []


def test_nearest_is_verified_exactly_and_ranked(open_store) -> None:
    store = open_store()
    rng = np.random.default_rng(7)
    base = rng.integers(1, 30000, 400).tolist()
    variants = {
        "same": base,
        "tail": base[:380] + rng.integers(1, 30000, 20).tolist(),
        "early": base[:40] + [99999] + base[41:],
        "other": rng.integers(1, 30000, 400).tolist(),
    }
    for name, tokens in variants.items():
        store.create_session(name, user_id="u", layout=L)
        store.commit(name, tokens, kv_pages(tokens))
    found = store.nearest(base + [1, 2], user_id="u", layout=L, k=5)
    assert [c.session_id for c in found] == ["same", "early", "tail"]  # one token changed costs fewer shingles
    prompt = np.asarray(base + [1, 2], np.uint32)
    for c in found:
        stored = np.asarray(variants[c.session_id], np.uint32)
        assert c.common_prefix == common_prefix(prompt, stored)
        assert c.matched_tokens == c.common_prefix // 4 * 4
        shingles_p = {tuple(prompt[i : i + 4]) for i in range(len(prompt) - 3)}
        shingles_s = {tuple(stored[i : i + 4]) for i in range(len(stored) - 3)}
        assert c.jaccard == len(shingles_p & shingles_s) / len(shingles_p | shingles_s)
        assert abs(c.estimated_jaccard - c.jaccard) < 0.15
    assert [(c.common_prefix, c.divergence) for c in found] == [(400, None), (40, 40), (380, 380)]
    assert store.nearest(base, user_id="u", layout=L, k=1)[0].session_id == "same"
    assert store.nearest(base, user_id="nobody", layout=L) == []
    with pytest.raises(InvalidInput, match="k must be an int from 1 to 100"):
        store.nearest(base, user_id="u", layout=L, k=0)
    with pytest.raises(InvalidInput, match="without a session_id, a layout is needed"):
        store.nearest(base, user_id="u")
    with pytest.raises(InvalidInput, match="not both"):
        store.nearest(base, session_id="same", layout=L)


def test_a_rerendered_next_turn_finds_the_version_it_extends_in_its_namespace_only(open_store) -> None:
    """Three conversations of one namespace (and the first one again in another), one version
    per turn, sessions dropped; the next turn of the first, re-rendered (its line changed) with
    a long new message: its Jaccard with the turn it extends is under the threshold, yet that
    version comes first, its earlier turns after it (held whole, but less of them), then the
    other conversations if at all; the other namespace's copy never."""
    store = open_store()
    chats = {name: rerender.turns(4, seed=seed, length=32) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    for user, names in (("u", ("a", "b", "c")), ("v", ("a",))):
        for name in names:
            store.create_session(f"{user}-{name}", user_id=user, layout=L)
            for i in range(3):
                full = rerender.prompt(i, chats[name]) + chats[name][i][1]
                store.commit(f"{user}-{name}", full, kv_pages(full))
    long_message = list(range(9000, 9090))
    prompt = rerender.prompt(3, [*chats["a"][:3], (long_message, [])])
    stored = store.tokens("u-a")
    found = store.nearest(prompt, user_id="u", layout=L, k=5)
    assert found[0].jaccard < 0.85
    assert [(c.session_id, c.num_tokens) for c in found[:3]] == [("u-a", 238), ("u-a", 174), ("u-a", 110)]
    assert {c.session_id for c in found} <= {"u-a", "u-b", "u-c"}
    assert len(stored) == 238 and found[0].containment == 226 / 235  # 9 of its 235 shingles hold the line
    assert (found[0].divergence, found[0].common_prefix) == (8, 8)
    assert store.explain(None, prompt, user_id="u", layout=L).nearest == found[0]
    assert [c.session_id for c in store.nearest(prompt, user_id="v", layout=L, k=5)] == ["v-a"] * 3
    store.forget_user("v", tenant_id="default")
    assert store.nearest(prompt, user_id="v", layout=L) == []
    assert store.nearest(prompt, user_id="u", layout=L, k=5) == found


def test_approximate_off_or_exact_enough_leaves_the_exact_answer(open_store) -> None:
    store = open_store()
    tokens = list(range(1000, 1200))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    exact = store.resume("a", tokens + [5])
    on = store.resume("a", tokens + [5], approximate=True)  # 200 of 201 matched: above min_share
    assert (on.matched_tokens, on.source, on.num_candidates, on.near) == (200, "session", 0, None)
    assert (exact.matched_tokens, exact.num_candidates, exact.near) == (200, 0, None)
    assert store.stats()["lsh"] == {
        "indexes": 0,
        "entries": 0,
        "capacity": 1_000_000,
        "dropped_indexes": 0,
        "bands": 11,
        "rows": 11,
        "storage": "memory",
    }  # never needed: never built
    with pytest.raises(InvalidInput, match="approximate must be True or False"):
        store.resume("a", tokens, approximate="yes")


def test_config_default_turns_approximate_on(open_store) -> None:
    store = open_store(approximate=True)
    tokens = list(range(1000, 1200))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    changed = [7] + tokens[1:]
    store.create_session("b", user_id="u", layout=L)
    result = store.resume("b", changed)
    assert (result.matched_tokens, result.source, result.num_candidates) == (0, None, 1)
    assert result.near is not None and (result.near.session_id, result.near.divergence) == ("a", 0)
    assert store.resume("b", changed, approximate=False).num_candidates == 0


def test_an_lsh_candidate_longer_than_the_exact_match_wins_with_its_exact_pages(store) -> None:
    """The exact paths find every exact prefix of the namespace today, so this is shown on the
    matcher's answer for a store without the chain lookup: an empty exact result is improved
    to the candidate's verified prefix, source "lsh", pages the prompt's own."""
    tokens = list(range(500, 900))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    prompt = tokens[:300] + [1, 2, 3]
    buf = np.asarray(prompt, np.uint32).tobytes()
    state = store.mirror.state("a", None)
    empty = dss.ResumeResult(None, None, 0, len(prompt), 0, 4, 16)
    near = store._nearest_index()
    better = near.improve(empty, buf, L, state.user_ref, None, "default")
    assert (better.matched_tokens, better.source, better.num_candidates) == (300, "lsh", 1)
    assert better.near is not None and better.near.divergence == 300
    assert_exact(store, better, prompt)


def test_prefetch_candidates_promotes_the_reusable_pages(open_store) -> None:
    store = open_store(host_bytes=0)
    tokens = list(range(2000, 2400))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    store.close()
    store = open_store()
    assert store.stats()["host"]["pages"] == 0
    prompt = tokens[:200] + [9, 9, 9, 9] + tokens[204:]
    ids = store.prefetch_candidates(prompt, user_id="u", layout=L)
    assert len(ids) == 50
    assert store.stats()["host"]["pages"] == 50
    result = store.lookup(prompt, layout=L, user_id="u")
    assert [p.page_id for p in result.pages] == ids and set(result.tiers) == {"host"}
    assert store.prefetch_candidates(prompt, user_id="u", layout=L2) == []


def test_an_empty_prompt_is_near_nothing(open_store) -> None:
    """An empty prompt has no shingle: nearest, prefetch_candidates and an approximate resume
    answer with nothing (they used to fail inside the signature's reduction)."""
    store = open_store()
    tokens = list(range(2000, 2040))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    assert store.nearest([], session_id="a") == []
    assert store.prefetch_candidates([], session_id="a") == []
    assert store.resume("a", [], approximate=True).matched_tokens == 0
    assert store.check() == []


def test_index_follows_commit_branch_delete_and_other_processes(open_store) -> None:
    store = open_store()
    tokens = list(range(3000, 3300))
    store.create_session("a", user_id="u", layout=L)
    store.commit("a", tokens, kv_pages(tokens))
    assert [c.session_id for c in store.nearest(tokens, user_id="u", layout=L)] == ["a"]
    entries = store.stats()["lsh"]["entries"]
    assert entries == 1 + 2  # the whole version, windows at 0 and 256
    store.branch("a", store.session("a").head_id, "b")
    assert store.stats()["lsh"]["entries"] == entries + 3
    assert sorted(c.session_id for c in store.nearest(tokens, user_id="u", layout=L)) == ["a", "b"]
    store.delete_session("a")
    assert [c.session_id for c in store.nearest(tokens, user_id="u", layout=L)] == ["b"]
    assert store.stats()["lsh"]["entries"] == 3
    other = open_store()  # another process's handle on the same store
    other.create_session("c", user_id="u", layout=L)
    more = tokens + [1, 2, 3, 4]
    other.commit("c", more, kv_pages(more))
    other.delete_session("b")
    assert [c.session_id for c in store.nearest(tokens, user_id="u", layout=L)] == ["c"]
    other.create_session("d", user_id="u", layout=L2)  # the same tokens in another layout, by the other process
    other.commit("d", more)
    other.commit("c", more + [5, 6, 7, 8])
    assert [(c.session_id, c.num_tokens) for c in store.nearest(more, user_id="u", layout=L)] == [
        ("c", 304),
        ("c", 308),
    ]
    assert [c.session_id for c in store.nearest(more, user_id="u", layout=L2)] == ["d"]
    assert store.check() == []
    lsh = store._nearest_index().lsh
    (user_ref, _), bucket = next(iter(lsh.buckets.items()))
    lsh.add(bucket, 999_999, 1, np.asarray([1, 2, 3, 4, 5], np.uint32).tobytes(), 4)  # a planted stray entry
    assert store.check() == [f"LSH entry 999999:1:0:5:v of namespace {user_ref}: its session is gone"]


def test_forget_user_removes_the_entries_and_the_receipt_inspects_the_index(open_store) -> None:
    store = open_store()
    tokens = list(range(4000, 4300))
    for user in ("alice", "bob"):
        store.create_session(f"s-{user}", user_id=user, layout=L)
        store.commit(f"s-{user}", tokens, kv_pages(tokens))
        assert len(store.nearest(tokens, user_id=user, layout=L)) == 1
    receipt = store.forget_user("alice", tenant_id="default")
    check = next(c for c in receipt.verification.checks if c.name == "lsh index")
    assert (check.ok, check.detail) == (True, "no entry of the user in memory")
    assert store.nearest(tokens, user_id="alice", layout=L) == []
    assert [c.session_id for c in store.nearest(tokens, user_id="bob", layout=L)] == ["s-bob"]
    assert store.stats()["lsh"]["entries"] == 3


def test_realign_finds_where_the_two_run_together_again() -> None:
    """Inserted, replaced and deleted stretches after a divergence at 3."""

    def u32(*parts: object) -> np.ndarray:
        return np.concatenate([np.asarray(p, np.uint32) for p in parts])

    a = u32(range(1, 15))
    inserted = u32(a[:3], [50, 51], a[3:])
    assert realign(inserted, a, 3, 2) == (5, 3, 11)
    replaced = u32(a[:3], [50], a[4:])
    assert realign(replaced, a, 3, 2) == (4, 4, 10)
    deleted = u32(a[:3], a[5:])
    assert realign(deleted, a, 3, 2) == (3, 5, 9)
    assert realign(np.asarray([1, 2, 3, 90, 91, 92, 93], np.uint32), a, 3, 2) is None


def test_redis_index_is_shared_and_erased(tmp_path, redis_url: str) -> None:
    """With lsh_redis_url, the index lives in Redis: another node's store finds versions it
    never indexed itself, and an erasure deletes the namespace's keys there too."""
    import pickle

    import redis

    prefix = f"t{uuid.uuid4().hex[:10]}"
    options = {"lsh_redis_url": redis_url, "lsh_redis_prefix": prefix, "fsync": False}
    first = dss.open(tmp_path / "s", **options)
    tokens = list(range(5000, 5300))
    first.create_session("a", user_id="alice", layout=L)
    first.commit("a", tokens, kv_pages(tokens))
    assert [c.session_id for c in first.nearest(tokens, user_id="alice", layout=L)] == ["a"]  # builds it in Redis
    first.create_session("b", user_id="alice", layout=L)
    first.commit("b", tokens[:290], kv_pages(tokens[:290]))  # indexed in Redis at once
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    assert keys and all(k.startswith(f"{prefix}:".encode()) for k in keys)
    second = dss.open(tmp_path / "s", **options)
    found = second.nearest(tokens, user_id="alice", layout=L)
    assert [c.session_id for c in found] == ["a", "b"]
    assert second.stats()["lsh"]["entries"] == 0 and second.stats()["lsh"]["storage"] == "redis"
    first.create_session("c", user_id="alice", layout=L)
    first.commit("c", tokens[:280])
    c_ref = str(first.sql("SELECT MAX(id) FROM sessions").rows[0][0])
    assert any(
        pickle.loads(k).startswith(f"{c_ref}:")
        for name in client.scan_iter(match=f"{prefix}:*:_keys")
        for k in client.hkeys(name)
    )
    third = dss.open(tmp_path / "s", **options)  # never queried the index: deleting still cleans Redis
    third.delete_session("c")
    third.close()
    assert [c.session_id for c in second.nearest(tokens, user_id="alice", layout=L)] == ["a", "b"]
    left = [pickle.loads(k) for name in client.scan_iter(match=f"{prefix}:*:_keys") for k in client.hkeys(name)]
    assert left and not [k for k in left if k.startswith(f"{c_ref}:")]
    receipt = second.forget_user("alice", tenant_id="default")
    check = next(c for c in receipt.verification.checks if c.name == "lsh index")
    assert (check.ok, check.detail) == (True, "no entry of the user in memory and in Redis")
    assert list(client.scan_iter(match=f"{prefix}:*")) == []
    assert first.nearest(tokens, user_id="alice", layout=L) == []
    first.close()
    second.close()


def test_with_approximate_on_the_index_is_built_at_open(open_store) -> None:
    """Built from the catalog when the store opens (most recently used namespaces first, while
    there is room), not on the first request."""
    store = open_store()
    for user in ("a", "b"):
        tokens = list(range(7000, 7300)) if user == "a" else list(range(8000, 8100))
        store.create_session(f"s-{user}", user_id=user, layout=L)
        store.commit(f"s-{user}", tokens)
    store.create_session("empty", user_id="c", layout=L)
    store.close()
    reopened = open_store(approximate=True)
    assert reopened.stats()["lsh"]["indexes"] == 2 and reopened.stats()["lsh"]["entries"] == 3 + 1
    assert [c.session_id for c in reopened.nearest(list(range(8000, 8100)), user_id="b", layout=L)] == ["s-b"]
    small = open_store(approximate=True, lsh_max_entries=1)
    assert small.stats()["lsh"]["indexes"] == 1  # the newest namespace (b); a's is built when first used
