"""The ``tier_usage`` view shows dead bytes: what compaction would give back.

Segment files are never changed once written, so pages dropped from a segment leave dead
records behind until compaction rewrites the segment. ``tier_usage`` gains ``dead_bytes``
(bytes of segment files that no page refers to: records of dropped pages and headers) and
a segment counts as sparse by the store's ``compact_dead_share``, a setting, not a column.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

OLD = """
CREATE VIEW tier_usage AS
SELECT g.tier,
       COUNT(*) AS num_segments,
       COALESCE(SUM(g.size), 0) AS bytes,
       (SELECT COUNT(*) FROM page_locations loc WHERE loc.tier = g.tier) AS num_pages,
       (SELECT COALESCE(SUM(loc.length), 0) FROM page_locations loc WHERE loc.tier = g.tier) AS live_bytes
FROM segments g
GROUP BY g.tier
"""

NEW = """
CREATE VIEW tier_usage AS
SELECT g.tier,
       COUNT(*) AS num_segments,
       COALESCE(SUM(g.size), 0) AS bytes,
       (SELECT COUNT(*) FROM page_locations loc WHERE loc.tier = g.tier) AS num_pages,
       (SELECT COALESCE(SUM(loc.length), 0) FROM page_locations loc WHERE loc.tier = g.tier) AS live_bytes,
       COALESCE(SUM(g.size), 0)
         - (SELECT COALESCE(SUM(loc.length), 0) FROM page_locations loc WHERE loc.tier = g.tier) AS dead_bytes
FROM segments g
GROUP BY g.tier
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS tier_usage")
    op.execute(NEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS tier_usage")
    op.execute(OLD)
