"""The writes of sessions and versions, each built as one :class:`~dss.catalog.change.Change`.

Each function here takes a session's state and a :class:`Context` (what it needs to seal and
to know which pages are stored), and returns the change that makes the write, validating its input first:
it raises a ``DssError`` before anything changes. It writes nothing; the store applies the
change (and, when another writer moved the session on meanwhile, builds it again).

Versions are stored as deltas: a new version keeps only the tokens it adds to the version it
shares the longest prefix with (its base), found by the same trie walk that yields the ids of
the prompt's pages — one walk per commit, whose end the store's own trie insert starts from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

from dss.catalog.change import Change, NewSession, NewVersion
from dss.core.errors import InvalidTokens
from dss.core.precision import EXACT_TIERS, Precision
from dss.core.tokens import TOKEN_BYTES
from dss.core.types import Layout, PageId
from dss.core.validate import check_pages
from dss.pages.index import PageIndex
from dss.pages.keys import Keys, label_aad, name_aad, tokens_aad
from dss.pages.store import new_pages
from dss.sessions.state import SessionState


class Context(NamedTuple):
    """What a builder needs besides the session's state: the keys of its namespace (to seal),
    this process's page index (to know which pages are stored already), and the precision
    each tier keeps its copies in."""

    keys: Keys
    index: PageIndex  # type: ignore[assignment]  # a field named like tuple.index
    precision: Precision = EXACT_TIERS


def create(
    session_id: str,
    session_key: bytes,
    keys: Keys,
    *,
    tenant_id: str,
    tenant_ref: int,
    user_id: str,
    user_ref: int,
    layout: Layout,
) -> Change:
    """Make a session (its id sealed under the owner's key, found by ``session_key``)."""
    sealed = keys.names.seal(session_id.encode(), name_aad(session_key))
    return Change(
        user_ref=user_ref,
        session_id=session_id,
        create=NewSession(session_id, session_key, sealed, tenant_id, tenant_ref, user_id, layout),
    )


def commit(state: SessionState, ctx: Context, buf: bytes, pages: Mapping[int, Any] | None, label: str | None) -> Change:
    """A new version of ``buf``, child of the head, that becomes the head; it holds every page
    of ``buf`` some tier holds, and stores ``pages`` (full pages of ``buf`` by index)."""
    if not buf:
        raise InvalidTokens("commit needs at least one token")
    payloads = check_pages(pages, len(buf) // TOKEN_BYTES, state.layout)
    walk = state.trie.walk(buf)
    ids = state.prompt_page_ids(buf, walk)
    base_id = state.trie.version_along(walk.path[-1], walk.num_tokens, state.head) if walk.num_tokens else None
    suffix = buf[TOKEN_BYTES * walk.num_tokens :]
    key = state.record.session_key
    version = NewVersion(
        state.head_id,
        base_id,
        walk.num_tokens,
        *_seal_tokens(ctx.keys, key, suffix),
        _seal_label(ctx.keys, key, label),
        buf,
        label,
        walk,
    )
    held = state.held
    retag, touch = _moves(held, [p for p in ids if p in held])
    fresh = tuple(p for p in ids if p not in held)
    return Change(
        user_ref=state.user_ref,
        session_ref=state.ref,
        session_id=state.session_id,
        base_seq=state.record.seq,
        layout_ref=state.record.layout_ref,
        pages=new_pages(ids, payloads, ctx.index, ctx.keys.sealer is not None, state.layout, ctx.precision),
        version=version,
        hold=fresh,
        hold_pinned=_pinned_among(state, fresh),
        retag=retag,
        touch=touch,
    )


def save(state: SessionState, ctx: Context, buf: bytes, pages: Mapping[int, Any]) -> Change:
    """Store pages of ``buf`` ahead of the commit that will contain them; the session holds
    them from now on (newest version 0: saved ahead)."""
    payloads = check_pages(pages, len(buf) // TOKEN_BYTES, state.layout)
    ids = state.prompt_page_ids(buf, state.trie.walk(buf))
    fresh = tuple(ids[i] for i in payloads if ids[i] not in state.held)
    return Change(
        user_ref=state.user_ref,
        session_ref=state.ref,
        session_id=state.session_id,
        base_seq=state.record.seq,
        layout_ref=state.record.layout_ref,
        pages=new_pages(ids, payloads, ctx.index, ctx.keys.sealer is not None, state.layout, ctx.precision),
        hold=fresh,
        hold_pinned=_pinned_among(state, fresh),
    )


def rollback(state: SessionState, ctx: Context, version_id: Any) -> Change:
    """Move the head to ``version_id`` (copies and deletes nothing)."""
    state.version_record(version_id)
    return Change(
        user_ref=state.user_ref,
        session_ref=state.ref,
        session_id=state.session_id,
        base_seq=state.record.seq,
        layout_ref=state.record.layout_ref,
        head=version_id,
    )


def pin(state: SessionState, ctx: Context, version_id: Any, pinned: bool) -> Change:
    """Pin (or unpin) a version: its pages are marked so eviction never drops them (unpinned,
    the pages no other pinned version holds are marked no longer)."""
    state.version_record(version_id)
    pages = [p for p in state.page_ids(version_id) if p in state.held]
    if pinned:
        marks: tuple[tuple[PageId, ...], tuple[PageId, ...]] = (tuple(pages), ())
    else:
        others = {p for vid, v in state.versions.items() if v.pinned and vid != version_id for p in state.page_ids(vid)}
        marks = ((), tuple(p for p in pages if p not in others))
    return Change(
        user_ref=state.user_ref,
        session_ref=state.ref,
        session_id=state.session_id,
        base_seq=state.record.seq,
        layout_ref=state.record.layout_ref,
        pin=(version_id, pinned),
        pin_pages=marks,
    )


def branch(
    state: SessionState, ctx: Context, version_id: Any, new_session_id: str, new_key: bytes, label: str | None
) -> Change:
    """A new session whose first version has ``version_id``'s tokens (stored whole) and holds
    its pages; no page is copied."""
    source = state.version_record(version_id)
    buf = state.tokens(version_id)
    made = create(
        new_session_id,
        new_key,
        ctx.keys,
        tenant_id=state.record.tenant_id,
        tenant_ref=state.record.tenant_ref,
        user_id=state.record.user_id,
        user_ref=state.user_ref,
        layout=state.layout,
    )
    version = NewVersion(
        source.version_id,
        None,
        0,
        *_seal_tokens(ctx.keys, new_key, buf),
        _seal_label(ctx.keys, new_key, label),
        buf,
        label,
        None,
    )
    return Change(
        user_ref=state.user_ref,
        session_id=new_session_id,
        create=made.create,
        version=version,
        hold=tuple(state.page_ids(version_id)),
    )


def delete(state: SessionState, ctx: Context) -> Change:
    """Delete the session and its versions; the pages no other session holds go."""
    return Change(
        user_ref=state.user_ref,
        session_ref=state.ref,
        session_id=state.session_id,
        layout_ref=state.record.layout_ref,
        delete=True,
    )


# -- helpers ---------------------------------------------------------------------------------


def _seal_tokens(keys: Keys, session_key: bytes, buf: bytes) -> tuple[bytes, bool]:
    """A token history as stored, and whether it is sealed: sealed under the owner's data key,
    bound to its session, unless the store does not encrypt."""
    if keys.sealer is None:
        return buf, False
    return keys.sealer.seal(buf, tokens_aad(session_key)), True


def _seal_label(keys: Keys, session_key: bytes, label: str | None) -> bytes | None:
    """A version label as stored: always sealed, bound to its session."""
    return keys.names.seal(label.encode(), label_aad(session_key)) if label is not None else None


def _moves(held: dict[bytes, int], pages: list[PageId]) -> tuple[tuple[int, ...], tuple[PageId, ...]]:
    """How to mark the new version as the newest holding these already-held pages: the tags
    whose every page moves (one statement each), and the pages that move one by one."""
    groups: dict[int, list[PageId]] = {}
    for page_id in pages:
        groups.setdefault(held[page_id], []).append(page_id)
    sizes = Counter(held.values())
    retag: list[int] = []
    touch: list[PageId] = []
    for tag, group in groups.items():
        if len(group) == sizes[tag]:
            retag.append(tag)
        else:
            touch += group
    return tuple(retag), tuple(touch)


def _pinned_among(state: SessionState, pages: tuple[PageId, ...]) -> frozenset[bytes]:
    """Of ``pages``, those a pinned version of the session contains."""
    if not pages or not any(v.pinned for v in state.versions.values()):
        return frozenset()
    return frozenset(state.pinned_pages().intersection(pages))
