"""Crypto-shredding and erasure: data keys, store facts, erasure jobs, audit receipts; tier totals.

From this revision every namespace has a data key (wrapped under the master key), pages and
token histories are sealed under it, and page ids are hashed with a key derived from it.
Rows written by revision 0001 stay readable (``versions.sealed`` false, page records with
flags 0); their page ids no longer match new prompts, so they age out of the cache.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("versions", sa.Column("sealed", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_table(
        "user_keys",
        sa.Column("user_ref", sa.Integer, sa.ForeignKey("users.id"), primary_key=True),
        sa.Column("wrapped", sa.LargeBinary, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "store_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "erasures",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("tenant_id", sa.String(256), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("user_ref", sa.Integer, nullable=True),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("plan", sa.Text, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
    )
    totals = op.create_table(
        "tier_totals",
        sa.Column("tier", sa.String(16), primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("num_segments", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(totals, [{"tier": "disk", "bytes": 0, "num_segments": 0}])
    op.execute(
        "UPDATE tier_totals SET bytes = (SELECT COALESCE(SUM(size), 0) FROM segments WHERE tier = 'disk'), "
        "num_segments = (SELECT COUNT(*) FROM segments WHERE tier = 'disk') WHERE tier = 'disk'"
    )
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(256), nullable=False),
        sa.Column("user_id", sa.String(256), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("receipt", sa.Text, nullable=False),
    )


def downgrade() -> None:
    for table in ("audit", "tier_totals", "erasures", "store_meta", "user_keys"):
        op.drop_table(table)
    op.execute("ALTER TABLE versions DROP COLUMN sealed")
