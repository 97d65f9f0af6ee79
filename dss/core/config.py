"""Configuration: one validated object, read from arguments, ``DSS_*`` variables and a file.

This is the only module that reads the environment. Precedence, highest first: keyword
arguments, ``DSS_*`` environment variables, the TOML file named by ``DSS_CONFIG`` (else
``dss.toml`` in the store folder, if present), the defaults below. Lower layers receive
plain values from the resulting :class:`StoreConfig`; nothing mutates it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from dss.core.errors import ConfigError
from dss.core.precision import lossier
from dss.core.sizes import parse_size


class StoreConfig(BaseModel):
    """Everything a store needs to open. Immutable once built."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    home: Path = Field(description="Store folder: catalog (SQLite default), page files, keys.")
    catalog_url: str | None = Field(None, description="SQLAlchemy URL of the catalog; default SQLite in home.")
    host_bytes: int = Field(1 << 30, description="Capacity of the host (RAM) tier of each process, bytes.")
    disk_bytes: int = Field(16 << 30, description="Capacity of the disk tier, bytes.")
    master_key_file: Path | None = Field(
        None,
        description="File with the 32-byte master key that wraps every "
        "user's data key; outside the store folder. Default ~/.config/dss/master.key.",
    )
    master_key: SecretStr | None = Field(None, description="The master key as 64 hex digits (instead of a file).")
    encrypt: bool = Field(True, description="Seal pages and token histories at rest; off only for benchmarks.")
    fsync: bool = Field(True, description="fsync page files and the catalog; turn off only for throwaway stores.")
    group_commit: bool = Field(
        True,
        description="Concurrent writes of this process share one catalog "
        "transaction and one round of fsyncs; each returns once the group is durable.",
    )
    segment_bytes: int = Field(64 << 20, description="Largest page file written in one batch.")
    disk_map_reads: bool = Field(
        True,
        description="Read large runs of page files by mapping them from the OS page cache, "
        "not copying them out (loads from disk pass over the bytes once less); turn off "
        "on a network filesystem, where a mapped page the server loses stops the process.",
    )
    host_read_gbps: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="Estimated host-tier load bandwidth, GB/s."
    )
    disk_read_gbps: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Estimated disk-tier load bandwidth, GB/s."
    )
    recompute_tokens_per_s: float = Field(
        4000.0, gt=0, allow_inf_nan=False, description="Estimated prefill speed, for load-or-recompute."
    )
    sql_timeout_s: float = Field(
        10.0, gt=0, le=86_400, allow_inf_nan=False, description="Time limit of one read-only SQL query, seconds."
    )
    sql_url: SecretStr | None = Field(
        None,
        description="URL of the PostgreSQL role sql() runs as (it may only read); "
        "default: a role dss creates, which needs CREATEROLE for the catalog user.",
    )
    node_id: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Name of this folder as a node of a fleet sharing one catalog; needed "
        "to join a catalog another folder uses. Default: the folder's own id.",
    )
    remote_url: SecretStr | None = Field(
        None,
        description="URL of the remote tier shared by the fleet: "
        "redis://host:port/db (rediss:// for TLS), redis+cluster://host:port for "
        "a Redis Cluster.",
    )
    remote_prefix: str = Field(
        "dss:",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Prefix of every key dss writes in the remote tier.",
    )
    remote_timeout_s: float = Field(
        0.5, gt=0, le=60, allow_inf_nan=False, description="Time limit of one remote-tier round trip, seconds."
    )
    remote_pending_bytes: int = Field(
        256 << 20,
        description="Most page bytes waiting to be written to the "
        "remote tier; beyond it the oldest are not written (a later miss).",
    )
    remote_read_gbps: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Estimated remote-tier load bandwidth, GB/s."
    )
    feed_poll_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="PostgreSQL catalog: how often a node polls for other nodes' writes "
        "when no notification came (LISTEN/NOTIFY tells it sooner).",
    )
    compact_dead_share: float = Field(
        0.5,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="A disk segment whose dead records (of dropped pages) reach "
        "this share of its size is rewritten by compaction.",
    )
    compact_auto: bool = Field(
        True,
        description="Compact sparse disk segments after writes that drop pages and "
        "before a full disk evicts live ones.",
    )
    residency_ttl_s: float = Field(
        300.0,
        gt=0,
        allow_inf_nan=False,
        description="An engine that reports no residency (device tier) for this many "
        "seconds is taken to be gone: the pages it held no longer count as on device.",
    )

    approximate: bool = Field(
        False,
        description="Default of resume(approximate=...): when the exact paths match "
        "less than lsh_min_share of the prompt, verify MinHash-LSH candidates exactly "
        "(needs datasketch).",
    )
    lsh_threshold: float = Field(
        0.85,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="Jaccard similarity of token shingles from which LSH proposes a version.",
    )
    lsh_permutations: int = Field(128, ge=16, le=1024, description="MinHash permutations per signature.")
    lsh_shingle_tokens: int = Field(4, ge=1, le=64, description="Tokens per shingle.")
    lsh_window_tokens: int = Field(
        256, ge=16, le=1 << 20, description="Tokens per page-aligned window indexed besides each whole version."
    )
    lsh_min_share: float = Field(
        0.5,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="Approximate resume runs only when the exact match is below this share of the prompt.",
    )
    lsh_max_entries: int = Field(1_000_000, ge=1, description="Most LSH entries (versions and windows) held.")
    lsh_redis_url: SecretStr | None = Field(
        None, description="Redis URL: keep the LSH index there (shared by every node) instead of in memory."
    )
    lsh_redis_prefix: str = Field(
        "dss-lsh",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Prefix of the LSH index's Redis keys.",
    )

    # -- placement policy (dss.placement.policy) --
    policy: Literal["dss", "lru"] = Field(
        "dss",
        description="Placement policy: 'dss' (score of frequency, "
        "recency and cost) or 'lru' (plain least recently used).",
    )
    policy_weights: tuple[float, float, float] = Field(
        (0.6, 0.3, 0.1), description="Weights of frequency, recency and 1/cost in a page's score."
    )
    frequency_half_life_s: float = Field(
        120.0, gt=0, allow_inf_nan=False, description="Half-life of a page's access frequency, seconds."
    )
    recency_half_life_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest age at which a page's recency term halves, "
        "seconds (a user's own: twice its time between turns, "
        "at least an eighth of this).",
    )
    promote_after: int = Field(
        2,
        ge=1,
        description="Accesses within promote_interval_s before a read "
        "promotes a page from disk to host (engine loads always do).",
    )
    promote_interval_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="Window of the accesses that earn a promotion, seconds."
    )
    cooldown_s: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        description="After a demotion, seconds before a read may promote the page again.",
    )
    host_high_watermark: float = Field(
        0.85,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Host fill (share of host_bytes, active pages) at which the mover starts.",
    )
    host_low_watermark: float = Field(
        0.70, ge=0, le=1, allow_inf_nan=False, description="Host fill the mover demotes down to."
    )
    disk_high_watermark: float = Field(
        0.85, gt=0, le=1, allow_inf_nan=False, description="Active share of disk_bytes at which the mover starts."
    )
    disk_low_watermark: float = Field(
        0.70, ge=0, le=1, allow_inf_nan=False, description="Disk fill the mover demotes down to."
    )
    host_user_quota: int = Field(0, description="Most host bytes one user's pages may take (0: no quota).")
    host_tenant_quota: int = Field(0, description="Most host bytes one tenant's pages may take (0: no quota).")
    disk_user_quota: int = Field(0, description="Most disk bytes one user's pages may take (0: no quota).")
    disk_tenant_quota: int = Field(0, description="Most disk bytes one tenant's pages may take (0: no quota).")
    host_precision: Literal["exact", "int8", "fp8", "k8v4"] = Field(
        "exact", description="Encoding of host copies of pages (lossy unless exact; see docs/tiers.md)."
    )
    disk_precision: Literal["exact", "int8", "fp8", "k8v4"] = Field(
        "exact", description="Encoding of disk copies of pages (lossy unless exact)."
    )
    remote_precision: Literal["exact", "int8", "fp8", "k8v4"] = Field(
        "exact", description="Encoding of remote copies: the disk copy's; may not be lossier than disk_precision."
    )
    mover: bool = Field(True, description="Run the mover (thread, or stepped on clock=; off: store.run_mover()).")
    mover_interval_s: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Seconds between mover passes (of clock= if given)."
    )
    move_batch_pages: int = Field(16, ge=8, le=16, description="Pages the mover moves per batch (8 to 16).")
    clock: Callable[[], float] | None = Field(
        None,
        exclude=True,
        description="Policy and mover time (seconds); default time.monotonic. Not read from files or the environment.",
    )

    @field_validator(
        "host_bytes",
        "disk_bytes",
        "segment_bytes",
        "host_user_quota",
        "host_tenant_quota",
        "disk_user_quota",
        "disk_tenant_quota",
        "remote_pending_bytes",
        mode="before",
    )
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)

    @model_validator(mode="after")
    def _policy_is_sound(self) -> StoreConfig:
        if any(w < 0 for w in self.policy_weights) or not sum(self.policy_weights) > 0:
            raise ValueError(
                f"policy_weights must be non-negative and sum to a positive number, got {self.policy_weights}"
            )
        for tier in ("host", "disk"):
            high, low = getattr(self, f"{tier}_high_watermark"), getattr(self, f"{tier}_low_watermark")
            if low > high:
                raise ValueError(f"{tier}_low_watermark ({low}) is above {tier}_high_watermark ({high})")
            size = getattr(self, f"{tier}_bytes")
            for kind in ("user", "tenant"):
                quota = getattr(self, f"{tier}_{kind}_quota")
                if quota > size:
                    raise ValueError(
                        f"{tier}_{kind}_quota ({quota} bytes) is over the tier's size {tier}_bytes ({size} bytes)"
                    )
        return self

    @model_validator(mode="after")
    def _remote_holds_the_disk_copy(self) -> StoreConfig:
        if lossier(self.disk_precision, self.remote_precision) != self.disk_precision:
            raise ValueError(
                f"remote_precision ({self.remote_precision}) is lossier than disk_precision "
                f"({self.disk_precision}): the remote tier holds the disk copy's bytes"
            )
        return self

    @model_validator(mode="after")
    def _sql_url_needs_postgresql(self) -> StoreConfig:
        if self.sql_url is not None and self.url.startswith("sqlite"):
            raise ValueError("sql_url applies to a PostgreSQL catalog only (catalog_url is SQLite)")
        if self.remote_url is not None:
            scheme = self.remote_url.get_secret_value().split("://", 1)[0]
            if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
                raise ValueError("remote_url must start with redis://, rediss:// or redis+cluster://")
        return self

    @model_validator(mode="after")
    def _lsh_window_holds_shingles(self) -> StoreConfig:
        if self.lsh_window_tokens < self.lsh_shingle_tokens:
            raise ValueError(
                f"lsh_window_tokens ({self.lsh_window_tokens}) must be at least lsh_shingle_tokens "
                f"({self.lsh_shingle_tokens})"
            )
        return self

    @property
    def url(self) -> str:
        """The catalog URL, defaulting to SQLite in the store folder."""
        return self.catalog_url or sqlite_url(self.home / "catalog.db")


def sqlite_url(path: Path) -> str:
    """The SQLAlchemy URL of the SQLite database file at ``path``, built from the path rather
    than pasted into a URL, so ``?``, ``#`` and ``%`` in folder names stay part of the path
    (quoted as SQLAlchemy quotes a URL's database; :func:`dss.catalog.urls.sqlite_file` reads
    it back)."""
    return "sqlite:///" + quote(str(path), safe=" +/")


_ENV = {
    "DSS_HOME": "home",
    "DSS_CATALOG_URL": "catalog_url",
    "DSS_HOST_BYTES": "host_bytes",
    "DSS_DISK_BYTES": "disk_bytes",
    "DSS_MASTER_KEY_FILE": "master_key_file",
    "DSS_MASTER_KEY": "master_key",
    "DSS_ENCRYPT": "encrypt",
    "DSS_FSYNC": "fsync",
    "DSS_SEGMENT_BYTES": "segment_bytes",
    "DSS_DISK_MAP_READS": "disk_map_reads",
    "DSS_GROUP_COMMIT": "group_commit",
    "DSS_RECOMPUTE_TOKENS_PER_S": "recompute_tokens_per_s",
    "DSS_SQL_TIMEOUT_S": "sql_timeout_s",
    "DSS_SQL_URL": "sql_url",
    "DSS_APPROXIMATE": "approximate",
    "DSS_LSH_THRESHOLD": "lsh_threshold",
    "DSS_LSH_PERMUTATIONS": "lsh_permutations",
    "DSS_LSH_SHINGLE_TOKENS": "lsh_shingle_tokens",
    "DSS_LSH_WINDOW_TOKENS": "lsh_window_tokens",
    "DSS_LSH_MIN_SHARE": "lsh_min_share",
    "DSS_LSH_MAX_ENTRIES": "lsh_max_entries",
    "DSS_LSH_REDIS_URL": "lsh_redis_url",
    "DSS_NODE_ID": "node_id",
    "DSS_REMOTE_URL": "remote_url",
    "DSS_REMOTE_PREFIX": "remote_prefix",
    "DSS_REMOTE_TIMEOUT_S": "remote_timeout_s",
    "DSS_REMOTE_PENDING_BYTES": "remote_pending_bytes",
    "DSS_FEED_POLL_S": "feed_poll_s",
    "DSS_POLICY": "policy",
    "DSS_HOST_HIGH_WATERMARK": "host_high_watermark",
    "DSS_HOST_LOW_WATERMARK": "host_low_watermark",
    "DSS_DISK_HIGH_WATERMARK": "disk_high_watermark",
    "DSS_DISK_LOW_WATERMARK": "disk_low_watermark",
    "DSS_HOST_USER_QUOTA": "host_user_quota",
    "DSS_HOST_TENANT_QUOTA": "host_tenant_quota",
    "DSS_DISK_USER_QUOTA": "disk_user_quota",
    "DSS_DISK_TENANT_QUOTA": "disk_tenant_quota",
    "DSS_HOST_PRECISION": "host_precision",
    "DSS_DISK_PRECISION": "disk_precision",
    "DSS_REMOTE_PRECISION": "remote_precision",
}

DEFAULT_HOME = "dss-data"


def load_config(home: str | os.PathLike[str] | None = None, **overrides: Any) -> StoreConfig:
    """Build a :class:`StoreConfig`; raises ``ConfigError`` naming the bad value."""
    env = {field: os.environ[name] for name, field in _ENV.items() if os.environ.get(name)}
    chosen_home = home if home is not None else overrides.pop("home", None) or env.get("home") or DEFAULT_HOME
    if not isinstance(chosen_home, (str, os.PathLike)) or not str(chosen_home):
        raise ConfigError(f"the store folder (home) must be a path, not {type(chosen_home).__name__}")
    file_values: dict[str, Any] = {}
    file_path = os.environ.get("DSS_CONFIG") or Path(chosen_home) / "dss.toml"
    if os.environ.get("DSS_CONFIG") or Path(file_path).is_file():
        try:
            with open(file_path, "rb") as f:
                file_values = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file_path}: {exc}") from None
    file_values.pop("server", None)  # the [server] table configures `dss serve`, not the store
    values = {**file_values, **env, **{k: v for k, v in overrides.items() if v is not None}}
    values["home"] = Path(chosen_home)
    try:
        return StoreConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid dss configuration: {problems}") from None
