"""The placement policy in SQL: ``tier_policy`` (each process's tiers, watermarks, quotas and
what the policy did) and the view ``tier_quota_usage`` (each user's bytes per durable tier next
to the quotas).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

COUNTERS = ("hits", "misses", "promotions", "demotions", "evictions", "moved_bytes", "prefetch_hits", "prefetch_wasted")

QUOTA_VIEW = """
CREATE VIEW tier_quota_usage AS
SELECT t.tenant_id, u.user_id, g.tier,
       SUM(g.size) AS bytes,
       (SELECT p.user_quota_bytes FROM tier_policy p WHERE p.tier = g.tier
         ORDER BY p.updated_at DESC LIMIT 1) AS user_quota_bytes,
       (SELECT SUM(g2.size) FROM segments g2 JOIN users u2 ON u2.id = g2.user_ref
         WHERE u2.tenant_ref = u.tenant_ref AND g2.tier = g.tier) AS tenant_bytes,
       (SELECT p.tenant_quota_bytes FROM tier_policy p WHERE p.tier = g.tier
         ORDER BY p.updated_at DESC LIMIT 1) AS tenant_quota_bytes
FROM segments g
JOIN users u ON u.id = g.user_ref
JOIN tenants t ON t.id = u.tenant_ref
GROUP BY t.tenant_id, u.user_id, u.tenant_ref, g.tier
"""


def upgrade() -> None:
    op.create_table(
        "tier_policy",
        sa.Column("process", sa.String(128), primary_key=True),
        sa.Column("tier", sa.String(16), primary_key=True),
        sa.Column("policy", sa.String(16), nullable=False),
        sa.Column("capacity_bytes", sa.BigInteger, nullable=False),
        sa.Column("used_bytes", sa.BigInteger, nullable=False),
        sa.Column("high_watermark_bytes", sa.BigInteger, nullable=False),
        sa.Column("low_watermark_bytes", sa.BigInteger, nullable=False),
        sa.Column("user_quota_bytes", sa.BigInteger, nullable=False),
        sa.Column("tenant_quota_bytes", sa.BigInteger, nullable=False),
        *(sa.Column(name, sa.BigInteger, nullable=False) for name in COUNTERS),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.execute(QUOTA_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS tier_quota_usage")
    op.drop_table("tier_policy")
