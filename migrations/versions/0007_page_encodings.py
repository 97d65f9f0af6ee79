"""Each stored copy of a page records its encoding; the view ``tier_encodings`` sums them.

``page_locations.encoding`` is the precision of the copy at that location (``exact``: the
engine's bytes; ``int8``, ``fp8``, ``k8v4``: encoded by the tier's precision setting, lossy).
Copies stored before this revision are exact. ``tier_encodings`` gives, per tier and
encoding, the pages and the bytes their copies take.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

VIEW = """
CREATE VIEW tier_encodings AS
SELECT loc.tier, loc.encoding,
       COUNT(*) AS num_pages,
       COALESCE(SUM(loc.length), 0) AS bytes
FROM page_locations loc
GROUP BY loc.tier, loc.encoding
"""


def upgrade() -> None:
    op.add_column("page_locations", sa.Column("encoding", sa.String(16), nullable=False, server_default="exact"))
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS tier_encodings")
    op.drop_column("page_locations", "encoding")  # SQLite 3.35+ drops a column in place
