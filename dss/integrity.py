"""``store.check()``: every invariant the store promises, verified from scratch.

Each check reads the catalog, the files and this process's caches independently of the
code paths that maintain them, and reports a broken invariant as one sentence. Read-only.
"""

from __future__ import annotations

import json

from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.exc import DatabaseError

from dss import records
from dss.errors import CatalogCorrupt, ErasureInProgress
from dss.sessions import SessionState

if TYPE_CHECKING:
    from dss.store import Store


def check(store: Store) -> list[str]:
    """Damage to the catalog (a row that does not decode, a file SQLite cannot read) is
    reported as a problem too, never raised."""
    problems: list[str] = []
    try:
        with store.catalog.read() as conn:
            problems += _layouts(conn)
            problems += _sessions(store, conn)
            problems += _pages(conn)
            problems += _segments(store, conn)
            problems += _index(store, conn)
            problems += _audit(conn)
    except DatabaseError as exc:
        problems.append(f"the catalog cannot be read: {str(exc.orig or exc).strip().splitlines()[0]}")
    problems += store.host.check()
    return problems


def _layouts(conn: object) -> list[str]:
    problems: list[str] = []
    layouts = records.layouts
    for ref, spec in conn.execute(select(layouts.c.id, layouts.c.spec)):  # type: ignore[attr-defined]
        try:
            records.stored_layout(ref, spec)
        except CatalogCorrupt as exc:
            problems.append(str(exc))
    return problems


def _audit(conn: object) -> list[str]:
    problems: list[str] = []
    for row in records.audit_rows(conn):  # type: ignore[arg-type]
        try:
            json.loads(row[5])
        except ValueError:
            problems.append(f"audit receipt {row[0]} does not decode: the row is damaged")
    return problems


def _sessions(store: Store, conn: object) -> list[str]:
    problems: list[str] = []
    try:
        listed = records.list_sessions(conn)  # type: ignore[arg-type]
    except CatalogCorrupt:
        return []  # a layout does not decode (reported by _layouts): no session can be rebuilt
    for record, _ in listed:
        try:
            record = store.mirror.opened(record, conn)
            name = f"session {record.session_id!r} (tenant {record.tenant_id!r})"
            rows = records.session_versions(conn, record.ref)  # type: ignore[arg-type]
            versions = store.mirror.unsealed(record, rows, conn)
            key = store.mirror.keys(record.user_ref, conn).hash_key
        except CatalogCorrupt as exc:
            problems.append(str(exc))
            continue
        except ErasureInProgress:
            continue  # its user's erasure, under way, removes it
        by_id = {v.version_id: v for v in versions}
        if record.head_id is None and versions:
            problems.append(f"{name} has versions but no head")
        if record.head_id is not None and record.head_id not in by_id:
            problems.append(f"{name} has head {record.head_id}, which is not one of its versions")
        broken = _broken_versions(versions, by_id, name)
        problems += broken
        if broken:  # the trie cannot be rebuilt from them; the checks below would only repeat it
            continue
        fresh = SessionState(record, key, store.index.namespace(record.user_ref), versions, {})
        contained: set[bytes] = set()
        for version_id in fresh.positions:
            contained.update(fresh.page_ids(version_id))
        refs = records.refs
        committed = {bytes(r[0]) for r in conn.execute(  # type: ignore[attr-defined]
            select(refs.c.page_id).where(refs.c.session_ref == record.ref, refs.c.version_ref != 0))}
        stray = committed - contained
        if stray:
            problems.append(f"{name} references {len(stray)} pages none of its versions contains")
        cached = store.mirror.sessions.get(record.ref)
        if cached is not None and record.seq == cached.record.seq:
            if cached.head_id != record.head_id or set(cached.versions) != set(by_id):
                problems.append(f"{name}: this process's cached versions or head differ from the catalog")
            for version_id in by_id:
                if version_id in cached.positions and cached.tokens(version_id) != fresh.tokens(version_id):
                    problems.append(f"{name}: cached tokens of version {version_id} differ from the catalog")
    return problems


def _broken_versions(versions: list[records.VersionRecord], by_id: dict[int, records.VersionRecord],
                     name: str) -> list[str]:
    """Versions whose stored delta does not rebuild their token history."""
    problems = []
    for v in versions:
        if v.base_id is not None and (v.base_id not in by_id or v.base_id >= v.version_id):
            problems.append(f"version {v.version_id} of {name} builds on version {v.base_id} outside its session")
        elif v.base_id is not None and v.base_len > by_id[v.base_id].num_tokens:
            problems.append(f"version {v.version_id} of {name} takes {v.base_len} tokens of a shorter base")
        if (v.base_len if v.base_id is not None else 0) + len(v.suffix) // 4 != v.num_tokens:
            problems.append(f"version {v.version_id} of {name} does not hold {v.num_tokens} tokens")
    return problems


def _pages(conn: object) -> list[str]:
    pages, refs, locations = records.pages, records.refs, records.locations
    problems: list[str] = []
    orphaned = conn.execute(  # type: ignore[attr-defined]
        select(func.count()).select_from(pages).where(~select(refs.c.page_id).where(
            refs.c.page_id == pages.c.page_id).exists())).scalar_one()
    if orphaned:
        problems.append(f"{orphaned} pages are referenced by no session")
    homeless = conn.execute(  # type: ignore[attr-defined]
        select(func.count()).select_from(pages).where(~select(locations.c.page_id).where(
            locations.c.page_id == pages.c.page_id).exists())).scalar_one()
    if homeless:
        problems.append(f"{homeless} pages have no location on any tier")
    return problems


def _segments(store: Store, conn: object) -> list[str]:
    problems: list[str] = []
    rows = records.all_segments(conn, "disk")  # type: ignore[arg-type]
    files = store.disk.files()
    locations = records.locations
    extents: dict[int, list[tuple[int, int]]] = {}
    for seg, offset, length in conn.execute(  # type: ignore[attr-defined]
            select(locations.c.segment_ref, locations.c.offset, locations.c.length).where(locations.c.tier == "disk")):
        extents.setdefault(seg, []).append((offset, length))
    for name, (ref, size) in rows.items():
        if name not in files:
            problems.append(f"page file {name} is in the catalog but missing on disk")
        elif files[name] != size:
            problems.append(f"page file {name} has {files[name]} bytes, the catalog says {size}")
        if ref not in extents:
            problems.append(f"page file {name} holds no live page but was not deleted")
        elif any(offset + length > size for offset, length in extents[ref]):
            problems.append(f"page file {name} has a page recorded beyond its end")
    for name in files:
        if name not in rows and store.disk.is_orphan(name):
            problems.append(f"page file {name} has no catalog row")
    used = sum(size for _, size in rows.values())
    total = records.tier_bytes(conn, "disk")  # type: ignore[arg-type]
    if total != used:
        problems.append(f"the disk tier's running total says {total} bytes, its segments hold {used}")
    if used > store.config.disk_bytes:
        problems.append(f"disk tier holds {used} bytes, over its capacity {store.config.disk_bytes}")
    return problems


def _index(store: Store, conn: object) -> list[str]:
    """This process's page entries agree with the catalog, and host pages are known."""
    problems: list[str] = []
    entries = store.index.entries
    durable = {e.page_id: e for e in entries.values() if e.disk is not None}
    found = {r.page_id: r for r in records.pages_by_id(conn, list(durable))}  # type: ignore[arg-type]
    for page_id, entry in durable.items():
        row = found.get(page_id)
        if row is None:
            problems.append(f"page {page_id.hex()} is cached as on disk but the catalog lost it")
        elif (row.segment, row.offset, row.length, row.checksum) != (*entry.disk, entry.checksum):  # type: ignore[misc]
            problems.append(f"page {page_id.hex()} is cached with another location or checksum than the catalog's")
    for page_id in store.host.ids():
        if page_id not in entries:
            problems.append(f"host tier holds page {page_id.hex()} that no entry describes")
    return problems
