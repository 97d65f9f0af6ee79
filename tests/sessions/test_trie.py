"""The radix trie: a hand-worked example, and a property test against plain lists."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from dss.core.tokens import pack
from dss.core.types import PageId, VersionId
from dss.sessions.trie import Trie


def fake_ids(prev: PageId, buf: bytes, first: int, count: int) -> list[PageId]:
    """Page ids that spell the page's tokens, so the example below can be read off by eye."""
    out = []
    for k in range(first, first + count):
        out.append(PageId(bytes(buf[k * 8 : (k + 1) * 8][::4])))
    return out


def test_hand_worked_example() -> None:
    """Page size 2. Insert, in order:

    v1 = 1 2 3 4 5          -> one leaf [1 2 3 4 5]; pages (1 2) (3 4)
    v2 = 1 2 3 4 5 6 7      -> the childless leaf grows in place: [1..7]; page (5 6) added
    v3 = 1 2 3 9            -> diverges after 3: split into [1 2 3] + [4 5 6 7], new leaf [9];
                               [1 2 3] keeps page (1 2); (3 4) belongs to [4 5 6 7] because its last
                               token 4 lies there; [9] gets page (3 9)
    v4 = 1 2                -> ends inside [1 2 3]: no new node, a position at depth 2

    So: 4 nodes (root, [1 2 3], [4 5 6 7], [9]); v1 ends at depth 5 on [4 5 6 7].
    """
    trie = Trie(2, PageId(b"root"), fake_ids)
    v1 = trie.insert(pack([1, 2, 3, 4, 5]), VersionId(1))
    v2 = trie.insert(pack([1, 2, 3, 4, 5, 6, 7]), VersionId(2))
    assert trie.num_nodes == 2 and v1.node is v2.node and v2.node.page_ids == (b"\x01\x02", b"\x03\x04", b"\x05\x06")
    v3 = trie.insert(pack([1, 2, 3, 9]), VersionId(3))
    v4 = trie.insert(pack([1, 2]), VersionId(4))
    assert trie.num_nodes == 4
    upper = v4.node
    assert (upper.start, upper.depth, upper.page_ids) == (0, 3, (b"\x01\x02",))
    assert (v1.node.start, v1.node.depth, v1.node.page_ids) == (3, 7, (b"\x03\x04", b"\x05\x06"))
    assert (v3.node.start, v3.node.depth, v3.node.page_ids) == (3, 4, (b"\x03\x09",))
    assert (v1.depth, v2.depth, v3.depth, v4.depth) == (5, 7, 4, 2)
    assert trie.tokens_of(v1) == pack([1, 2, 3, 4, 5])
    assert trie.page_ids_of(v3) == [b"\x01\x02", b"\x03\x09"]
    match = trie.walk(pack([1, 2, 3, 4, 5, 6, 8]))
    assert match.num_tokens == 6 and match.path == [upper, v1.node]
    assert trie.version_along(v1.node, 6, v4) == 2  # the head (v4) stops at 2; v2 is the newest passing 6
    assert trie.version_along(upper, 2, v4) == 4
    assert trie.version_along(v1.node, 5, v4) == 2
    assert trie.version_along(v1.node, 5, v1) == 1  # v2 is newer and passes 5 too, but the head v1 does
    assert trie.version_along(upper, 3, v3) == 3  # v3 ends below [1 2 3]: it runs along it; v4 (newer) stops at 2
    spans = trie.available(match, 0, lambda page_id: 0 if page_id == b"\x05\x06" else 2)
    assert [(s.first, s.count) for s in spans] == [(0, 1), (1, 1)]  # page 2 (5 6) is absent


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12),
    st.lists(st.integers(0, 3), max_size=14),
)
def test_walk_equals_longest_common_prefix(histories: list[list[int]], prompt: list[int]) -> None:
    trie = Trie(3, PageId(b"r"), fake_ids)
    positions = [trie.insert(pack(h), VersionId(i + 1)) for i, h in enumerate(histories)]
    for history, position in zip(histories, positions):
        assert trie.tokens_of(position) == pack(history)
        assert len(trie.page_ids_of(position)) == len(history) // 3
    best = max(_lcp(prompt, h) for h in histories)
    assert trie.walk(pack(prompt)).num_tokens == best
    match = trie.walk(pack(prompt))
    if best:
        node = match.path[-1]
        version = trie.version_along(node, best, positions[-1])
        assert histories[version - 1][:best] == prompt[:best]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
