"""Alembic migrations of the dss catalog (installed as ``dss_migrations``)."""
