"""Forget a user: erase a namespace everywhere, key first, as a recorded, resumable job.

The job moves through these states (:class:`dss.erasure.documents.JobState`), each reached by one
committed step, so a process killed at any instant leaves a state that the next run (or the
next opening of the store) finishes:

``planned``         the job row exists, with the plan (what will go);
``key_destroyed``   the user's wrapped data key is overwritten and deleted: from here on,
                    every copy of their pages and token histories anywhere is unreadable,
                    and their page ids cannot be linked to any tokens;
``catalog_purged``  with a remote tier, every key of the namespace is deleted from it first
                    (the page ids listed from the catalog, deleted in batches, then a scan
                    for the namespace's tag catches keys the catalog forgot); then
                    every row of the namespace is deleted in one transaction (sessions,
                    versions, held pages, pages, locations, segments, quarantine, feed, the
                    user row); the names of the files to delete are recorded with it;
``files_deleted``   those page files are unlinked (and the folder fsynced); the job keeps only
                    the SHA-256 of each name from here on;
``compacted``       the catalog's free space is scrubbed (:meth:`dss.catalog.database.Catalog.compact`);
``done``            verification passed and the receipt is in the ``audit`` table.

The job never keeps a page id: a sample of them is kept as needles (a prefix and a SHA-256
each, see :mod:`dss.core.rawscan`) for verification to look for. Pages of the tenant's
registered shared prefixes belong to the tenant, not to the user, and stay.

**Fence.** From the commit that records the job until the job is final, every write of a
session of the namespace, in any process or node, raises ``ErasureInProgress``: the writer
checks for an open job inside its own write transaction (:func:`dss.catalog.erasures.check_fence`;
the catalog serialises write transactions), and a new session or namespace of that user is
refused by name. Before the remote sweep the namespace is fenced in Redis too
(:meth:`dss.tiers.remote.RemoteTier.fence`): a write-through another node queued before the
fence either landed before it (and is swept) or is dropped.

**Ends.** A job ends ``done`` (verified), ``failed`` (verification still found data after one
more sweep: reported with ``ErasureIncomplete`` and a ``failed`` receipt, never run again), or
``no_such_user``. One that cannot go on now (Redis down) stays open; ``forget_user`` for the
same tenant and user resumes it, as the same job, even once the user's row is gone.

Other nodes of a fleet drop the namespace from their caches when they next catch up (the
key's destruction and the purge are events of the change feed), and delete their own page
files of it then (:meth:`dss.pages.store.PageStore.sweep`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dss.approx.upkeep import Upkeep
from dss.catalog import erasures, feed, namespaces, segments
from dss.catalog.database import Catalog, Tx, now
from dss.catalog.feed import NamespaceForgotten
from dss.core.errors import ErasureIncomplete, ErasureInProgress
from dss.erasure.documents import (
    Check,
    Job,
    JobState,
    Plan,
    Receipt,
    Removed,
    RemovedCounts,
    TierCount,
    Verification,
    failure_of,
    stored,
    with_remote,
)
from dss.erasure.verify import Verifier, file_digest, removed_of
from dss.pages.keys import remote_tag
from dss.pages.store import PageStore
from dss.sessions.mirror import Mirror
from dss.tiers.remote import RemoteUnavailable, key_of, page_id_of

log = logging.getLogger("dss.erasure.job")

Progress = Callable[[str], None]


class Eraser:
    """Runs erasure jobs for a store. Not thread-safe; the store locks."""

    def __init__(self, catalog: Catalog, mirror: Mirror, upkeep: Upkeep, pages: PageStore) -> None:
        self.catalog = catalog
        self.mirror = mirror
        self.upkeep = upkeep
        self.pages = pages
        self.disk = pages.disk
        self.host = pages.host
        self.remote = pages.remote
        self.verifier = Verifier(catalog, self.disk, self.host, self.remote, upkeep, node_ref=pages.node_ref)
        self._host_dropped: dict[int, TierCount] = {}
        self._steps = {
            JobState.PLANNED: self._destroy_key,
            JobState.KEY_DESTROYED: self._purge,
            JobState.CATALOG_PURGED: self._delete_files,
            JobState.FILES_DELETED: self._compact,
            JobState.COMPACTED: self._verify,
        }

    # -- planning --------------------------------------------------------------------------

    def plan(self, tenant_id: str, user_id: str) -> Plan:
        """What forgetting the user would remove, on every tier this process sees (changes nothing)."""
        with self.catalog.read() as conn:
            user_ref = namespaces.find_user(conn, tenant_id, user_id)
            plan = _plan(conn, tenant_id, user_id, user_ref)
        return plan.model_copy(update={"tiers": {**plan.tiers, "host": self._host_usage(user_ref)}})

    # -- running ---------------------------------------------------------------------------

    def forget(self, tenant_id: str, user_id: str, progress: Progress | None = None) -> Receipt:
        """Erase the user (resuming the unfinished job for them, if any); return the receipt.

        A tenant without such a user (and no unfinished job for them) gets a job that is final
        at once, ``no_such_user``, with a receipt (status ``no_such_user``) in the audit table.
        Raises ``ErasureIncomplete`` when the job cannot finish now (it stays open) or its
        verification failed for good (``failed``)."""
        with self.catalog.write() as tx:
            open_job = erasures.open_job_for(tx.conn, tenant_id, user_id)
            if open_job is not None:
                job_id = open_job.id
            else:
                user_ref = namespaces.find_user(tx.conn, tenant_id, user_id)
                job = Job(
                    **_plan(tx.conn, tenant_id, user_id, user_ref).model_dump(),
                    started_at=now().isoformat(),
                    remote_tag=self._tag(user_ref, tx.conn),
                )
                if user_ref is None:
                    return self._no_such_user(tx, job)
                job_id = erasures.insert_job(
                    tx.conn, tenant_id, user_id, user_ref, job.model_dump_json(exclude_none=True)
                )
        self.mirror.wrote(tx.seq)
        return self.run(job_id, progress)

    def _no_such_user(self, tx: Tx, job: Job) -> Receipt:
        """Record, in ``tx``, a job that found no such user, final at once, and its receipt."""
        state = JobState.NO_SUCH_USER
        job_id = erasures.insert_job(
            tx.conn, job.tenant_id, job.user_id, None, job.model_dump_json(exclude_none=True), state, finished=True
        )
        receipt = Receipt(
            erasure_id=job_id,
            tenant_id=job.tenant_id,
            user_id=job.user_id,
            status="no_such_user",
            started_at=job.started_at,
            finished_at=now().isoformat(),
            user_known=False,
            key_destroyed=False,
            removed=RemovedCounts(sessions=0, versions=0, pages=0, tiers={}),
            page_ids_sha256=erasures.digest_of([]),
        )
        erasures.record_plan(
            tx.conn, job_id, state, job.model_copy(update={"receipt": receipt}).model_dump_json(exclude_none=True)
        )
        erasures.insert_audit(
            tx.conn, "forget-user", job.tenant_id, job.user_id, receipt.model_dump_json(exclude_none=True)
        )
        log.info("erasure %d found no such user; its receipt is in the audit table", job_id)
        return receipt

    def resume_all(self, progress: Progress | None = None) -> list[Receipt]:
        """Finish every erasure a crash left open; return their receipts."""
        with self.catalog.read() as conn:
            jobs = erasures.open_jobs(conn)
        return [self.run(job.id, progress) for job in jobs]

    def run(self, job_id: int, progress: Progress | None = None) -> Receipt:
        """Advance job ``job_id`` from wherever it stands to a final state; return its receipt.
        Raises ``ErasureIncomplete`` for a job that ended ``failed``."""
        while True:
            with self.catalog.read() as conn:
                row = erasures.job(conn, job_id)
            state, job = JobState(row.state), stored(Job, row.plan)
            if state.is_final:
                assert job.receipt is not None
                if state is JobState.FAILED:
                    raise ErasureIncomplete(failure_of(job.receipt))
                return job.receipt
            if progress is not None:
                progress(f"{state} -> {state.next}")
            self._steps[state](row, job)

    def _advance(self, row: erasures.JobRecord, job: Job, tx: Tx, **update: object) -> bool:
        """Move the job one state on in ``tx`` (recording ``update`` in its document) unless
        another process already did; say whether it moved."""
        state = JobState(row.state)
        document = job.model_copy(update=update).model_dump_json(exclude_none=True)
        return erasures.advance_job(tx.conn, row.id, state, state.next, document, finished=state.next is JobState.DONE)

    # -- the steps -------------------------------------------------------------------------

    def _destroy_key(self, row: erasures.JobRecord, job: Job) -> None:
        user_ref = row.user_ref
        self._host_dropped[row.id] = self._host_usage(user_ref)
        with self.catalog.write() as tx:
            destroyed = user_ref is not None and namespaces.destroy_key(tx.conn, user_ref)
            events = [NamespaceForgotten(user_ref)] if user_ref is not None else []
            feed.record(tx.conn, tx.seq, events)
            self._advance(row, job, tx, key_destroyed=destroyed or job.key_destroyed)
        self._forgotten(tx.seq, events)

    def _tag(self, user_ref: int | None, conn: object) -> str | None:
        """The namespace's remote-tier tag (hex), while its key still exists."""
        if user_ref is None:
            return None
        try:
            return remote_tag(self.mirror.keys.of(user_ref, conn).hash_key).hex()
        except ErasureInProgress:
            return None

    def _purge(self, row: erasures.JobRecord, job: Job) -> None:
        user_ref = row.user_ref
        if self.remote is not None and user_ref is not None:
            job = job.model_copy(update={"remote_removed": self._delete_remote(user_ref, job.remote_tag)})
        host = self._host_dropped.pop(row.id, TierCount())
        with self.catalog.write() as tx:
            removed = removed_of(erasures.purge(tx.conn, user_ref) if user_ref is not None else None, host)
            events = [NamespaceForgotten(user_ref)] if user_ref is not None else []
            feed.record(tx.conn, tx.seq, events)
            self._advance(row, job, tx, removed=removed)
        self._forgotten(tx.seq, events)

    def _delete_remote(self, user_ref: int, tag: str | None) -> int:
        """Delete every key of the namespace from the remote tier; return how many existed.

        The keys of the pages the catalog lists go in batches; then a scan for the namespace's
        tag finds keys of pages the catalog dropped meanwhile (evicted, or a write-through
        that was queued when the page went). Raises ``ErasureIncomplete`` when the remote
        tier cannot be reached (the job stays open; the key is destroyed already, so what it
        holds is unreadable).
        """
        assert self.remote is not None
        with self.catalog.read() as conn:
            page_ids = segments.user_page_ids(conn, user_ref)
        try:
            if tag is not None:
                tag_bytes = bytes.fromhex(tag)
                self.remote.fence(tag_bytes)  # first: no write-through of the namespace lands after the sweep
                deleted = self.remote.delete([key_of(self.remote.prefix, tag_bytes, p) for p in page_ids])
                stragglers = [
                    k.decode()
                    for k in self.remote.scan(self.remote.namespace_pattern(tag_bytes))
                    if page_id_of(k) is not None
                ]  # the fence stays
                deleted += self.remote.delete(stragglers)
            else:  # no tag was taken (the key was gone when the job began): find the keys by page id
                wanted = set(page_ids)
                deleted = self.remote.delete(
                    [k.decode() for k in self.remote.scan(f"{self.remote.prefix}*") if page_id_of(k) in wanted]
                )
        except RemoteUnavailable as exc:
            raise ErasureIncomplete(
                f"{exc}; the user's key is destroyed, so what the remote tier holds of them is "
                "unreadable, but its keys must go too: run the erasure again"
            ) from None
        return deleted

    def _delete_files(self, row: erasures.JobRecord, job: Job) -> None:
        assert job.removed is not None
        files = job.removed.files or []
        self.disk.remove(files)
        digests = sorted(file_digest(name) for name in files)
        with self.catalog.write() as tx:
            self._advance(row, job, tx, removed=job.removed.model_copy(update={"files": None, "file_digests": digests}))
        self.mirror.wrote(tx.seq)

    def _compact(self, row: erasures.JobRecord, job: Job) -> None:
        problem = self.catalog.compact(erasures.VACUUMED)
        if problem is not None:
            raise ErasureIncomplete(f"{problem}; run the erasure again")
        with self.catalog.write() as tx:
            self._advance(row, job, tx)
        self.mirror.wrote(tx.seq)

    def _verify(self, row: erasures.JobRecord, job: Job) -> None:
        """Verify; on a first failure sweep the namespace again (what landed after the purge:
        a write another node had begun) and verify again; a second failure is final (``failed``)."""
        assert job.removed is not None
        checks = self.verify(row.user_ref, job.removed, job.remote_tag)
        is_ok = all(c.ok for c in checks)
        if not is_ok and not job.swept_again:
            self._sweep_again(row, job)
            return
        removed = job.removed
        receipt = Receipt(
            erasure_id=row.id,
            tenant_id=row.tenant_id,
            user_id=row.user_id,
            status="verified" if is_ok else "failed",
            started_at=job.started_at,
            finished_at=now().isoformat(),
            user_known=job.user_known,
            key_destroyed=job.key_destroyed,
            removed=RemovedCounts(
                sessions=removed.sessions,
                versions=removed.versions,
                pages=removed.pages,
                tiers=with_remote(removed.tiers, job),
            ),
            page_ids_sha256=removed.page_ids_sha256,
            verification=Verification(ok=is_ok, checks=checks),
        )
        to = JobState.DONE if is_ok else JobState.FAILED
        with self.catalog.write() as tx:
            document = job.model_copy(update={"receipt": receipt}).model_dump_json(exclude_none=True)
            if erasures.advance_job(tx.conn, row.id, row.state, to, document, finished=True):
                erasures.insert_audit(
                    tx.conn, "forget-user", row.tenant_id, row.user_id, receipt.model_dump_json(exclude_none=True)
                )
        self.mirror.wrote(tx.seq)
        log.info(
            "erasure %d %s; its receipt is in the audit table",
            row.id,  # logs name no user
            "finished" if is_ok else "failed verification",
        )

    def _sweep_again(self, row: erasures.JobRecord, job: Job) -> None:
        """Delete what verification found once more: the namespace's remote keys, any catalog
        rows of it, its page files; scrub the catalog again; note it in the job's document."""
        assert job.removed is not None
        user_ref = row.user_ref
        if self.remote is not None and user_ref is not None:
            self._delete_remote(user_ref, job.remote_tag)
        with self.catalog.write() as tx:
            purged = erasures.purge(tx.conn, user_ref) if user_ref is not None else None
            erasures.record_plan(
                tx.conn,
                row.id,
                row.state,
                job.model_copy(update={"swept_again": True}).model_dump_json(exclude_none=True),
            )
        self.mirror.wrote(tx.seq)
        digests = set(job.removed.file_digests)
        self.disk.remove(
            [
                *(purged.files if purged is not None else []),
                *(name for name in self.disk.files() if file_digest(name) in digests),
            ]
        )
        problem = self.catalog.compact(erasures.VACUUMED)
        if problem is not None:
            raise ErasureIncomplete(f"{problem}; run the erasure again")
        log.warning("erasure %d: verification found data left; swept the namespace again", row.id)

    def _forgotten(self, seq: int, events: list[NamespaceForgotten]) -> None:
        self.mirror.wrote(seq)
        self.mirror.apply(events)
        self.upkeep.apply(events)

    def verify(self, user_ref: int | None, removed: Removed, tag: str | None = None) -> list[Check]:
        """Look for anything of the user in every place dss keeps data (:mod:`dss.erasure.verify`)."""
        return self.verifier.checks(user_ref, removed, tag)

    def _host_usage(self, user_ref: int | None) -> TierCount:
        """Pages and bytes of a namespace in this process's host tier."""
        if user_ref is None:
            return TierCount()
        index = self.mirror.index
        held = [
            e.page_id for e in index.entries.values() if e.namespace.user_ref == user_ref and e.page_id in self.host
        ]
        return TierCount(pages=len(held), bytes=sum(len(p) for p in self.host.get_many(held) if p is not None))


def _plan(conn: object, tenant_id: str, user_id: str, user_ref: int | None) -> Plan:
    counts = erasures.counts(conn, user_ref)  # type: ignore[arg-type]
    key = user_ref is not None and namespaces.wrapped_key(conn, user_ref) is not None  # type: ignore[arg-type]
    return Plan(
        tenant_id=tenant_id,
        user_id=user_id,
        user_known=user_ref is not None,
        key_present=key,
        sessions=counts.sessions,
        versions=counts.versions,
        pages=counts.pages,
        tiers={"disk": TierCount(pages=counts.pages, bytes=counts.disk_bytes, files=counts.disk_files)},
    )
