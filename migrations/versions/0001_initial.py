"""The first catalog: tenants, users, layouts, sessions, versions, segments, pages, and views.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BIG_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.String(256), nullable=False, unique=True),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_ref", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("tenant_ref", "user_id"),
    )
    op.create_table(
        "layouts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("digest", sa.LargeBinary(16), nullable=False, unique=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("page_tokens", sa.Integer, nullable=False),
        sa.Column("page_bytes", sa.Integer, nullable=False),
        sa.Column("spec", sa.Text, nullable=False),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("session_id", sa.String(256), nullable=False),
        sa.Column("tenant_ref", sa.Integer, sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("user_ref", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("layout_ref", sa.Integer, sa.ForeignKey("layouts.id"), nullable=False),
        sa.Column("head_id", sa.BigInteger, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("last_access", TS, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.UniqueConstraint("tenant_ref", "session_id"),
    )
    op.create_index("ix_sessions_seq", "sessions", ["seq"])
    op.create_index("ix_sessions_user_ref", "sessions", ["user_ref"])
    op.create_table(
        "versions",
        sa.Column("id", BIG_PK, primary_key=True),
        sa.Column("session_ref", sa.Integer, sa.ForeignKey("sessions.id"), nullable=False),
        sa.Column("parent_id", sa.BigInteger, nullable=True),
        sa.Column("base_id", sa.BigInteger, nullable=True),
        sa.Column("base_len", sa.Integer, nullable=False),
        sa.Column("num_tokens", sa.Integer, nullable=False),
        sa.Column("suffix", sa.LargeBinary, nullable=False),
        sa.Column("label", sa.String(256), nullable=True),
        sa.Column("pinned", sa.Boolean, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_versions_session_ref", "versions", ["session_ref"])
    op.create_table(
        "segments",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, unique=True),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("user_ref", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_index("ix_segments_user_ref", "segments", ["user_ref"])
    op.create_table(
        "pages",
        sa.Column("page_id", sa.LargeBinary(16), primary_key=True),
        sa.Column("user_ref", sa.Integer, sa.ForeignKey("users.id"), nullable=False),
        sa.Column("layout_ref", sa.Integer, sa.ForeignKey("layouts.id"), nullable=False),
        sa.Column("page_index", sa.Integer, nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("checksum", sa.BigInteger, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_pages_user_seq", "pages", ["user_ref", "seq"])
    op.create_table(
        "page_locations",
        sa.Column("page_id", sa.LargeBinary(16), sa.ForeignKey("pages.page_id"), primary_key=True),
        sa.Column("tier", sa.String(16), primary_key=True),
        sa.Column("segment_ref", sa.Integer, sa.ForeignKey("segments.id"), nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("length", sa.Integer, nullable=False),
    )
    op.create_index("ix_page_locations_segment_ref", "page_locations", ["segment_ref"])
    op.create_table(
        "page_refs",
        sa.Column("session_ref", sa.Integer, sa.ForeignKey("sessions.id"), primary_key=True),
        sa.Column("page_id", sa.LargeBinary(16), sa.ForeignKey("pages.page_id"), primary_key=True),
        sa.Column("version_ref", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_page_refs_page_id", "page_refs", ["page_id"])
    op.create_table(
        "quarantine",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("page_id", sa.LargeBinary(16), nullable=False),
        sa.Column("user_ref", sa.Integer, nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("segment", sa.String(128), nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("detected_at", TS, nullable=False),
    )
    op.create_table(
        "changes",
        sa.Column("id", BIG_PK, primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("session_ref", sa.Integer, nullable=True),
        sa.Column("user_ref", sa.Integer, nullable=True),
        sa.Column("page_id", sa.LargeBinary(16), nullable=True),
    )
    op.create_index("ix_changes_seq", "changes", ["seq"])
    seq = op.create_table(
        "catalog_seq",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("floor", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(seq, [{"id": 1, "seq": 0, "floor": 0}])
    for statement in VIEWS:
        op.execute(statement)


def downgrade() -> None:
    for name in ("version_summary", "tier_usage", "user_summary", "session_summary"):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for table in (
        "catalog_seq",
        "changes",
        "quarantine",
        "page_refs",
        "page_locations",
        "pages",
        "segments",
        "versions",
        "sessions",
        "layouts",
        "users",
        "tenants",
    ):
        op.drop_table(table)


def _tier_bytes(owner: str, tier: str) -> str:
    return (
        f"(SELECT COALESCE(SUM(loc.length), 0) FROM page_refs r JOIN page_locations loc "
        f"ON loc.page_id = r.page_id AND loc.tier = '{tier}' WHERE r.session_ref = {owner})"
    )


VIEWS = [
    f"""
    CREATE VIEW session_summary AS
    SELECT s.session_id, t.tenant_id, u.user_id, l.name AS layout,
           (SELECT COUNT(*) FROM versions v WHERE v.session_ref = s.id) AS num_versions,
           s.head_id AS head_version,
           (SELECT v.num_tokens FROM versions v WHERE v.id = s.head_id) AS head_tokens,
           (SELECT COUNT(*) FROM page_refs r WHERE r.session_ref = s.id) AS num_pages,
           (SELECT COALESCE(SUM(p.size), 0) FROM page_refs r JOIN pages p ON p.page_id = r.page_id
             WHERE r.session_ref = s.id) AS page_bytes,
           {_tier_bytes("s.id", "disk")} AS disk_bytes,
           {_tier_bytes("s.id", "remote")} AS remote_bytes,
           s.created_at, s.last_access
    FROM sessions s
    JOIN tenants t ON t.id = s.tenant_ref
    JOIN users u ON u.id = s.user_ref
    JOIN layouts l ON l.id = s.layout_ref
    """,
    """
    CREATE VIEW user_summary AS
    SELECT t.tenant_id, u.user_id,
           (SELECT COUNT(*) FROM sessions s WHERE s.user_ref = u.id) AS num_sessions,
           (SELECT COUNT(*) FROM versions v JOIN sessions s ON s.id = v.session_ref
             WHERE s.user_ref = u.id) AS num_versions,
           (SELECT COUNT(*) FROM pages p WHERE p.user_ref = u.id) AS num_pages,
           (SELECT COALESCE(SUM(p.size), 0) FROM pages p WHERE p.user_ref = u.id) AS page_bytes,
           (SELECT COALESCE(SUM(g.size), 0) FROM segments g WHERE g.user_ref = u.id AND g.tier = 'disk')
             AS disk_bytes,
           (SELECT COALESCE(SUM(g.size), 0) FROM segments g WHERE g.user_ref = u.id AND g.tier = 'remote')
             AS remote_bytes,
           (SELECT MAX(s.last_access) FROM sessions s WHERE s.user_ref = u.id) AS last_access
    FROM users u
    JOIN tenants t ON t.id = u.tenant_ref
    """,
    """
    CREATE VIEW tier_usage AS
    SELECT g.tier,
           COUNT(*) AS num_segments,
           COALESCE(SUM(g.size), 0) AS bytes,
           (SELECT COUNT(*) FROM page_locations loc WHERE loc.tier = g.tier) AS num_pages,
           (SELECT COALESCE(SUM(loc.length), 0) FROM page_locations loc WHERE loc.tier = g.tier) AS live_bytes
    FROM segments g
    GROUP BY g.tier
    """,
    """
    CREATE VIEW version_summary AS
    SELECT s.session_id, t.tenant_id, v.id AS version_id, v.parent_id, v.num_tokens, v.label, v.pinned,
           CASE WHEN s.head_id = v.id THEN 1 ELSE 0 END AS is_head, v.created_at
    FROM versions v
    JOIN sessions s ON s.id = v.session_ref
    JOIN tenants t ON t.id = s.tenant_ref
    """,
]
