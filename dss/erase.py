"""Forget a user: erase a namespace everywhere, key first, as a recorded, resumable job.

The job moves through these states, each reached by one committed step, so a process killed
at any instant leaves a state that the next run (or the next opening of the store) finishes:

``planned``         the job row exists, with the plan (what will go);
``key_destroyed``   the user's wrapped data key is overwritten and deleted: from here on,
                    every copy of their pages and token histories anywhere is unreadable,
                    and their page ids cannot be linked to any tokens;
``catalog_purged``  every row of the namespace is deleted in one transaction (sessions,
                    versions, page references, pages, locations, segments, quarantine, change
                    feed, the user row); the names of the files to delete are recorded with it;
``files_deleted``   those page files are unlinked (and the folder fsynced); the job keeps only
                    the SHA-256 of each name from here on;
``compacted``       the catalog's free space is scrubbed (SQLite: ``secure_delete``, then the
                    database rebuilt and the WAL truncated; PostgreSQL: ``VACUUM``);
``done``            verification passed and the receipt is in the ``audit`` table.

The job never keeps a page id: a sample of them is kept as needles (a prefix and a SHA-256
each, see :mod:`dss.rawscan`) for verification to look for. Verification fails loudly
(:class:`dss.errors.ErasureIncomplete`) and leaves the job open.
Pages of the tenant's registered shared prefixes belong to the tenant, not to the user, and
stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import delete, func, select

from dss import rawscan, records
from dss.catalog import Catalog, Tx, now
from dss.errors import ErasureIncomplete
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier

log = logging.getLogger("dss.erase")

STATES = ("planned", "key_destroyed", "catalog_purged", "files_deleted", "compacted", "done")
SAMPLE_IDS = 64
"""How many of the user's page ids verification looks for (kept as needles, never as ids)."""

Progress = Callable[[str], None]


class Eraser:
    """Runs erasure jobs for a store; the store passes its collaborators in."""

    def __init__(self, catalog: Catalog, disk: DiskTier, host: HostTier, *,
                 write: Callable[[], AbstractContextManager[Tx]],
                 forget_cached: Callable[[int], tuple[int, int]]) -> None:
        self.catalog = catalog
        self.disk = disk
        self.host = host
        self._write = write
        self._forget_cached = forget_cached
        self._host_dropped: dict[int, dict[str, int]] = {}

    # -- planning --------------------------------------------------------------------------

    def plan(self, tenant_id: str, user_id: str) -> dict[str, Any]:
        """What forgetting the user would remove (changes nothing)."""
        with self.catalog.read() as conn:
            user_ref = records.find_user(conn, tenant_id, user_id)
            counts = _counts(conn, user_ref) if user_ref is not None else _counts(conn, None)
            key = user_ref is not None and records.wrapped_key(conn, user_ref) is not None
        return {"tenant_id": tenant_id, "user_id": user_id, "user_known": user_ref is not None,
                "key_present": key, **counts}

    # -- running ---------------------------------------------------------------------------

    def forget(self, tenant_id: str, user_id: str, progress: Progress | None = None) -> dict[str, Any]:
        """Erase the user (resuming an unfinished job for them, if any); return the receipt."""
        with self._write() as tx:
            user_ref = records.find_user(tx.conn, tenant_id, user_id)
            job = records.erasure_of(tx.conn, user_ref) if user_ref is not None else None
            if job is None:
                plan = self.plan_in(tx, tenant_id, user_id, user_ref)
                job_id = records.insert_erasure(tx.conn, tenant_id, user_id, user_ref, json.dumps(plan))
            else:
                job_id = job.id
        return self.run(job_id, progress)

    def plan_in(self, tx: Tx, tenant_id: str, user_id: str, user_ref: int | None) -> dict[str, Any]:
        counts = _counts(tx.conn, user_ref)
        key = user_ref is not None and records.wrapped_key(tx.conn, user_ref) is not None
        return {"tenant_id": tenant_id, "user_id": user_id, "user_known": user_ref is not None,
                "key_present": key, "started_at": now().isoformat(), **counts}

    def resume_all(self, progress: Progress | None = None) -> list[dict[str, Any]]:
        """Finish every erasure a crash left open; return their receipts."""
        with self.catalog.read() as conn:
            jobs = records.open_erasures(conn)
        return [self.run(job.id, progress) for job in jobs]

    def run(self, job_id: int, progress: Progress | None = None) -> dict[str, Any]:
        """Advance job ``job_id`` from wherever it stands to ``done``; return its receipt."""
        say = progress or (lambda message: None)
        while True:
            job = self._job(job_id)
            if job["state"] == "done":
                return job["plan"]["receipt"]
            step = getattr(self, f"_after_{job['state']}")
            say(f"{job['state']} -> {STATES[STATES.index(job['state']) + 1]}")
            step(job)

    def _job(self, job_id: int) -> dict[str, Any]:
        e = records.erasures
        with self.catalog.read() as conn:
            row = conn.execute(select(e.c.state, e.c.plan, e.c.user_ref, e.c.tenant_id, e.c.user_id)
                               .where(e.c.id == job_id)).one()
        return {"id": job_id, "state": row[0], "plan": json.loads(row[1]), "user_ref": row[2],
                "tenant_id": row[3], "user_id": row[4]}

    def _advance(self, job: dict[str, Any], state: str, tx: Tx, plan: dict[str, Any] | None = None) -> bool:
        """Move the job to ``state`` in ``tx`` unless another process already did; say whether it moved."""
        current = tx.conn.execute(select(records.erasures.c.state).where(records.erasures.c.id == job["id"])).scalar()
        if current != job["state"]:
            return False
        records.set_erasure(tx.conn, job["id"], state, json.dumps(plan) if plan is not None else None,
                            finished=state == "done")
        return True

    # -- the steps -------------------------------------------------------------------------

    def _after_planned(self, job: dict[str, Any]) -> None:
        user_ref = job["user_ref"]
        with self._write() as tx:
            destroyed = user_ref is not None and records.destroy_key(tx.conn, user_ref)
            plan = {**job["plan"], "key_destroyed": bool(destroyed) or job["plan"].get("key_destroyed", False)}
            if user_ref is not None:
                self.catalog.note(tx, "forget", user_ref=user_ref)
            self._advance(job, "key_destroyed", tx, plan)
        if user_ref is not None:
            pages, size = self._forget_cached(user_ref)
            self._host_dropped[job["id"]] = {"pages": pages, "bytes": size}

    def _after_key_destroyed(self, job: dict[str, Any]) -> None:
        user_ref = job["user_ref"]
        host = self._host_dropped.pop(job["id"], {"pages": 0, "bytes": 0})
        with self._write() as tx:
            removed = _purge(tx, user_ref, host) if user_ref is not None else _nothing()
            if user_ref is not None:
                self.catalog.note(tx, "forget", user_ref=user_ref)
            self._advance(job, "catalog_purged", tx, {**job["plan"], "removed": removed})
        if user_ref is not None:
            self._forget_cached(user_ref)

    def _after_catalog_purged(self, job: dict[str, Any]) -> None:
        removed = job["plan"]["removed"]
        self.disk.remove(removed["files"])
        kept = {k: v for k, v in removed.items() if k != "files"}
        kept["file_digests"] = sorted(_digest(name) for name in removed["files"])
        with self._write() as tx:
            self._advance(job, "files_deleted", tx, {**job["plan"], "removed": kept})

    def _after_files_deleted(self, job: dict[str, Any]) -> None:
        self._compact()
        with self._write() as tx:
            self._advance(job, "compacted", tx)

    def _after_compacted(self, job: dict[str, Any]) -> None:
        checks = self.verify(job)
        plan = job["plan"]
        removed = plan["removed"]
        receipt = {
            "kind": "forget-user", "erasure_id": job["id"], "tenant_id": job["tenant_id"], "user_id": job["user_id"],
            "started_at": plan["started_at"], "finished_at": now().isoformat(), "user_known": plan["user_known"],
            "key_destroyed": plan.get("key_destroyed", False),
            "removed": {k: removed[k] for k in ("sessions", "versions", "pages", "tiers")},
            "page_ids_sha256": removed["page_ids_sha256"],
            "verification": {"ok": all(c["ok"] for c in checks), "checks": checks},
        }
        if not receipt["verification"]["ok"]:
            failed = "; ".join(f"{c['name']}: {c['detail']}" for c in checks if not c["ok"])
            raise ErasureIncomplete(f"erasure {job['id']} of user {job['user_id']!r} failed verification: {failed}")
        with self._write() as tx:
            if self._advance(job, "done", tx, {**plan, "receipt": receipt}):
                records.insert_audit(tx.conn, "forget-user", job["tenant_id"], job["user_id"], json.dumps(receipt))
        log.info("erasure %d finished; its receipt is in the audit table", job["id"])  # logs name no user

    # -- compaction and verification -------------------------------------------------------

    def _compact(self) -> None:
        """Scrub the catalog's free space so deleted rows leave no bytes behind.

        SQLite: ``secure_delete`` zeroes a deleted row where it lies, but not the stale copies
        that earlier page splits and merges left in a page's unused space, so the whole
        database is rebuilt (``VACUUM``, outside any transaction) and the WAL checkpointed and
        truncated; a checkpoint that other processes keep busy raises ``ErasureIncomplete``.
        """
        if self.catalog.is_sqlite:
            with self.catalog.engine.connect() as conn:
                raw = conn.connection.driver_connection  # VACUUM cannot run in the transaction SQLAlchemy opens
                assert raw is not None
                try:
                    raw.execute("VACUUM")
                    busy = raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                except sqlite3.OperationalError as exc:
                    raise ErasureIncomplete(f"the catalog could not be rebuilt ({exc}); run the erasure again") from None
            if busy:
                raise ErasureIncomplete("the catalog's WAL could not be truncated: other processes kept it "
                                        "busy; run the erasure again")
        else:
            with self.catalog.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                for table in ("user_keys", "versions", "sessions", "pages", "page_refs", "page_locations", "segments",
                              "users", "changes", "quarantine"):
                    conn.exec_driver_sql(f"VACUUM {table}")

    def verify(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """Look for anything of the user in every place dss keeps data; one check each."""
        user_ref = job["user_ref"] if job["user_ref"] is not None else job["plan"].get("user_ref")
        removed = job["plan"]["removed"]
        checks = [_check("catalog rows", *self._catalog_rows(user_ref))]
        on_disk = {_digest(name) for name in self.disk.files()}
        files = removed["file_digests"]
        present = [digest for digest in files if digest in on_disk]
        checks.append(_check("page files", not present, f"{len(present)} of {len(files)} files remain"))
        self.disk.recover(self._recorded())
        sampled = {n["sha256"] for n in removed["sample"]}
        cached = sum(hashlib.sha256(page_id).hexdigest() in sampled for page_id in self.host.ids())
        checks.append(_check("host tier", not cached, f"{cached} sampled pages in this process's host tier"))
        checks.append(_check("catalog files", *self._raw_scan(removed["sample"])))
        return checks

    def _catalog_rows(self, user_ref: int | None) -> tuple[bool, str]:
        if user_ref is None:
            return True, "the user had no rows"
        with self.catalog.read() as conn:
            left = {name: n for name, n in _rows_of(conn, user_ref).items() if n}
        return not left, ", ".join(f"{n} in {name}" for name, n in left.items()) or "none left"

    def _recorded(self) -> set[str]:
        with self.catalog.read() as conn:
            return set(records.all_segments(conn, "disk"))

    def _raw_scan(self, sample: list[rawscan.Needle]) -> tuple[bool, str]:
        """Scan the SQLite catalog's files (database, WAL) byte by byte for sampled page ids,
        binary or hex, in a child process (this one must never open them: see :mod:`dss.rawscan`)."""
        if not self.catalog.is_sqlite:
            return True, ("PostgreSQL: rows checked by SQL; dead row versions left in its files hold only data sealed "
                          "or page ids keyed under the destroyed key, session keys (keyed hashes of session ids), "
                          "and the tenant and user ids this receipt names")
        path = str(self.catalog.engine.url.database)
        try:
            found = {file: n for file, n in rawscan.scan([path, f"{path}-wal"], sample).items() if n}
        except rawscan.ScanFailed as exc:
            return False, str(exc)
        return not found, f"sampled page ids found in {sorted(found)}" if found else "no sampled page id found"


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _counts(conn: Any, user_ref: int | None) -> dict[str, Any]:
    """Sessions, versions, pages and bytes per tier of a namespace."""
    if user_ref is None:
        return {"sessions": 0, "versions": 0, "pages": 0, "tiers": {"disk": {"pages": 0, "bytes": 0, "files": 0}}}
    s, v, p, seg = records.sessions, records.versions, records.pages, records.segments
    sessions = conn.execute(select(func.count()).select_from(s).where(s.c.user_ref == user_ref)).scalar_one()
    versions = conn.execute(select(func.count()).select_from(v).join(s, s.c.id == v.c.session_ref)
                            .where(s.c.user_ref == user_ref)).scalar_one()
    pages = conn.execute(select(func.count()).select_from(p).where(p.c.user_ref == user_ref)).scalar_one()
    files, size = conn.execute(select(func.count(), func.coalesce(func.sum(seg.c.size), 0))
                               .where(seg.c.user_ref == user_ref, seg.c.tier == "disk")).one()
    return {"sessions": sessions, "versions": versions, "pages": pages,
            "tiers": {"disk": {"pages": pages, "bytes": int(size), "files": files}}}


def _rows_of(conn: Any, user_ref: int) -> dict[str, int]:
    s, v, p = records.sessions, records.versions, records.pages
    counts = {
        "users": conn.execute(select(func.count()).select_from(records.users)
                              .where(records.users.c.id == user_ref)).scalar_one(),
        "user_keys": conn.execute(select(func.count()).select_from(records.user_keys)
                                  .where(records.user_keys.c.user_ref == user_ref)).scalar_one(),
        "sessions": conn.execute(select(func.count()).select_from(s).where(s.c.user_ref == user_ref)).scalar_one(),
        "versions": conn.execute(select(func.count()).select_from(v).join(s, s.c.id == v.c.session_ref)
                                 .where(s.c.user_ref == user_ref)).scalar_one(),
        "pages": conn.execute(select(func.count()).select_from(p).where(p.c.user_ref == user_ref)).scalar_one(),
    }
    for table in (records.segments, records.quarantine):
        counts[table.name] = conn.execute(select(func.count()).select_from(table)
                                          .where(table.c.user_ref == user_ref)).scalar_one()
    ch = records.changes  # the erasure's own "forget" notes carry only the number of a deleted row
    counts["changes"] = conn.execute(select(func.count()).select_from(ch).where(
        ch.c.user_ref == user_ref, ch.c.kind != "forget")).scalar_one()
    return counts


def _nothing() -> dict[str, Any]:
    return {"sessions": 0, "versions": 0, "pages": 0, "files": [], "sample": [],
            "page_ids_sha256": hashlib.sha256().hexdigest(),
            "tiers": {"disk": {"pages": 0, "bytes": 0, "files": 0}, "host": {"pages": 0, "bytes": 0}}}


def _purge(tx: Tx, user_ref: int, host: dict[str, int]) -> dict[str, Any]:
    """Delete every catalog row of a namespace; return what went (for the receipt)."""
    conn = tx.conn
    s, v, p, seg = records.sessions, records.versions, records.pages, records.segments
    counts = _counts(conn, user_ref)
    session_refs = [r[0] for r in conn.execute(select(s.c.id).where(s.c.user_ref == user_ref))]
    digest = hashlib.sha256()
    page_ids = sorted(bytes(r[0]) for r in conn.execute(select(p.c.page_id).where(p.c.user_ref == user_ref)))
    for page_id in page_ids:
        digest.update(page_id)
    files = [r[0] for r in conn.execute(select(seg.c.name).where(seg.c.user_ref == user_ref))]
    for part in records.chunks(session_refs):
        conn.execute(delete(records.refs).where(records.refs.c.session_ref.in_(part)))
        conn.execute(delete(v).where(v.c.session_ref.in_(part)))
    for part in records.chunks(page_ids):
        conn.execute(delete(records.refs).where(records.refs.c.page_id.in_(part)))
        conn.execute(delete(records.locations).where(records.locations.c.page_id.in_(part)))
    conn.execute(delete(p).where(p.c.user_ref == user_ref))
    records.delete_segments(conn, seg.c.user_ref == user_ref)
    conn.execute(delete(s).where(s.c.user_ref == user_ref))
    for table in (records.quarantine, records.changes):
        conn.execute(delete(table).where(table.c.user_ref == user_ref))
    records.destroy_key(conn, user_ref)
    conn.execute(delete(records.users).where(records.users.c.id == user_ref))
    return {"sessions": counts["sessions"], "versions": counts["versions"], "pages": len(page_ids), "files": files,
            "sample": [rawscan.needle(pid) for pid in page_ids[:SAMPLE_IDS]], "page_ids_sha256": digest.hexdigest(),
            "tiers": {**counts["tiers"], "host": host}}

