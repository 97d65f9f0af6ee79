"""Alembic environment: runs on the connection dss hands over, or on ``sqlalchemy.url``."""

from alembic import context
from sqlalchemy import create_engine

from dss.catalog.schema import Base

config = context.config
connection = config.attributes.get("connection")
progress = config.attributes.get("progress")


def applied(ctx, step, heads, run_args) -> None:
    """Tell dss's caller (``dss db upgrade``'s progress bar) each revision as it is applied."""
    if progress is not None:
        progress(step.up_revision_id)


def run(conn) -> None:
    context.configure(connection=conn, target_metadata=Base.metadata, render_as_batch=True, on_version_apply=applied)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    run(connection)
else:
    with create_engine(config.get_main_option("sqlalchemy.url")).begin() as conn:
        run(conn)
