"""What operators do with the store: erase a user and read the audit, follow engines' device
tiers, compact, inspect with SQL, check, read the statistics, run the mover."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from dss.catalog import erasures, segments
from dss.catalog.database import now
from dss.core.errors import InternalError
from dss.core.types import PageId, PageRef, SqlResult
from dss.core.validate import check_callback, check_flag, check_name, check_page_ids
from dss.erasure.documents import AuditEntry, Plan, Receipt, stored
from dss.placement import fill
from dss.placement.stats import COUNTERS, TIERS
from dss.store import integrity
from dss.store.base import Base
from dss.writes.compaction import Compaction


class Operations(Base):
    """Erasure, engines, compaction and inspection (see :class:`dss.store.Store`)."""

    # -- erasure ---------------------------------------------------------------------------

    @overload
    def forget_user(
        self,
        user_id: str,
        *,
        tenant_id: str,
        dry_run: Literal[False] = False,
        progress: Callable[[str], None] | None = None,
    ) -> Receipt: ...

    @overload
    def forget_user(
        self, user_id: str, *, tenant_id: str, dry_run: Literal[True], progress: Callable[[str], None] | None = None
    ) -> Plan: ...

    def forget_user(
        self, user_id: str, *, tenant_id: str, dry_run: bool = False, progress: Callable[[str], None] | None = None
    ) -> Receipt | Plan:
        """Erase everything of one user (GDPR Art. 17) of tenant ``tenant_id`` (always named:
        there is no default tenant for an erasure) and return the receipt.

        Destroys the user's data key first (crypto-shredding), then deletes every session,
        version, token history and page of theirs on every tier, scrubs the catalog's free
        space, verifies that nothing is left and records the receipt in the audit table
        (``status="verified"``). From the moment the erasure begins, every write for the user,
        from any process or node, raises ``ErasureInProgress`` until it is finished. Resumes
        the unfinished erasure of the user (a crash's, or one that raised), as the same job.
        A tenant without such a user gets a receipt with ``status="no_such_user"`` (recorded
        too; nothing is erased). ``dry_run=True`` returns the plan (counts and bytes per tier;
        ``user_known=False`` for no such user) and changes nothing. Pages of the tenant's
        shared prefixes stay. Raises ``ErasureIncomplete`` when the erasure cannot finish now
        (it stays open: call again) or verification still found data after a second sweep
        (the job ends ``failed``, its receipt says which checks failed).
        """
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_flag("dry_run", dry_run)
        check_callback("progress", progress)
        with self._reading():
            if dry_run:
                return self.eraser.plan(tenant_id, user_id)
            return self.eraser.forget(tenant_id, user_id, progress)

    def audit(self, *, tenant_id: str | None = None) -> list[AuditEntry]:
        """Receipts of erasures (and other audited operations), oldest first."""
        check_name("tenant_id", tenant_id, optional=True)
        with self._reading(), self.catalog.read() as conn:
            rows = erasures.audit_rows(conn, tenant_id)
        return [
            AuditEntry(
                audit_id=r.id,
                kind=r.kind,
                tenant_id=r.tenant_id,
                user_id=r.user_id,
                created_at=r.created_at.isoformat(),
                receipt=stored(Receipt, r.receipt),
            )
            for r in rows
        ]

    # -- engines: the device tier -----------------------------------------------------------

    def mark_resident(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """Engine instance ``engine_id`` holds these pages in its own KV memory (the ``device``
        tier): ``resume`` reports them there (those host or disk holds too), and
        :meth:`residency` counts them for it. Kept in this process's memory, shared by the
        stores of this process on the same catalog; each call renews the engine's lease
        (``residency_ttl_s``; an empty list only renews it)."""
        check_name("engine_id", engine_id)
        ids = check_page_ids(page_ids)
        self._check_open()
        self.device.mark(engine_id, ids)

    def evicted(self, engine_id: str, page_ids: Sequence[PageRef | bytes]) -> None:
        """Engine instance ``engine_id`` no longer holds these pages (it reused their memory)."""
        check_name("engine_id", engine_id)
        ids = check_page_ids(page_ids)
        self._check_open()
        self.device.evict(engine_id, ids)

    def forget_engine(self, engine_id: str) -> int:
        """Engine instance ``engine_id`` went away: forget the pages it held; returns how many."""
        check_name("engine_id", engine_id)
        self._check_open()
        return self.device.forget(engine_id)

    def residency(self, session_id: str, *, tenant_id: str | None = None) -> dict[str, int]:
        """``{engine_id: pages}``: how many pages of the session's head version each live engine
        holds (engines holding none are left out), for a router to send the session's next
        request where its KV already is."""
        with self._reading():
            state = self.mirror.state(session_id, tenant_id)
            if state.head_id is None:
                return {}
            record = state.record
            match = self.matcher.match(
                state.tokens(state.head_id), record.layout, record.tenant_id, record.user_ref, state
            )
            return self.device.holders(PageId(p.page_id) for p in match.pages)

    # -- compaction ------------------------------------------------------------------------

    def compact(self, *, dry_run: bool = False) -> Compaction:
        """Rewrite the disk tier's sparse segment files (dead bytes at least
        ``compact_dead_share`` of their size): live pages are copied into new files, the
        catalog points at the copies in one transaction per new file, and the old files are
        deleted after it committed, so dead bytes stop counting against ``disk_bytes``.
        ``dry_run=True`` says what it would do and changes nothing. Safe against a kill at
        any instant and against other processes writing, reading or compacting meanwhile.
        Runs by itself (``compact_auto``) after writes that drop pages and before a full
        disk evicts live pages."""
        check_flag("dry_run", dry_run)
        with self._reading():
            pass
        try:
            return self.writer.compact(dry_run=dry_run)
        except OSError as exc:
            raise InternalError(
                f"compaction could not write a page file ({exc.strerror or exc}); the files "
                "compacted before stay compacted, the others as they were"
            ) from None

    # -- inspection ------------------------------------------------------------------------

    def sql(self, query: str, params: dict[str, Any] | None = None, *, max_rows: int = 10_000) -> SqlResult:
        """Run one read-only SQL statement on the catalog; any write is refused (``ReadOnlyViolation``)."""
        self._check_open()
        return self.catalog.sql(query, params, max_rows)

    def check(self) -> list[str]:
        """Every broken invariant, as a sentence each; ``[]`` when the store is sound. Read-only."""
        with self._reading():
            problems = integrity.check(self.catalog, self.mirror, self.disk, self.host, self.config.disk_bytes)
            if self._near is not None:
                problems += self._near.problems()
            return problems

    def stats(self) -> dict[str, Any]:
        """Tiers as this process sees them: per tier its pages, bytes (``inactive_bytes``: those
        the mover demoted, still readable), capacity, watermarks (bytes) and what the policy did (``hits``, ``misses``, ``promotions`` into it,
        ``demotions`` out of it, ``evictions`` from it with no copy left below, ``moved_bytes``,
        ``inline_evictions`` made by a foreground write rather than the mover); ``prefetch``:
        pages ``issued`` (moved up), ``hits`` (then read from host), ``wasted`` (left host
        unread); ``policy``: its name and mover passes; ``erasures``: the erasures not finished
        yet (``open``, and ``oldest_open_s``, seconds since the oldest of them started, 0 when
        none); ``lsh``: this process's MinHash-LSH index (indexes, entries, capacity, indexes
        dropped to stay within it, bands and rows, storage ``"memory"``, ``"redis"`` or
        ``"none"`` before approximate matching was first used)."""
        with self._reading(), self.catalog.read() as conn:
            disk_used = segments.tier_bytes(conn, "disk", self.node.ref)
            disk_pages = segments.count_located(conn, "disk", self.node.ref)
            open_jobs = erasures.open_jobs(conn)
            lsh = (
                self._near.lsh.stats()
                if self._near is not None
                else {"indexes": 0, "entries": 0, "capacity": self.config.lsh_max_entries, "storage": "none"}
            )
        oldest = min((job.started_at for job in open_jobs), default=None)
        settings = self.placement.settings
        out: dict[str, Any] = {
            "host": {
                "pages": len(self.host),
                "bytes": self.host.used_bytes,
                "capacity": self.host.capacity_bytes,
                "inactive_bytes": self.host.inactive_bytes,
                "precision": self.config.host_precision,
            },
            "disk": {
                "pages": disk_pages,
                "bytes": disk_used,
                "capacity": self.config.disk_bytes,
                "inactive_bytes": self.disk.inactive.bytes,
                "precision": self.config.disk_precision,
            },
            "erasures": {"open": len(open_jobs), "oldest_open_s": (now() - oldest).total_seconds() if oldest else 0.0},
            "lsh": lsh,
        }
        for tier in TIERS:
            high, low = fill.watermarks(settings, tier, out[tier]["capacity"])
            out[tier].update({"high_watermark": high, "low_watermark": low})
            counts = self.placement.counts[tier]
            out[tier].update({name: int(counts[name]) for name in COUNTERS})
        out["prefetch"] = {name: int(n) for name, n in self.placement.prefetch.items()}
        out["policy"] = {"name": settings.policy, "mover_passes": self.mover.passes}
        return out

    def run_mover(self) -> dict[str, int]:
        """Run one pass of the mover now, in this thread: demote host and disk down to their low
        marks where they passed their high marks (demoted pages and segments stay readable until
        a write needs their room), then record this process's tiers in the ``tier_policy``
        table. Returns the pages demoted per tier."""
        self._check_open()
        moved = self.mover.run()
        self.mover.record()
        return moved
