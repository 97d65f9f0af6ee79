"""``store.check()``: every invariant the store promises, verified from scratch.

Each check reads the catalog, the files and this process's caches independently of the code
paths that maintain them, and reports a broken invariant as one sentence. Damage to the
catalog (a row that does not decode, a file SQLite cannot read) is reported, never raised.
Read-only; the store passes in the parts it checks.
"""

from __future__ import annotations

from dss.catalog import erasures, holds, namespaces, pages, segments, sessions
from dss.catalog.database import Catalog, catalog_errors
from dss.catalog.sessions import VersionRecord
from dss.core.errors import CatalogCorrupt, CatalogUnavailable, ErasureInProgress
from dss.core.tokens import TOKEN_BYTES
from dss.erasure.documents import Receipt, stored
from dss.sessions.mirror import Mirror
from dss.sessions.state import SessionState
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier


def check(catalog: Catalog, mirror: Mirror, disk: DiskTier, host: HostTier, disk_capacity: int) -> list[str]:
    """Every broken invariant, as a sentence each (``[]`` when the store is sound). Files are
    this node's only (``mirror.node_ref``): other nodes' folders are theirs to check."""
    problems: list[str] = []
    try:
        with catalog_errors(), catalog.read() as conn:
            problems += _layouts(conn)
            problems += _sessions(mirror, conn)
            problems += _pages(conn)
            problems += _segments(disk, disk_capacity, mirror.node_ref, conn)
            problems += _index(mirror, host, conn)
            problems += _audit(conn)
    except (CatalogCorrupt, CatalogUnavailable) as exc:  # the database itself, as its driver says
        problems.append(
            f"the catalog cannot be read: {str(getattr(exc.__cause__, 'orig', None) or exc).splitlines()[0]}"
        )
    problems += host.check()
    return problems


def _layouts(conn: object) -> list[str]:
    problems: list[str] = []
    for ref, spec in namespaces.all_layouts(conn):  # type: ignore[arg-type]
        try:
            namespaces.stored_layout(ref, spec)
        except CatalogCorrupt as exc:
            problems.append(str(exc))
    return problems


def _audit(conn: object) -> list[str]:
    problems: list[str] = []
    for row in erasures.audit_rows(conn):  # type: ignore[arg-type]
        try:
            stored(Receipt, row.receipt)
        except CatalogCorrupt:
            problems.append(f"audit receipt {row.id} does not decode: the row is damaged")
    return problems


def _sessions(mirror: Mirror, conn: object) -> list[str]:
    problems: list[str] = []
    try:
        listed = sessions.list_sessions(conn)  # type: ignore[arg-type]
    except CatalogCorrupt:
        return []  # a layout does not decode (reported by _layouts): no session can be rebuilt
    for record, _ in listed:
        try:
            record = mirror.opened(record, conn)
            name = f"session {record.session_id!r} (tenant {record.tenant_id!r})"
            versions = mirror.unsealed(record, sessions.session_versions(conn, record.ref), conn)  # type: ignore[arg-type]
            key = mirror.keys.of(record.user_ref, conn).hash_key
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
        fresh = SessionState(record, key, mirror.index.namespace(record.user_ref), versions, {})
        contained: set[bytes] = set()
        for version_id in fresh.positions:
            contained.update(fresh.page_ids(version_id))
        stray = holds.committed_pages(conn, record.ref) - contained  # type: ignore[arg-type]
        if stray:
            problems.append(f"{name} references {len(stray)} pages none of its versions contains")
        cached = mirror.sessions.get(record.ref)
        if cached is not None and record.seq == cached.record.seq:
            if cached.head_id != record.head_id or set(cached.versions) != set(by_id):
                problems.append(f"{name}: this process's cached versions or head differ from the catalog")
            for version_id in by_id:
                if version_id in cached.positions and cached.tokens(version_id) != fresh.tokens(version_id):
                    problems.append(f"{name}: cached tokens of version {version_id} differ from the catalog")
    return problems


def _broken_versions(versions: list[VersionRecord], by_id: dict[int, VersionRecord], name: str) -> list[str]:
    """Versions whose stored delta does not rebuild their token history."""
    problems = []
    for v in versions:
        if v.base_id is not None and (v.base_id not in by_id or v.base_id >= v.version_id):
            problems.append(f"version {v.version_id} of {name} builds on version {v.base_id} outside its session")
        elif v.base_id is not None and v.base_len > by_id[v.base_id].num_tokens:
            problems.append(f"version {v.version_id} of {name} takes {v.base_len} tokens of a shorter base")
        if (v.base_len if v.base_id is not None else 0) + len(v.suffix) // TOKEN_BYTES != v.num_tokens:
            problems.append(f"version {v.version_id} of {name} does not hold {v.num_tokens} tokens")
    return problems


def _pages(conn: object) -> list[str]:
    problems: list[str] = []
    unheld = segments.count_unheld_pages(conn)  # type: ignore[arg-type]
    if unheld:
        problems.append(f"{unheld} pages are referenced by no session")
    homeless = segments.count_homeless_pages(conn)  # type: ignore[arg-type]
    if homeless:
        problems.append(f"{homeless} pages have no location on any tier")
    return problems


def _segments(disk: DiskTier, capacity: int, node_ref: int, conn: object) -> list[str]:
    problems: list[str] = []
    rows = segments.all_segments(conn, "disk", node_ref)  # type: ignore[arg-type]
    files = disk.files()
    extents = segments.disk_extents(conn, node_ref)  # type: ignore[arg-type]
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
        if name not in rows and disk.is_orphan(name):
            problems.append(f"page file {name} has no catalog row")
    used = sum(size for _, size in rows.values())
    total = segments.tier_bytes(conn, "disk", node_ref)  # type: ignore[arg-type]
    if total != used:
        problems.append(f"the disk tier's running total says {total} bytes, its segments hold {used}")
    if used > capacity:
        problems.append(f"disk tier holds {used} bytes, over its capacity {capacity}")
    return problems


def _index(mirror: Mirror, host: HostTier, conn: object) -> list[str]:
    """This process's page entries agree with the catalog, and host pages are known."""
    problems: list[str] = []
    entries = mirror.index.entries
    durable = {e.page_id: e for e in entries.values() if e.disk is not None}
    found = {r.page_id: r for r in pages.pages_by_id(conn, list(durable), mirror.node_ref)}  # type: ignore[arg-type]
    for page_id, entry in durable.items():
        row = found.get(page_id)
        if row is None:
            problems.append(f"page {page_id.hex()} is cached as on disk but the catalog lost it")
        elif (row.segment, row.offset, row.length, row.checksum) != (*entry.disk, entry.checksum):  # type: ignore[misc]
            problems.append(f"page {page_id.hex()} is cached with another location or checksum than the catalog's")
    for page_id in host.ids():
        if page_id not in entries:
            problems.append(f"host tier holds page {page_id.hex()} that no entry describes")
    return problems
