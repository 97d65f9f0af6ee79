"""Session ids and version labels sealed; surrogate ids never handed out twice; tables renamed.

* ``sessions.session_id`` (clear) becomes ``session_key`` (a keyed hash of the id, which the
  catalog finds sessions by) and ``name`` (the id sealed under the owner's data key);
  ``versions.label`` becomes the label sealed the same way. An erasure then leaves neither
  readable anywhere, not even in a database's dead rows.
* Erasure jobs keep no page id and no file name: a sampled id becomes a needle (a prefix
  and a SHA-256, see :mod:`dss.core.rawscan`), and the file names of jobs past deleting their
  files become SHA-256 digests.
* ``page_refs`` becomes ``session_pages`` (which pages a session holds), with ``pinned``
  (a pinned version holds the page: eviction never drops it; set here for every page of a
  session that has a pinned version, the next pin or unpin makes it exact), and ``changes``
  becomes ``feed`` (the change feed).
* On SQLite every table with a surrogate integer key is rebuilt with ``AUTOINCREMENT`` and
  its counter set above any id the table may ever have handed out (PostgreSQL's sequences
  never go back already).

Sealing existing rows needs the master key: ``dss db upgrade`` passes it in. Token histories,
bound to their session's row number until now, are bound to its key instead (the binding
strings are spelled out here, frozen with this revision). The views name
sessions by ``session_key`` (hex) from now on.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import hashlib
import json

import sqlalchemy as sa
from alembic import context, op

from dss.core.crypto import Sealer, master_check, session_key, session_lookup_key, unwrap
from dss.core.errors import ConfigError
from dss.core.rawscan import needle

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NEVER_REUSED = (
    "tenants",
    "users",
    "layouts",
    "sessions",
    "versions",
    "segments",
    "quarantine",
    "feed",
    "erasures",
    "audit",
)
"""Tables whose ids must never be handed out twice."""


def upgrade() -> None:
    conn = op.get_bind()
    sqlite = conn.dialect.name == "sqlite"
    for name in VIEW_NAMES:
        op.execute(f"DROP VIEW IF EXISTS {name}")
    _rename_tables()
    with op.batch_alter_table("sessions", recreate="always" if sqlite else "auto") as batch:
        batch.add_column(sa.Column("session_key", sa.LargeBinary(16), nullable=True))
        batch.add_column(sa.Column("name", sa.LargeBinary, nullable=True))
    with op.batch_alter_table("versions", recreate="always" if sqlite else "auto") as batch:
        batch.add_column(sa.Column("sealed_label", sa.LargeBinary, nullable=True))
    _seal_existing(conn)
    _scrub_erasure_plans(conn)
    with op.batch_alter_table(
        "sessions", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_column("session_id")
        batch.alter_column("session_key", nullable=False)
        batch.alter_column("name", nullable=False)
        batch.create_unique_constraint("uq_sessions_tenant_ref_session_key", ["tenant_ref", "session_key"])
    with op.batch_alter_table(
        "versions", recreate="always" if sqlite else "auto", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_column("label")
        batch.alter_column("sealed_label", new_column_name="label")
    if sqlite:
        for table in NEVER_REUSED:
            if table not in ("sessions", "versions"):
                with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": True}):
                    pass
        _raise_counters(conn)
    for statement in views(sqlite):
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("revision 0003 seals session ids and labels; it cannot be undone")


def _rename_tables() -> None:
    op.rename_table("page_refs", "session_pages")
    op.drop_index("ix_page_refs_page_id", table_name="session_pages")
    op.create_index("ix_session_pages_page_id", "session_pages", ["page_id"])
    op.add_column("session_pages", sa.Column("pinned", sa.Boolean, nullable=False, server_default=sa.false()))
    op.execute(
        "UPDATE session_pages SET pinned = TRUE WHERE session_ref IN (SELECT session_ref FROM versions WHERE pinned)"
    )
    op.rename_table("changes", "feed")
    op.drop_index("ix_changes_seq", table_name="feed")
    op.create_index("ix_feed_seq", "feed", ["seq"])


def _seal_existing(conn: sa.Connection) -> None:
    """Give every session its key and sealed name, seal every label, and bind every sealed
    token history to its session's key instead of its row number, under the master key."""
    rows = conn.execute(
        sa.text(
            "SELECT v.id, s.id, v.label, v.suffix, v.sealed FROM versions v JOIN sessions s ON s.id = v.session_ref "
            "WHERE v.label IS NOT NULL OR v.sealed"
        )
    ).all()
    sessions = conn.execute(
        sa.text(
            "SELECT s.id, s.session_id, s.user_ref, k.wrapped FROM sessions s "
            "LEFT JOIN user_keys k ON k.user_ref = s.user_ref"
        )
    ).all()
    if not sessions:
        return
    master = context.config.attributes.get("master_key")
    check = conn.execute(sa.text("SELECT value FROM store_meta WHERE key = 'master_check'")).scalar()
    if master is None or check is None or bytes(check) != master_check(master):
        raise ConfigError(
            "upgrading this catalog to revision 0003 seals its session ids and labels and needs the "
            "store's master key: run `dss db upgrade` with the store's configuration"
        )
    lookup = session_lookup_key(master)
    keys: dict[int, tuple[bytes, Sealer | None]] = {}
    for ref, session_id, user_ref, wrapped in sessions:
        key = session_key(lookup, session_id)
        sealer = keys.setdefault(ref, (key, _sealer(master, user_ref, wrapped)))[1]
        # a user under erasure has no key: the erasure deletes the row, so any unreadable name will do
        name = sealer.seal(session_id.encode(), b"dss-session-id v1\0" + key) if sealer else b""
        conn.execute(
            sa.text("UPDATE sessions SET session_key = :key, name = :name WHERE id = :ref"),
            {"key": key, "name": name, "ref": ref},
        )
    for version_id, ref, label, suffix, sealed in rows:
        key, sealer = keys[ref]
        if sealer is None:
            continue
        values = {"id": version_id, "suffix": bytes(suffix), "label": None}
        if sealed:
            plain = sealer.open(bytes(suffix), b"dss-tokens v1\0session:%d" % ref)
            values["suffix"] = sealer.seal(plain, b"dss-tokens v2\0" + key)
        if label is not None:
            values["label"] = sealer.seal(label.encode(), b"dss-label v2\0" + key)
        conn.execute(sa.text("UPDATE versions SET suffix = :suffix, sealed_label = :label WHERE id = :id"), values)


def _scrub_erasure_plans(conn: sa.Connection) -> None:
    """Replace the page ids and file names older erasure jobs kept by needles and digests."""
    for job_id, state, text in conn.execute(sa.text("SELECT id, state, plan FROM erasures")).all():
        plan = json.loads(text)
        removed = plan.get("removed")
        if not removed:
            continue
        removed["sample"] = [needle(bytes.fromhex(s)) if isinstance(s, str) else s for s in removed.get("sample", [])]
        if state not in ("planned", "key_destroyed", "catalog_purged") and "files" in removed:
            removed["file_digests"] = sorted(hashlib.sha256(name.encode()).hexdigest() for name in removed.pop("files"))
        conn.execute(
            sa.text("UPDATE erasures SET plan = :plan WHERE id = :id"), {"plan": json.dumps(plan), "id": job_id}
        )


def _sealer(master: bytes, user_ref: int, wrapped: bytes | None) -> Sealer | None:
    owner = b"user:%d" % user_ref
    return Sealer(unwrap(master, bytes(wrapped), owner)) if wrapped is not None else None


def _raise_counters(conn: sa.Connection) -> None:
    """Set each table's AUTOINCREMENT counter above any id it may have handed out before.

    Without AUTOINCREMENT SQLite gave a new row the largest id present plus one, so no id
    ever exceeded the number of rows ever inserted; each write transaction (counted by
    ``catalog_seq``) inserts at most one row into these tables, except segments, feed
    and quarantine, whose ids nothing outside the catalog names.
    """
    seq = conn.execute(sa.text("SELECT seq FROM catalog_seq WHERE id = 1")).scalar() or 0
    for table in NEVER_REUSED:
        top = conn.execute(sa.text(f"SELECT COALESCE(MAX(id), 0) FROM {table}")).scalar()
        floor = max(top, seq)
        conn.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = :t"), {"t": table})
        conn.execute(sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :s)"), {"t": table, "s": floor})


VIEW_NAMES = ("session_summary", "user_summary", "tier_usage", "version_summary")


def _tier_bytes(owner: str, tier: str) -> str:
    return (
        f"(SELECT COALESCE(SUM(loc.length), 0) FROM session_pages r JOIN page_locations loc "
        f"ON loc.page_id = r.page_id AND loc.tier = '{tier}' WHERE r.session_ref = {owner})"
    )


def views(sqlite: bool) -> list[str]:
    """The operators' views; sessions are named by ``session_key`` in lowercase hex."""
    key = "lower(hex(s.session_key))" if sqlite else "encode(s.session_key, 'hex')"
    return [
        f"""
        CREATE VIEW session_summary AS
        SELECT {key} AS session_key, t.tenant_id, u.user_id, l.name AS layout,
               (SELECT COUNT(*) FROM versions v WHERE v.session_ref = s.id) AS num_versions,
               s.head_id AS head_version,
               (SELECT v.num_tokens FROM versions v WHERE v.id = s.head_id) AS head_tokens,
               (SELECT COUNT(*) FROM session_pages r WHERE r.session_ref = s.id) AS num_pages,
               (SELECT COALESCE(SUM(p.size), 0) FROM session_pages r JOIN pages p ON p.page_id = r.page_id
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
        f"""
        CREATE VIEW version_summary AS
        SELECT {key} AS session_key, t.tenant_id, v.id AS version_id, v.parent_id, v.num_tokens,
               v.label IS NOT NULL AS has_label, v.pinned,
               CASE WHEN s.head_id = v.id THEN 1 ELSE 0 END AS is_head, v.created_at
        FROM versions v
        JOIN sessions s ON s.id = v.session_ref
        JOIN tenants t ON t.id = s.tenant_ref
        """,
    ]
