"""The open store's parts and what every role of :class:`dss.store.Store` shares: opening
(every part made and wired, or none left open), closing, the lock, and the helpers the
methods of several roles use."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from typing import Any, Self

from dss.approx.lsh import LshIndex, Settings
from dss.approx.nearest import Nearest
from dss.approx.upkeep import Upkeep
from dss.catalog import segments
from dss.catalog.change import Applied
from dss.catalog.database import catalog_errors, open_catalog
from dss.core.config import StoreConfig, sqlite_url
from dss.core.crypto import read_master_key
from dss.core.epoch import Epoch
from dss.core.errors import ErasureIncomplete, InvalidInput, NoStore
from dss.core.precision import Precision
from dss.core.types import CACHE_PREFIX, Layout, Version
from dss.core.validate import check_flag, check_layout, check_name
from dss.erasure.job import Eraser
from dss.pages.copies import RemoteCopies
from dss.pages.host import HostPages
from dss.pages.index import PageIndex
from dss.pages.keys import DataKeys, adopt_master_key
from dss.pages.reader import PageReader
from dss.pages.store import PageStore
from dss.placement import policy
from dss.placement.policy import Placement
from dss.sessions.matcher import Matcher
from dss.sessions.mirror import Mirror
from dss.sessions.resume import Rates
from dss.sessions.state import SessionState
from dss.store.folder import adopt_folder, file_errors, folder_lock, has_store, open_catalog_file
from dss.tiers.device import for_catalog as device_tier
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier
from dss.tiers.remote import RemoteTier
from dss.writes.compaction import Compactor
from dss.writes.creator import Creator
from dss.writes.mover import Mover
from dss.writes.writer import Guard, Writer

log = logging.getLogger("dss.store")


class Base:
    """An open store's parts, opening and closing; :class:`dss.store.Store` adds its methods by role."""

    def __init__(self, config: StoreConfig, *, create: bool = True) -> None:
        """Open the store, making it first if there is none at ``config.home`` (with
        ``create=False``: ``NoStore``, and nothing is made). A refused open (``DssError``)
        releases what it opened, and leaves no master key file it made; a file-system failure
        (read-only file system, missing permission, a file where a folder should be) is a
        ``StoreFolderError`` naming the path and the cause."""
        check_flag("create", create)
        try:
            with catalog_errors():
                self._open(config, create)
        except BaseException:
            self._release()
            raise

    def _open(self, config: StoreConfig, create: bool) -> None:
        """Open the store's parts, lowest floor first, each given the values it needs (no
        part is handed a callable of a part above it), then finish what a crash left."""
        self.config = config
        if not create and not has_store(config.home, config.url):
            raise NoStore(f"no store at {config.home}")
        with file_errors("make the store folder", config.home):
            config.home.mkdir(parents=True, exist_ok=True)
        self._open_catalog()
        self._open_tiers()
        self._open_pages()
        self._open_reads()
        self._open_writes()
        self._recover()

    def _open_catalog(self) -> None:
        """The remote tier (a bad URL is refused before anything is made), the catalog, the
        master key, this folder's node and the epoch file; on PostgreSQL, the feed's listener."""
        config = self.config
        home = config.home
        self.remote = (
            None
            if config.remote_url is None
            else RemoteTier(  # a bad URL is refused before anything is made
                config.remote_url.get_secret_value(),
                prefix=config.remote_prefix,
                timeout_s=config.remote_timeout_s,
                max_pending_bytes=config.remote_pending_bytes,
            )
        )
        with folder_lock(home):
            hex_key = config.master_key.get_secret_value() if config.master_key else None
            master = read_master_key(config.master_key_file, home, hex_key)
            sql_url = config.sql_url.get_secret_value() if config.sql_url else None
            open_catalog_file(config.url)
            self.catalog = open_catalog(
                config.url, fsync=config.fsync, sql_timeout_s=config.sql_timeout_s, sql_url=sql_url
            )
            self.catalog.ensure_schema()
            self._master = adopt_master_key(self.catalog, master, config.master_key_file)
            self.node = adopt_folder(self.catalog, home, config.node_id)
            with file_errors("open the epoch file", home / "epoch"):
                self._epoch = Epoch(home / "epoch")
        self.listener = None
        if not self.catalog.is_sqlite:  # (imported here: psycopg is there only with a PostgreSQL catalog)
            from dss.catalog.listen import FeedListener

            self.listener = FeedListener(self.catalog.engine.url, self._epoch, poll_s=config.feed_poll_s)

    def _open_tiers(self) -> None:
        """The disk, host and device tiers, the policy and the page index."""
        config = self.config
        home = config.home
        with file_errors("set up the page files at", home):
            self.disk = DiskTier(home, fsync=config.fsync, map_reads=config.disk_map_reads)
        self.placement = Placement(policy_settings(config), config.clock or time.monotonic)
        self.host = HostTier(config.host_bytes)
        self.device = device_tier(_catalog_key(config), config.residency_ttl_s)
        self.index = PageIndex(self.host, has_remote=self.remote is not None, resident=self.device.held)

    def _open_pages(self) -> None:
        """Data keys, the mirror (and the LSH index's upkeep), the page store's write and read
        sides, and the host tier as they fill it."""
        config = self.config
        self.keys = DataKeys(self.catalog, self._master, encrypt=config.encrypt)
        self.mirror = Mirror(self.catalog, self._epoch, self.index, self.keys, self.node.ref)
        self.upkeep = Upkeep(self.mirror)
        self.hosted = HostPages(self.host, self.placement, self.index, self.catalog)
        copies = RemoteCopies(self.remote, self.keys, self.index) if self.remote is not None else None
        self.pages = PageStore(
            self.catalog,
            self.disk,
            self.hosted,
            node_ref=self.node.ref,
            disk_bytes=config.disk_bytes,
            segment_bytes=config.segment_bytes,
            copies=copies,
            precision=Precision(config.host_precision, config.disk_precision, config.remote_precision),
        )
        self.reader = PageReader(self.catalog, self.disk, self.hosted, self.keys, node_ref=self.node.ref, copies=copies)

    def _open_reads(self) -> None:
        """What resume and lookup answer from: the rates, the matcher and (when asked for)
        the LSH index."""
        config = self.config
        speeds = {"host": config.host_read_gbps * 1e9, "disk": config.disk_read_gbps * 1e9}
        if self.remote is not None:
            speeds["remote"] = config.remote_read_gbps * 1e9
        self.rates = Rates(speeds, config.recompute_tokens_per_s)
        self.matcher = Matcher(self.mirror, self.index, self.rates, self.device)
        self._near: Nearest | None = None
        if config.approximate or config.lsh_redis_url is not None:
            self._nearest_index()  # now: a missing datasketch is a ConfigError at open; Redis is kept current

    def _open_writes(self) -> None:
        """The erasure job, the guard, the writer with its compactor, the session maker and
        the mover."""
        config = self.config
        self.eraser = Eraser(self.catalog, self.mirror, self.upkeep, self.pages)
        self.guard = Guard(self.mirror, self.upkeep, self.pages)
        self.writer = Writer(
            self.catalog,
            self.mirror,
            self.upkeep,
            self.pages,
            self.keys,
            self.index,
            self.guard,
            self._master,
            Compactor(
                self.catalog,
                self.disk,
                node_ref=self.node.ref,
                dead_share=config.compact_dead_share,
                segment_bytes=config.segment_bytes,
            ),
            group_commit=config.group_commit,
            compact_auto=config.compact_auto,
        )
        self.creator = Creator(self.writer)
        self.mover = Mover(
            self.guard,
            self.pages,
            self.catalog,
            self.placement,
            disk_bytes=config.disk_bytes,
            interval_s=config.mover_interval_s,
            batch=config.move_batch_pages,
            clock=config.clock if config.mover else None,
        )

    def _recover(self) -> None:
        """Remove the page files dead writers left, finish interrupted erasures, build the LSH
        index when asked, start the mover."""
        config = self.config
        home = config.home
        with self.catalog.read() as conn, file_errors("clean up the page file", home):
            removed = self.disk.recover(set(segments.all_segments(conn, "disk", self.node.ref)))
        if removed:
            log.info("removed %d page files left behind by dead writers", len(removed))
        try:
            finished = self.eraser.resume_all()
        except ErasureIncomplete as exc:  # e.g. the remote tier is down: the next open (or forget_user) finishes it
            log.warning("an erasure a crash had interrupted is still unfinished: %s", exc)
        else:
            if finished:
                log.info("finished %d erasures a crash had interrupted", len(finished))
        if config.approximate:
            built = self._nearest_index().build_all()
            log.info("LSH index: %d namespaces and layouts indexed at open", built)
        self.mover.record()
        if config.mover:
            self.mover.start()

    def close(self) -> None:
        """Release files and connections. Idempotent; the store is unusable afterwards."""
        mover = getattr(self, "mover", None)
        if mover is not None:
            mover.close()  # outside the lock: its batch in progress takes it
            if not self.guard.is_closed:
                try:
                    mover.record()  # best effort: closing never fails for the statistics table
                except Exception as exc:  # noqa: BLE001
                    log.warning("could not record the tier statistics at close: %s", exc)
        with self.guard.lock:
            if not self.guard.is_closed:
                self.guard.is_closed = True
                self._release()

    def _release(self) -> None:
        """Close the files and connections opened so far (all of them once open)."""
        remote = getattr(self, "remote", None)
        if remote is not None:
            if not remote.flush(timeout_s=4 * self.config.remote_timeout_s):
                log.warning("closing with %d bytes not yet written to the remote tier", remote.pending_bytes)
            remote.close()
        for part in (
            getattr(self, "listener", None),
            getattr(self, "disk", None),
            getattr(self, "_epoch", None),
            getattr(self, "catalog", None),
        ):
            if part is not None:
                part.close()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.guard.is_closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _wake_mover(self) -> None:
        """After a read or write: wake the mover when the host tier is past its high watermark
        (a write's pages or a read's promotions can leave it so); on an injected clock, step it
        (:meth:`dss.writes.mover.Mover.step`)."""
        self.mover.step(self.hosted.above_high_mark)

    def _check_open(self) -> None:
        self.guard.check_open()

    def _reading(self) -> contextlib.AbstractContextManager[None]:
        return self.guard.reading()

    def _approximate(self, approximate: bool | None) -> bool:
        if approximate is None:
            return self.config.approximate
        check_flag("approximate", approximate)
        return approximate

    def _nearest_index(self) -> Nearest:
        """The near-duplicate search, its index made on first use (``ConfigError`` without datasketch)."""
        if self._near is None:
            config = self.config
            settings = Settings(
                config.lsh_threshold,
                config.lsh_permutations,
                config.lsh_shingle_tokens,
                config.lsh_window_tokens,
                config.lsh_max_entries,
            )
            secret = config.lsh_redis_url or getattr(config, "remote_url", None)  # the remote tier's Redis, if any
            url = secret.get_secret_value() if secret is not None else None
            store_tag = hashlib.blake2b(self._master, digest_size=6, person=b"dss-lsh-store").hexdigest()
            lsh = LshIndex(settings, redis_url=url, redis_prefix=f"{config.lsh_redis_prefix}:{store_tag}")
            self.upkeep.lsh = lsh
            self._near = Nearest(self.mirror, self.index, self.upkeep, self.rates, config.lsh_min_share)
        return self._near

    def _scope(
        self, session_id: str | None, tenant_id: str | None, user_id: str | None, layout: Layout | None
    ) -> tuple[Layout, str, int | None, SessionState | None]:
        """Layout, tenant, namespace and session a near-duplicate search covers (checked)."""
        if session_id is not None:
            if user_id is not None or layout is not None:
                raise InvalidInput("give a session_id, or user_id and layout, not both")
            state = self.mirror.state(session_id, tenant_id)
            return state.layout, state.record.tenant_id, state.user_ref, state
        if layout is None:
            raise InvalidInput("without a session_id, a layout is needed")
        check_layout(layout)
        tenant = tenant_id if tenant_id is not None else "default"
        user = user_id if user_id is not None else "anonymous"
        check_name("tenant_id", tenant)
        check_name("user_id", user)
        return layout, tenant, self.mirror.user_ref(tenant, user), None

    def _version(self, applied: Applied, version_id: int | None = None) -> Version:
        """The version a write made or changed: as the writer read it when it applied the
        change, else (another process moved the session on at once) loaded again."""
        if applied.version is not None:
            return applied.version
        state = self.writer.state_of(applied)
        version_id = version_id if version_id is not None else applied.version_id
        assert version_id is not None  # the change made a version
        with self._reading():
            return state.version(version_id)

    def _create(self, session_id: str, user_id: str, tenant_id: str, layout: Layout) -> SessionState:
        check_name("user_id", user_id)
        check_name("tenant_id", tenant_id)
        check_layout(layout)
        return self.creator.create(session_id, user_id, tenant_id, layout)

    def _cache_session(self, tenant_id: str, user_id: str, layout: Layout) -> SessionState:
        """The session holding pages saved without a session, one per namespace and layout
        (made on first use; the arguments were checked by :func:`sessionless`)."""
        session_id = f"{CACHE_PREFIX}{layout.digest.hex()[:16]}-{_short(user_id)}"
        state = self._create(session_id, user_id, tenant_id, layout)
        return state


# -- helpers ---------------------------------------------------------------------------------


def policy_settings(config: StoreConfig) -> policy.Settings:
    """The placement policy's settings from a store's configuration."""
    return policy.Settings(
        policy=config.policy,
        weights=config.policy_weights,
        frequency_half_life_s=config.frequency_half_life_s,
        recency_half_life_s=config.recency_half_life_s,
        promote_after=config.promote_after,
        promote_interval_s=config.promote_interval_s,
        cooldown_s=config.cooldown_s,
        host_high=config.host_high_watermark,
        host_low=config.host_low_watermark,
        disk_high=config.disk_high_watermark,
        disk_low=config.disk_low_watermark,
        host_user_quota=config.host_user_quota,
        host_tenant_quota=config.host_tenant_quota,
        disk_user_quota=config.disk_user_quota,
        disk_tenant_quota=config.disk_tenant_quota,
        move_batch_pages=config.move_batch_pages,
        disk_bytes_per_s=config.disk_read_gbps * 1e9,
        recompute_tokens_per_s=config.recompute_tokens_per_s,
    )


def _catalog_key(config: StoreConfig) -> str:
    """What names a catalog in this process (the residency of engines is shared per catalog)."""
    return config.catalog_url or sqlite_url((config.home / "catalog.db").resolve())


def sessionless(tenant_id: Any, user_id: Any, layout: Any) -> tuple[str, str, Layout]:
    """The namespace and layout of a save without a session, checked."""
    if tenant_id is None or user_id is None or layout is None:
        raise InvalidInput("save_pages without a session needs tenant_id, user_id and layout")
    check_name("user_id", user_id)
    check_name("tenant_id", tenant_id)
    return tenant_id, user_id, check_layout(layout)


def _short(value: str) -> str:
    return hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
