"""Verifying an erasure: a look for anything of the user in every place dss keeps data.

One :class:`~dss.erasure.documents.Check` per place: the catalog's rows, the page files, this
process's host tier, the SQLite catalog's own files byte by byte (in a child process, see
:mod:`dss.core.rawscan`), the MinHash-LSH index, and the remote tier. Page ids are looked for
as sampled needles (their SHA-256), never kept as ids.
"""

from __future__ import annotations

import hashlib
from typing import TypedDict

from dss.approx.upkeep import Upkeep
from dss.catalog import erasures, segments
from dss.catalog.database import Catalog
from dss.core import rawscan
from dss.erasure.documents import Check, Needle, Removed, TierCount
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.remote import RemoteTier, RemoteUnavailable, page_id_of

SAMPLE_IDS = 64
"""How many of the user's page ids verification looks for (kept as needles, never as ids)."""


class Finding(TypedDict):
    """What one look found: the fields of a :class:`Check` but its name."""

    ok: bool
    detail: str


class Verifier:
    """Looks for an erased user's data in one store. Not thread-safe; the store locks."""

    def __init__(
        self,
        catalog: Catalog,
        disk: DiskTier,
        host: HostTier,
        remote: RemoteTier | None,
        upkeep: Upkeep,
        *,
        node_ref: int,
    ) -> None:
        self.catalog = catalog
        self.disk = disk
        self.host = host
        self.remote = remote
        self.upkeep = upkeep
        self.node_ref = node_ref

    def checks(self, user_ref: int | None, removed: Removed, tag: str | None = None) -> list[Check]:
        """Look for anything of the user in every place dss keeps data; one check each."""
        checks = [Check(name="catalog rows", **self._catalog_rows(user_ref))]
        on_disk = {file_digest(name) for name in self.disk.files()}
        present = [digest for digest in removed.file_digests if digest in on_disk]
        checks.append(
            Check(
                name="page files", ok=not present, detail=f"{len(present)} of {len(removed.file_digests)} files remain"
            )
        )
        with self.catalog.read() as conn:
            self.disk.recover(set(segments.all_segments(conn, "disk", self.node_ref)))
        sampled = {n.sha256 for n in removed.sample}
        cached = sum(hashlib.sha256(page_id).hexdigest() in sampled for page_id in self.host.ids())
        checks.append(
            Check(name="host tier", ok=not cached, detail=f"{cached} sampled pages in this process's host tier")
        )
        checks.append(Check(name="catalog files", **self._raw_scan(removed.sample)))
        checks.append(Check(name="lsh index", **self._lsh_index(user_ref)))
        if self.remote is not None:
            checks.append(Check(name="remote tier", **self._remote_scan(removed.sample, tag)))
        return checks

    def _lsh_index(self, user_ref: int | None) -> Finding:
        """Look in the MinHash-LSH index itself (this process's memory, and Redis when shared)."""
        lsh = self.upkeep.lsh
        if lsh is None:
            return {"ok": True, "detail": "no LSH index in this process"}
        if user_ref is None:
            return {"ok": True, "detail": "the user had no entries"}
        local, remote = lsh.count(user_ref)
        where = "in memory and in Redis" if lsh.is_shared else "in memory"
        return {
            "ok": not local and not remote,
            "detail": f"{local} entries in memory, {remote} keys in Redis"
            if local or remote
            else f"no entry of the user {where}",
        }

    def _remote_scan(self, sample: list[Needle], tag: str | None) -> Finding:
        """Scan the remote tier's keys for the sampled page ids and the namespace's tag."""
        assert self.remote is not None
        sampled = {n.sha256 for n in sample}
        found = tagged = 0
        try:
            for key in self.remote.scan(f"{self.remote.prefix}*"):
                page_id = page_id_of(key)
                found += page_id is not None and hashlib.sha256(page_id).hexdigest() in sampled
                tagged += page_id is not None and tag is not None and f"{{{tag}}}" in key.decode()
        except RemoteUnavailable as exc:
            return {"ok": False, "detail": str(exc)}
        return {
            "ok": not found and not tagged,
            "detail": f"{found} of {len(sample)} sampled page ids and {tagged} keys of the user's namespace in "
            "Redis; copies in Redis replicas and in AOF/RDB files hold only pages sealed under the "
            "destroyed key (crypto-shredding): they are unreadable",
        }

    def _catalog_rows(self, user_ref: int | None) -> Finding:
        if user_ref is None:
            return {"ok": True, "detail": "the user had no rows"}
        with self.catalog.read() as conn:
            left = {name: n for name, n in erasures.rows_left(conn, user_ref).items() if n}
        return {"ok": not left, "detail": ", ".join(f"{n} in {name}" for name, n in left.items()) or "none left"}

    def _raw_scan(self, sample: list[Needle]) -> Finding:
        """Scan the SQLite catalog's files (database, WAL) byte by byte for sampled page ids,
        binary or hex, in a child process (this one must never open them: see :mod:`dss.core.rawscan`)."""
        if not self.catalog.is_sqlite:
            return {
                "ok": True,
                "detail": "PostgreSQL: rows checked by SQL; dead row versions left in its files hold "
                "only data sealed or page ids keyed under the destroyed key, session keys "
                "(keyed hashes of session ids), and the tenant and user ids this receipt "
                "names",
            }
        path = str(self.catalog.engine.url.database)
        try:
            found = {
                file: n
                for file, n in rawscan.scan([path, f"{path}-wal"], [n.model_dump() for n in sample]).items()
                if n
            }
        except rawscan.ScanFailed as exc:
            return {"ok": False, "detail": str(exc)}
        return {
            "ok": not found,
            "detail": f"sampled page ids found in {sorted(found)}" if found else "no sampled page id found",
        }


def file_digest(name: str) -> str:
    """How a page file is named in a receipt (its name's SHA-256)."""
    return hashlib.sha256(name.encode()).hexdigest()


def removed_of(purged: erasures.Purged | None, host: TierCount) -> Removed:
    """What a purge removed (``None``: nothing), with the sample of page ids verification looks for."""
    if purged is None:
        return Removed(
            sessions=0,
            versions=0,
            pages=0,
            page_ids_sha256=erasures.digest_of([]),
            sample=[],
            tiers={"disk": TierCount(files=0), "host": host},
        )
    counts = purged.counts
    return Removed(
        sessions=counts.sessions,
        versions=counts.versions,
        pages=len(purged.page_ids),
        tiers={"disk": TierCount(pages=counts.pages, bytes=counts.disk_bytes, files=counts.disk_files), "host": host},
        page_ids_sha256=erasures.digest_of(purged.page_ids),
        files=purged.files,
        sample=[Needle(**rawscan.needle(p)) for p in purged.page_ids[:SAMPLE_IDS]],
    )
