"""Nodes: several store folders (one per host) share one catalog.

* ``nodes`` registers each store folder sharing the catalog: its random folder id (the
  folder's ``store-id`` file) and its name, ``node_id``.
* ``segments.node_ref``: the node whose folder holds the page file (no other node reads it).
* ``tier_totals`` counts bytes per tier *and node* (each node's disk has its own capacity).

An existing single-folder store becomes node 1, named after its folder id (the first 16 hex
digits of ``store_meta.store_id``), and keeps every segment.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    node_table = op.create_table(
        "nodes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("node_id", sa.String(64), nullable=False, unique=True),
        sa.Column("folder_id", sa.LargeBinary(16), nullable=False, unique=True),
        sa.Column("created_at", TS, nullable=False),
        sqlite_autoincrement=True,
    )
    folder = bind.execute(sa.text("SELECT value FROM store_meta WHERE key = 'store_id'")).scalar()
    if folder is not None:
        op.bulk_insert(
            node_table,
            [
                {
                    "id": 1,
                    "node_id": bytes(folder).hex()[:16],
                    "folder_id": bytes(folder),
                    "created_at": dt.datetime.now(dt.UTC),
                }
            ],
        )
        if not sqlite:
            op.execute("SELECT setval(pg_get_serial_sequence('nodes', 'id'), 1)")
    views = _views_aside(bind)
    with op.batch_alter_table(
        "segments", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.add_column(sa.Column("node_ref", sa.Integer, nullable=True))
    op.execute("UPDATE segments SET node_ref = 1")
    with op.batch_alter_table(
        "segments", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.alter_column("node_ref", existing_type=sa.Integer, nullable=False)
        batch.create_foreign_key("fk_segments_node_ref_nodes", "nodes", ["node_ref"], ["id"])
        batch.create_index("ix_segments_node_ref", ["node_ref"])
    for sql in views:
        op.execute(sql)
    op.drop_table("tier_totals")
    op.create_table(
        "tier_totals",
        sa.Column("tier", sa.String(16), primary_key=True),
        sa.Column("node_ref", sa.Integer, primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("num_segments", sa.BigInteger, nullable=False),
    )
    op.execute(
        "INSERT INTO tier_totals (tier, node_ref, bytes, num_segments) "
        "SELECT tier, node_ref, SUM(size), COUNT(*) FROM segments GROUP BY tier, node_ref"
    )


def downgrade() -> None:
    op.drop_table("tier_totals")
    op.create_table(
        "tier_totals",
        sa.Column("tier", sa.String(16), primary_key=True),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("num_segments", sa.BigInteger, nullable=False),
    )
    op.execute(
        "INSERT INTO tier_totals (tier, bytes, num_segments) "
        "SELECT tier, SUM(size), COUNT(*) FROM segments GROUP BY tier"
    )
    views = _views_aside(op.get_bind())
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table(
        "segments", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_index("ix_segments_node_ref")
        if not sqlite:
            batch.drop_constraint("fk_segments_node_ref_nodes", type_="foreignkey")
        batch.drop_column("node_ref")
    for sql in views:
        op.execute(sql)
    op.drop_table("nodes")


def _views_aside(bind: sa.engine.Connection) -> list[str]:
    """SQLite refuses to rebuild a table a view reads: drop the views, return their SQL to
    create them again, unchanged (nothing to do on PostgreSQL)."""
    if bind.dialect.name != "sqlite":
        return []
    views = bind.execute(sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view'")).all()
    for name, _ in views:
        op.execute(f"DROP VIEW {name}")
    return [sql for _, sql in views]
