"""The token trie of one session: a radix tree over packed token runs.

Every committed token sequence of a session is a path from the root. Edges are compressed
runs of tokens (packed bytes, see :mod:`dss.core.tokens`) and nodes exist only where histories
diverge, so a 40-turn conversation that only ever grew is a single edge, and a walk is one
``memcmp``. A version is a :class:`Position` — a node and a depth on its edge — that stays
valid when later inserts split edges. Each node holds the ids of the pages whose last token
lies on its edge, so a walk yields the page ids of a matched prefix without hashing.

The trie only grows: versions are immutable and a session is dropped as a whole. Nothing
here does I/O; page ids come from the ``page_ids`` callback given at construction and tier
codes from the ``code_of`` callback given to :meth:`Trie.available`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from dss.core.tokens import TOKEN_BYTES
from dss.core.types import PageId, VersionId

PageIdsFn = Callable[[PageId, bytes, int, int], list[PageId]]
"""``page_ids(prev_id, buf, first, count)``: ids of pages first..first+count-1 of ``buf``."""


@dataclass(slots=True, eq=False)
class Node:
    """An edge of the trie and the node at its end.

    ``tokens`` is the packed edge, covering token positions ``[start, depth)``;
    ``page_ids`` are the pages whose last token lies on the edge; ``versions`` the
    positions of versions ending on it; ``below`` the newest version ending strictly
    under it; ``codes`` caches the pages' tier codes (0: absent), valid while ``gen``
    equals the namespace's generation.
    """

    tokens: bytes
    start: int
    depth: int
    parent: Node | None
    page_ids: tuple[PageId, ...] = ()
    children: dict[int, Node] = field(default_factory=dict)
    versions: list[Position] = field(default_factory=list)
    below: VersionId | None = None
    gen: int = -1
    codes: bytearray = field(default_factory=bytearray)


@dataclass(slots=True, eq=False)
class Position:
    """Where version ``version_id`` ends: ``depth`` tokens deep, on ``node``'s edge."""

    version_id: VersionId
    node: Node
    depth: int


class Span(NamedTuple):
    """``count`` leading pages of one node: page ``first`` onwards, with their ids and tier codes."""

    first: int
    page_ids: tuple[PageId, ...]
    codes: bytearray
    count: int  # type: ignore[assignment]  # a field named like tuple.count


class Match:
    """The result of :meth:`Trie.walk`: ``num_tokens`` matched; ``path`` the nodes entered,
    the last one possibly only partly."""

    __slots__ = ("num_tokens", "path")

    def __init__(self, num_tokens: int, path: list[Node]) -> None:
        self.num_tokens = num_tokens
        self.path = path


class Trie:
    """A session's radix trie. Not thread-safe; the store serialises access."""

    __slots__ = ("_page_ids", "num_nodes", "page_tokens", "root", "root_id")

    def __init__(self, page_tokens: int, root_id: PageId, page_ids: PageIdsFn) -> None:
        self.root = Node(b"", 0, 0, None)
        self.page_tokens = page_tokens
        self.root_id = root_id
        self._page_ids = page_ids
        self.num_nodes = 1

    # -- reading ---------------------------------------------------------------------------

    def walk(self, buf: bytes | memoryview) -> Match:
        """Follow the packed prompt ``buf`` as far as the trie holds it. Does not modify the trie.

        ``buf`` may be a memoryview (a zero-copy view of the caller's array): edges are
        compared against slices of it, one ``memcmp`` each.
        """
        view = memoryview(buf)
        node = self.root
        pos = 0
        end = len(view)
        path: list[Node] = []
        while pos < end:
            child = node.children.get(int.from_bytes(view[pos : pos + TOKEN_BYTES], "little"))
            if child is None:
                break
            path.append(child)
            edge = child.tokens
            stop = pos + len(edge)
            if stop <= end and edge.startswith(view[pos:stop]):
                pos = stop
                node = child
                continue
            pos += TOKEN_BYTES * _common(edge, view, pos)
            break
        return Match(pos // TOKEN_BYTES, path)

    def available(self, match: Match, gen: int, code_of: Callable[[PageId], int]) -> list[Span]:
        """The leading pages of ``match`` whose bytes some tier holds, as spans in order.

        Every page the spans cover is present (tier code > 0), and their count times
        ``page_tokens`` never exceeds ``match.num_tokens``. Refreshes a node's tier-code
        cache when ``gen`` moved on; a span keeps the ids and codes it saw, so later
        changes to the trie do not alter it.
        """
        page_tokens = self.page_tokens
        limit = match.num_tokens
        spans: list[Span] = []
        for node in match.path:
            usable = min(node.depth, limit) // page_tokens - node.start // page_tokens
            if usable > 0:
                hole = _codes(node, gen, code_of).find(0, 0, usable)
                if hole >= 0:
                    if hole:
                        spans.append(Span(node.start // page_tokens, node.page_ids, node.codes, hole))
                    break
                spans.append(Span(node.start // page_tokens, node.page_ids, node.codes, usable))
            if node.depth >= limit:
                break
        return spans

    def page_table(self, match: Match, gen: int, code_of: Callable[[PageId], int]) -> tuple[list[PageId], bytearray]:
        """Ids and tier codes of every page within ``match``, holes included (code 0)."""
        page_tokens = self.page_tokens
        limit = match.num_tokens
        ids: list[PageId] = []
        codes = bytearray()
        for node in match.path:
            usable = min(node.depth, limit) // page_tokens - node.start // page_tokens
            if usable > 0:
                ids.extend(node.page_ids[:usable])
                codes += _codes(node, gen, code_of)[:usable]
        return ids, codes

    def version_along(self, node: Node, depth: int, head: Position | None) -> VersionId | None:
        """A version whose history passes ``depth`` tokens deep on ``node``'s edge.

        ``head`` when it does, else the newest such version. ``depth`` must lie in
        ``(node.start, node.depth]``.
        """
        if head is not None and _passes(head, node, depth):
            return head.version_id
        best = node.below
        for position in node.versions:
            if position.depth >= depth and (best is None or position.version_id > best):
                best = position.version_id
        return best

    def tokens_of(self, position: Position) -> bytes:
        """The packed tokens from the root to ``position``."""
        path = self._path_to(position.node)
        return b"".join(n.tokens for n in path)[: TOKEN_BYTES * position.depth]

    def page_ids_of(self, position: Position) -> list[PageId]:
        """Ids of every full page up to ``position``, in order."""
        out: list[PageId] = []
        for node in self._path_to(position.node):
            out.extend(node.page_ids)
        return out[: position.depth // self.page_tokens]

    def chain(self, prev: PageId, buf: bytes, first: int, count: int) -> list[PageId]:
        """Ids of pages ``first .. first+count-1`` of ``buf`` given the id of page ``first-1``."""
        return self._page_ids(prev, buf, first, count)

    # -- growing ---------------------------------------------------------------------------

    def insert(self, buf: bytes, version_id: VersionId, walk: Match | None = None) -> Position:
        """Add the packed sequence ``buf`` as version ``version_id``; return where it ends.

        Extends a leaf in place when the sequence continues it, splits an edge where the
        sequence diverges inside it, and computes page ids only for new tokens.
        ``version_id`` must be larger than every id inserted before. ``walk`` is what
        :meth:`walk` returned for ``buf`` on this trie, unchanged since: the insert starts
        where it ended instead of comparing the matched edges again.
        """
        node = self.root
        pos = 0
        end = len(buf)
        if walk is not None:
            for entered in walk.path:
                if entered.depth > walk.num_tokens:
                    break
                node, pos = entered, TOKEN_BYTES * entered.depth
        while pos < end:
            child = node.children.get(int.from_bytes(buf[pos : pos + TOKEN_BYTES], "little"))
            if child is None:
                if node is not self.root and not node.children:
                    self._extend(node, buf)
                else:
                    node = self._add_leaf(node, buf, pos)
                break
            if buf.startswith(child.tokens, pos):
                pos += len(child.tokens)
                node = child
                continue
            common = _common(child.tokens, memoryview(buf), pos)
            if pos + TOKEN_BYTES * common == end:
                node = child
                break
            node = self._split(child, child.start + common)
            pos += TOKEN_BYTES * common
        position = Position(version_id, node, end // TOKEN_BYTES)
        node.versions.append(position)
        parent = node.parent
        while parent is not None:
            parent.below = version_id
            parent = parent.parent
        return position

    def _new_ids(self, parent: Node, buf: bytes, start: int, depth: int) -> tuple[PageId, ...]:
        first = start // self.page_tokens
        count = depth // self.page_tokens - first
        if count <= 0:
            return ()
        return tuple(self._page_ids(self._last_page_id(parent), buf, first, count))

    def _add_leaf(self, parent: Node, buf: bytes, pos: int) -> Node:
        start, depth = pos // TOKEN_BYTES, len(buf) // TOKEN_BYTES
        leaf = Node(buf[pos:], start, depth, parent, self._new_ids(parent, buf, start, depth))
        parent.children[int.from_bytes(buf[pos : pos + TOKEN_BYTES], "little")] = leaf
        self.num_nodes += 1
        return leaf

    def _extend(self, leaf: Node, buf: bytes) -> None:
        """Grow a childless leaf so its edge reaches the end of ``buf`` (which continues it)."""
        depth = len(buf) // TOKEN_BYTES
        leaf.page_ids = leaf.page_ids + self._new_ids(leaf, buf, leaf.depth, depth)
        leaf.tokens = leaf.tokens + buf[TOKEN_BYTES * leaf.depth :]
        leaf.depth = depth
        leaf.gen = -1

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s edge at depth ``at``; return the new upper node ending at ``at``."""
        assert node.start < at < node.depth and node.parent is not None
        cut = TOKEN_BYTES * (at - node.start)
        num_upper = at // self.page_tokens - node.start // self.page_tokens
        upper = Node(node.tokens[:cut], node.start, at, node.parent, node.page_ids[:num_upper])
        node.parent.children[int.from_bytes(node.tokens[:TOKEN_BYTES], "little")] = upper
        upper.children[int.from_bytes(node.tokens[cut : cut + TOKEN_BYTES], "little")] = node
        node.tokens = node.tokens[cut:]
        node.start = at
        node.parent = upper
        node.page_ids = node.page_ids[num_upper:]
        node.gen = -1
        upper.versions = [p for p in node.versions if p.depth <= at]
        node.versions = [p for p in node.versions if p.depth > at]
        for position in upper.versions:
            position.node = upper
        newest = [p.version_id for p in node.versions]
        if node.below is not None:
            newest.append(node.below)
        upper.below = max(newest) if newest else None
        self.num_nodes += 1
        return upper

    def _path_to(self, node: Node) -> list[Node]:
        out: list[Node] = []
        current: Node | None = node
        while current is not None and current.parent is not None:
            out.append(current)
            current = current.parent
        out.reverse()
        return out

    def _last_page_id(self, node: Node) -> PageId:
        """The id of the last full page ending at or above the end of ``node``."""
        current: Node | None = node
        while current is not None:
            if current.page_ids:
                return current.page_ids[-1]
            current = current.parent
        return self.root_id


def _codes(node: Node, gen: int, code_of: Callable[[PageId], int]) -> bytearray:
    """The node's tier codes, recomputed if the namespace's generation moved on."""
    if node.gen != gen:
        node.codes = bytearray(map(code_of, node.page_ids))
        node.gen = gen
    return node.codes


def _passes(position: Position, node: Node, depth: int) -> bool:
    """Whether the history ending at ``position`` passes ``depth`` tokens deep on ``node``."""
    current: Node | None = position.node
    if current is node:
        return position.depth >= depth
    while current is not None and current.start >= node.depth:
        current = current.parent
    return current is node


def _common(edge: bytes, view: memoryview, pos: int) -> int:
    """How many leading tokens ``edge`` shares with ``view[pos:]`` (both packed, 4 bytes a token)."""
    low, high = 0, min(len(edge), len(view) - pos) // TOKEN_BYTES
    while low < high:
        mid = (low + high + 1) // 2
        if edge.startswith(view[pos : pos + TOKEN_BYTES * mid]):
            low = mid
        else:
            high = mid - 1
    return low
