"""The MinHash-LSH index (dss/lsh.py): shingles, exact Jaccard, what it proposes, its bound, its settings."""

from __future__ import annotations

import numpy as np
import pytest

import dss
from dss.approx.lsh import Entry, LshIndex, Settings
from dss.approx.minhash import Signer, jaccard, prefix_ends, shingle_hashes, shingles, window_starts
from dss.core.errors import ConfigError

DIGEST = b"L" * 32
KEY = b"k" * 32


def packed(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.uint32).tobytes()


def proposed(index: LshIndex, bucket: object, tokens: list[int]) -> set[tuple[int, int]]:
    return {(h.entry.session_ref, h.entry.version_id) for h in index.query(bucket, packed(tokens), 4)}  # type: ignore[arg-type]


def test_hand_worked_example() -> None:
    """Two near copies and one far one, at the default settings (shingles of 4 tokens,
    threshold 0.85, 128 permutations).

    A = 0, 1, ..., 39 (40 tokens). Its shingles are (0,1,2,3), (1,2,3,4), ..., (36,37,38,39):
    40 - 4 + 1 = 37 of them.

    B = A + [40]: A's 37 shingles and (37,38,39,40): 38. Common 37, union 38, so the exact
    Jaccard similarity is 37/38 = 0.974.

    C = A with every fifth token (0, 5, ..., 35) replaced by 1000 + that token: a shingle of C
    is one of A's only when its 4 positions hold no multiple of 5, i.e. it starts at 1, 6, 11,
    ..., 36: 8 shingles. Common 8, union 37 + 37 - 8 = 66: Jaccard 8/66 = 0.121.

    With threshold 0.85, datasketch (weights 0.1/0.9, see ``dss.approx.lsh.WEIGHTS``) splits the
    128 values into b = 11 bands of r = 11 rows; a stored set of Jaccard J with the query is
    proposed with probability 1 - (1 - J**11)**11: for B, 1 - (1 - 0.974**11)**11 =
    1 - 0.2516**11 ≈ 1 - 2.5e-7 — proposed; for C, 1 - (1 - 0.121**11)**11 ≈ 9e-10 — not.
    (A query with A finds A itself: J = 1.)
    """
    a = list(range(40))
    b = a + [40]
    c = [1000 + t if t % 5 == 0 else t for t in a]
    arr = {name: np.asarray(seq, dtype=np.uint32) for name, seq in {"a": a, "b": b, "c": c}.items()}
    assert len(shingles(arr["a"], 4)) == 37 and shingles(arr["a"], 4)[0].tolist() == [0, 1, 2, 3]
    assert len(shingles(arr["b"], 4)) == 38 and shingles(arr["b"], 4)[-1].tolist() == [37, 38, 39, 40]
    common_c = {tuple(r) for r in shingles(arr["a"], 4)} & {tuple(r) for r in shingles(arr["c"], 4)}
    assert sorted(s[0] for s in common_c) == [1, 6, 11, 16, 21, 26, 31, 36]
    assert jaccard(arr["a"], arr["b"], 4) == 37 / 38
    assert jaccard(arr["a"], arr["c"], 4) == 8 / 66
    index = LshIndex(Settings())
    assert index.bands == (11, 11)
    bucket, built = index.open_bucket(1, DIGEST, KEY)
    assert not built
    index.add(bucket, 10, 1, packed(b), 4)
    index.add(bucket, 10, 2, packed(c), 4)
    assert proposed(index, bucket, a) == {(10, 1)}
    assert proposed(index, bucket, b) == {(10, 1)}
    assert proposed(index, bucket, c) == {(10, 2)}


def test_shingles_of_short_sequences_and_salts() -> None:
    """A sequence shorter than a shingle is one shingle; the salt keys the hashes, not the sets."""
    short = np.asarray([7, 8], dtype=np.uint32)
    assert shingles(short, 4).tolist() == [[7, 8]]
    assert len(shingle_hashes(short, 4)) == 1
    x = np.arange(50, dtype=np.uint32)
    assert not np.array_equal(shingle_hashes(x, 4, salt=1), shingle_hashes(x, 4, salt=2))
    assert jaccard(x, x[:40], 4, salt=1) == jaccard(x, x[:40], 4, salt=2) == 37 / 47


def test_window_starts_are_page_aligned() -> None:
    assert window_starts(100, 256, 16, 4) == [0]
    assert window_starts(1000, 256, 16, 4) == [0, 256, 512, 768]
    assert window_starts(1000, 250, 16, 4) == [0, 240, 480, 720, 960]  # 250 -> 240: a page multiple


def test_windows_find_a_long_stretch_after_an_early_divergence() -> None:
    """A prompt that shares only a long stretch with a stored version (its first half is new):
    the whole-sequence Jaccard is far below the threshold, a window's is not."""
    rng = np.random.default_rng(3)
    stored = rng.integers(0, 30000, 1024).tolist()
    prompt = rng.integers(30000, 60000, 1024).tolist() + stored[:1024]
    assert jaccard(np.asarray(prompt, np.uint32), np.asarray(stored, np.uint32), 4) < 0.6
    index = LshIndex(Settings())
    bucket, _ = index.open_bucket(1, DIGEST, KEY)
    index.add(bucket, 5, 9, packed(stored), 16)
    hits = index.query(bucket, packed(prompt), 16)
    assert {(h.entry.session_ref, h.entry.version_id) for h in hits} == {(5, 9)}
    assert all(h.entry.is_window and h.prompt_start >= 1024 for h in hits)


def test_prefix_ends_and_prefix_signatures() -> None:
    """The prefixes a containment query asks for are 8 % apart, at least 16 shingles, the whole
    left out; each prefix's signature is the signature of its hashes alone."""
    assert prefix_ends(40, 1.08, 16) == [17, 18, 20, 21, 23, 25, 27, 29, 31, 34, 37]  # 40 / 1.08**k, floored
    assert prefix_ends(15, 1.08, 16) == []
    assert prefix_ends(1000, 2.0, 100) == [125, 250, 500]
    signer = Signer(128)
    hashes = shingle_hashes(np.arange(300, dtype=np.uint32), 4)
    columns = signer.prefixes(signer.permuted(hashes), [20, 100, 297])
    for i, end in enumerate([20, 100, 297]):
        assert np.array_equal(columns[:, i], signer.values(hashes[:end])[0])
    assert signer.prefixes(signer.permuted(hashes), []).shape == (128, 0)


def test_a_next_turn_finds_the_version_it_extends() -> None:
    """A stored turn re-rendered (6 tokens of a line changed) and extended by a new message as
    long as a third of it: its Jaccard with the stored version is about 0.7, far under the
    threshold, and the whole prompt does not find it; one of the prompt's prefixes does. The
    bands several prefixes share are looked up once, and find what ``MinHashLSH.query`` finds."""
    rng = np.random.default_rng(4)
    stored = rng.integers(0, 30000, 180).tolist()
    prompt = stored[:8] + [60000 + i for i in range(6)] + stored[14:] + rng.integers(0, 30000, 60).tolist()
    assert 0.6 < jaccard(np.asarray(prompt, np.uint32), np.asarray(stored, np.uint32), 4) < 0.75
    index = LshIndex(Settings())
    bucket, _ = index.open_bucket(1, DIGEST, KEY)
    index.add(bucket, 5, 9, packed(stored), 16)
    index.add(bucket, 6, 1, packed(rng.integers(0, 30000, 180).tolist()), 16)
    assert not bucket.lsh.query(
        index.signer.minhash(index.signer.values(shingle_hashes(np.asarray(prompt, np.uint32), 4, bucket.salt))[0])
    )
    assert [(h.entry, h.prompt_start) for h in index.query(bucket, packed(prompt), 16)] == [(Entry(5, 9, 0, 180), 0)]
    signer = index.signer
    sigs = signer.permuted(shingle_hashes(np.asarray(stored, np.uint32), 4, bucket.salt)).min(axis=1)
    assert index._lookup(bucket.containment, np.column_stack([sigs, sigs])) == {Entry(5, 9, 0, 180).key(): 0}


def test_windows_already_indexed_for_the_session_are_not_indexed_again() -> None:
    index = LshIndex(Settings(window_tokens=64))
    bucket, _ = index.open_bucket(1, DIGEST, KEY)
    turn1 = list(range(200))
    assert index.add(bucket, 5, 1, packed(turn1), 16) == 1 + 4  # the whole and windows at 0, 64, 128, 192
    assert index.add(bucket, 5, 2, packed(turn1 + list(range(500, 600))), 16) == 1 + 2  # windows 192 (longer), 256
    assert index.num_entries == 8
    index.drop_session(5)
    assert index.num_entries == 0 and not bucket.entries and not bucket.windows


def test_size_is_bounded() -> None:
    """At the bound, the least recently used other index goes whole; alone, the oldest entries go."""
    index = LshIndex(Settings(max_entries=3))
    first, _ = index.open_bucket(1, DIGEST, KEY)
    second, _ = index.open_bucket(2, DIGEST, KEY)
    index.add(first, 1, 1, packed([1, 2, 3, 4, 5]), 4)
    index.add(first, 1, 2, packed([1, 2, 3, 4, 6]), 4)
    index.add(second, 2, 1, packed([9, 9, 9, 9]), 4)
    assert index.num_entries == 3
    index.add(second, 2, 2, packed([8, 8, 8, 8]), 4)
    assert index.bucket(1, DIGEST) is None and index.num_dropped == 1
    assert index.stats() == {
        "indexes": 1,
        "entries": 2,
        "capacity": 3,
        "dropped_indexes": 1,
        "bands": 11,
        "rows": 11,
        "storage": "memory",
    }
    for v in (3, 4):
        index.add(second, 2, v, packed([v, v, v, v, 7]), 4)
    assert [e.version_id for e in second.entries.values()] == [2, 3, 4]


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("lsh_threshold", 1.5, "lsh_threshold: Input should be less than 1"),
        ("lsh_threshold", 0, "lsh_threshold: Input should be greater than 0"),
        ("lsh_permutations", 8, "lsh_permutations: Input should be greater than or equal to 16"),
        ("lsh_shingle_tokens", 0, "lsh_shingle_tokens: Input should be greater than or equal to 1"),
        ("lsh_window_tokens", 8, "lsh_window_tokens: Input should be greater than or equal to 16"),
        ("lsh_min_share", 2, "lsh_min_share: Input should be less than or equal to 1"),
        ("lsh_max_entries", 0, "lsh_max_entries: Input should be greater than or equal to 1"),
        ("approximate", "often", "approximate: Input should be a valid boolean"),
        ("lsh_redis_prefix", "a b", "lsh_redis_prefix: String should match pattern"),
    ],
)
def test_nonsense_settings_are_config_errors(tmp_path, setting: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dss.open(tmp_path / "s", **{setting: value})
    assert not (tmp_path / "s").exists()


def test_window_smaller_than_a_shingle_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"lsh_window_tokens \(16\) must be at least lsh_shingle_tokens \(32\)"):
        dss.open(tmp_path / "s", lsh_window_tokens=16, lsh_shingle_tokens=32)


def test_without_datasketch_approximate_matching_is_a_config_error(tmp_path, monkeypatch) -> None:
    """dss works without datasketch; asking for approximate matching says what to install."""
    monkeypatch.setitem(__import__("sys").modules, "datasketch", None)
    with pytest.raises(ConfigError, match=r"needs the datasketch package: pip install 'dss-store\[lsh\]'"):
        dss.open(tmp_path / "a", approximate=True)
    layout = dss.Layout(name="t", page_tokens=4, page_bytes=16, model="m")
    with dss.open(tmp_path / "b") as store:
        store.create_session("s", layout=layout)
        store.commit("s", [1, 2, 3, 4])
        assert store.resume("s", [1, 2, 3, 4, 5]).matched_tokens == 0  # no KV given; exact paths work
        with pytest.raises(ConfigError, match="datasketch"):
            store.nearest([1, 2, 3], session_id="s")
        with pytest.raises(ConfigError, match="datasketch"):
            store.resume("s", [1, 2, 3], approximate=True)
        assert store.stats()["lsh"] == {"indexes": 0, "entries": 0, "capacity": 1_000_000, "storage": "none"}
