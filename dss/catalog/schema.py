"""The catalog's tables, as SQLAlchemy 2 declarative models.

The Alembic migrations in ``migrations/`` create exactly these tables (a test compares
them); the read-only views operators query are defined in the migrations, as SQL.

Token histories are stored compactly: a version keeps only the tokens it adds to a base
version (``base_id``, first ``base_len`` tokens), packed as little-endian uint32 bytes.

Nothing a user wrote is stored in clear where the catalog need not search it: token
histories, session ids and version labels are sealed under the owner's data key (so an
erasure leaves them unreadable even in a database's dead rows); a session is found by a
keyed hash of its id. Surrogate ids are never handed out twice (SQLite: ``AUTOINCREMENT``;
PostgreSQL: sequences), so an old id can never name someone else's row.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_REVISION = "0007"
"""The Alembic revision this code expects the catalog to be at."""


NEVER_REUSED = {"sqlite_autoincrement": True}
"""Table options of every table with a surrogate integer key: SQLite never hands an id out twice."""


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(256), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class User(Base):
    """A namespace: one user of one tenant."""

    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("tenant_ref", "user_id"), NEVER_REUSED)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_ref: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    user_id: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class LayoutRow(Base):
    __tablename__ = "layouts"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[bytes] = mapped_column(LargeBinary(16), unique=True)
    name: Mapped[str] = mapped_column(String(256))
    page_tokens: Mapped[int] = mapped_column(Integer)
    page_bytes: Mapped[int] = mapped_column(Integer)
    spec: Mapped[str] = mapped_column(Text)


class SessionRow(Base):
    __tablename__ = "sessions"
    __table_args__ = (UniqueConstraint("tenant_ref", "session_key"), Index("ix_sessions_seq", "seq"), NEVER_REUSED)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    session_key: Mapped[bytes] = mapped_column(LargeBinary(16))
    """A keyed hash of the session id (:func:`dss.core.crypto.session_key`): how a session is found by id."""
    name: Mapped[bytes] = mapped_column(LargeBinary)
    """The session id, sealed under the owner's data key."""
    tenant_ref: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    user_ref: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    layout_ref: Mapped[int] = mapped_column(ForeignKey("layouts.id"))
    head_id: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    last_access: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    seq: Mapped[int] = mapped_column(BigInteger)


class VersionRow(Base):
    __tablename__ = "versions"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    session_ref: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    parent_id: Mapped[int | None] = mapped_column(BigInteger)
    base_id: Mapped[int | None] = mapped_column(BigInteger)
    base_len: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    suffix: Mapped[bytes] = mapped_column(LargeBinary)
    label: Mapped[bytes | None] = mapped_column(LargeBinary)
    """The version's label, sealed under the owner's data key (``None``: no label)."""
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    sealed: Mapped[bool] = mapped_column(Boolean, server_default=false())
    """Whether ``suffix`` is sealed under the owner's data key (always, since revision 0002; labels always are)."""


class Node(Base):
    """A store folder sharing the catalog: one host's host and disk tiers (a node of a fleet).

    ``folder_id`` is the random id kept in the folder (its ``store-id`` file); ``node_id`` the
    name operators and the router use.
    """

    __tablename__ = "nodes"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[str] = mapped_column(String(64), unique=True)
    folder_id: Mapped[bytes] = mapped_column(LargeBinary(16), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class Segment(Base):
    """A page file on a node-local durable tier: one batch of pages of one namespace, in the
    folder of node ``node_ref`` (no other node ever reads it)."""

    __tablename__ = "segments"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tier: Mapped[str] = mapped_column(String(16))
    node_ref: Mapped[int] = mapped_column(ForeignKey("nodes.id"), index=True)
    user_ref: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class PageRow(Base):
    """A page whose bytes a durable tier holds."""

    __tablename__ = "pages"
    __table_args__ = (Index("ix_pages_user_seq", "user_ref", "seq"),)
    page_id: Mapped[bytes] = mapped_column(LargeBinary(16), primary_key=True)
    user_ref: Mapped[int] = mapped_column(ForeignKey("users.id"))
    layout_ref: Mapped[int] = mapped_column(ForeignKey("layouts.id"))
    page_index: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(Integer)
    checksum: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    seq: Mapped[int] = mapped_column(BigInteger)


class PageLocation(Base):
    __tablename__ = "page_locations"
    page_id: Mapped[bytes] = mapped_column(ForeignKey("pages.page_id"), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    segment_ref: Mapped[int] = mapped_column(ForeignKey("segments.id"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(Integer)
    encoding: Mapped[str] = mapped_column(String(16), server_default="exact")
    """The copy's precision (:mod:`dss.core.precision`): ``exact`` or a lossy encoding."""


class SessionPage(Base):
    """Session ``session_ref`` holds page ``page_id``: some version of it contains the page.

    ``version_ref`` is the newest version of the session that contains it (0: saved ahead
    of the commit that will contain it); disk eviction drops first the pages whose newest
    version is no session's head (an abandoned branch). ``pinned``: a pinned version of the
    session contains it (eviction never drops it).
    """

    __tablename__ = "session_pages"
    session_ref: Mapped[int] = mapped_column(ForeignKey("sessions.id"), primary_key=True)
    page_id: Mapped[bytes] = mapped_column(ForeignKey("pages.page_id"), primary_key=True, index=True)
    version_ref: Mapped[int] = mapped_column(BigInteger)
    pinned: Mapped[bool] = mapped_column(Boolean, server_default=false())


class Quarantine(Base):
    """A page found corrupt on read: never served again, kept here for the operator."""

    __tablename__ = "quarantine"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    page_id: Mapped[bytes] = mapped_column(LargeBinary(16))
    user_ref: Mapped[int] = mapped_column(Integer)
    tier: Mapped[str] = mapped_column(String(16))
    segment: Mapped[str] = mapped_column(String(128))
    offset: Mapped[int] = mapped_column(BigInteger)
    reason: Mapped[str] = mapped_column(Text)
    detected_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class FeedRow(Base):
    """The change feed: what each write transaction changed, so other processes can refresh
    their caches (see :mod:`dss.catalog.feed` for the kinds of event)."""

    __tablename__ = "feed"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, index=True)
    kind: Mapped[str] = mapped_column(String(16))
    session_ref: Mapped[int | None] = mapped_column(Integer)
    user_ref: Mapped[int | None] = mapped_column(Integer)
    page_id: Mapped[bytes | None] = mapped_column(LargeBinary(16))


class CatalogSeq(Base):
    """One row: the sequence number of the last write transaction, and below which
    sequence number ``feed`` rows were pruned (a process behind that reloads everything)."""

    __tablename__ = "catalog_seq"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    floor: Mapped[int] = mapped_column(BigInteger)


class UserKey(Base):
    """A namespace's data key, wrapped under the master key; deleting the row shreds the data."""

    __tablename__ = "user_keys"
    user_ref: Mapped[int] = mapped_column(ForeignKey("users.id"), primary_key=True)
    wrapped: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class StoreMeta(Base):
    """Facts about the store itself (e.g. which master key it was made with)."""

    __tablename__ = "store_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[bytes] = mapped_column(LargeBinary)


class Erasure(Base):
    """A forget-user job: its plan and how far it got, so a crash can be resumed."""

    __tablename__ = "erasures"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(256))
    user_id: Mapped[str] = mapped_column(String(256))
    user_ref: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(32))
    plan: Mapped[str] = mapped_column(Text)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Audit(Base):
    """Receipts of what dss did on request (erasures), kept for the operator."""

    __tablename__ = "audit"
    __table_args__ = NEVER_REUSED
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tenant_id: Mapped[str] = mapped_column(String(256))
    user_id: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    receipt: Mapped[str] = mapped_column(Text)


class TierTotal(Base):
    """Bytes and segments per durable tier of each node, kept in step with ``segments`` (so
    placement does not sum the whole table at every write; ``check()`` verifies it)."""

    __tablename__ = "tier_totals"
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    node_ref: Mapped[int] = mapped_column(Integer, primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    num_segments: Mapped[int] = mapped_column(BigInteger)


class TierPolicy(Base):
    """What one process's placement policy sees and did, per tier (written by the store at
    open, by the mover's passes and at close; ``process`` is ``host:pid``)."""

    __tablename__ = "tier_policy"
    process: Mapped[str] = mapped_column(String(128), primary_key=True)
    tier: Mapped[str] = mapped_column(String(16), primary_key=True)
    policy: Mapped[str] = mapped_column(String(16))
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    used_bytes: Mapped[int] = mapped_column(BigInteger)
    high_watermark_bytes: Mapped[int] = mapped_column(BigInteger)
    low_watermark_bytes: Mapped[int] = mapped_column(BigInteger)
    user_quota_bytes: Mapped[int] = mapped_column(BigInteger)
    tenant_quota_bytes: Mapped[int] = mapped_column(BigInteger)
    hits: Mapped[int] = mapped_column(BigInteger)
    misses: Mapped[int] = mapped_column(BigInteger)
    promotions: Mapped[int] = mapped_column(BigInteger)
    demotions: Mapped[int] = mapped_column(BigInteger)
    evictions: Mapped[int] = mapped_column(BigInteger)
    moved_bytes: Mapped[int] = mapped_column(BigInteger)
    prefetch_hits: Mapped[int] = mapped_column(BigInteger)
    prefetch_wasted: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


def _table(model: type[Base]) -> Table:
    """``model``'s table (typed as the ``Table`` it is, not the ``FromClause`` it is declared as)."""
    table = model.__table__
    assert isinstance(table, Table)
    return table


tenants, users, layouts = _table(Tenant), _table(User), _table(LayoutRow)
sessions, versions = _table(SessionRow), _table(VersionRow)
pages, locations, session_pages = _table(PageRow), _table(PageLocation), _table(SessionPage)
nodes = _table(Node)
segments, quarantine, tier_totals = _table(Segment), _table(Quarantine), _table(TierTotal)
user_keys, store_meta = _table(UserKey), _table(StoreMeta)
tier_policy = _table(TierPolicy)
erasures, audit, feed, catalog_seq = _table(Erasure), _table(Audit), _table(FeedRow), _table(CatalogSeq)
"""The tables, for the queries of the other catalog modules."""
