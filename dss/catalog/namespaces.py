"""Catalog rows of namespaces and store facts: tenants, users (one row per namespace, named
``user_ref`` everywhere), layouts, wrapped data keys and ``store_meta``.

Functions here run on an open connection and neither begin nor commit.
"""

from __future__ import annotations

import json

from sqlalchemy import and_, delete, insert, select, update
from sqlalchemy.engine import Connection

from dss.catalog.database import insert_id, now
from dss.catalog.schema import erasures, layouts, store_meta, tenants, user_keys, users
from dss.core.errors import CatalogCorrupt, InvalidLayout
from dss.core.types import Layout


def ensure_tenant(conn: Connection, tenant_id: str) -> int:
    ref = conn.execute(select(tenants.c.id).where(tenants.c.tenant_id == tenant_id)).scalar()
    if ref is None:
        ref = insert_id(conn, insert(tenants).values(tenant_id=tenant_id, created_at=now()))
    return int(ref)


def ensure_user(conn: Connection, tenant_ref: int, user_id: str) -> int:
    """The namespace row of ``user_id`` in the tenant, made if absent."""
    where = and_(users.c.tenant_ref == tenant_ref, users.c.user_id == user_id)
    ref = conn.execute(select(users.c.id).where(where)).scalar()
    if ref is None:
        ref = insert_id(conn, insert(users).values(tenant_ref=tenant_ref, user_id=user_id, created_at=now()))
    return int(ref)


def find_user(conn: Connection, tenant_id: str, user_id: str) -> int | None:
    """The namespace row of ``(tenant_id, user_id)``, or ``None``."""
    return conn.execute(
        select(users.c.id)
        .join(tenants, tenants.c.id == users.c.tenant_ref)
        .where(tenants.c.tenant_id == tenant_id, users.c.user_id == user_id)
    ).scalar()


def tenant_of(conn: Connection, user_ref: int) -> str | None:
    return conn.execute(
        select(tenants.c.tenant_id).join(users, users.c.tenant_ref == tenants.c.id).where(users.c.id == user_ref)
    ).scalar()


def ensure_layout(conn: Connection, layout: Layout) -> int:
    ref = conn.execute(select(layouts.c.id).where(layouts.c.digest == layout.digest)).scalar()
    if ref is None:
        ref = insert_id(
            conn,
            insert(layouts).values(
                digest=layout.digest,
                name=layout.name,
                page_tokens=layout.page_tokens,
                page_bytes=layout.page_bytes,
                spec=json.dumps(layout.to_dict(), sort_keys=True),
            ),
        )
    return int(ref)


def stored_layout(layout_ref: int, spec: str) -> Layout:
    """The layout of a ``layouts`` row; raises ``CatalogCorrupt`` if the row does not decode."""
    try:
        return Layout.from_dict(json.loads(spec))
    except (ValueError, TypeError, InvalidLayout) as exc:
        raise CatalogCorrupt(
            f"layout {layout_ref} in the catalog does not decode ({exc}): the row is damaged"
        ) from None


def all_layouts(conn: Connection) -> list[tuple[int, str]]:
    """``(layout_ref, spec)`` of every layout row."""
    return [(r[0], r[1]) for r in conn.execute(select(layouts.c.id, layouts.c.spec))]


# -- data keys and store facts ----------------------------------------------------------------


def wrapped_key(conn: Connection, user_ref: int) -> bytes | None:
    value = conn.execute(select(user_keys.c.wrapped).where(user_keys.c.user_ref == user_ref)).scalar()
    return bytes(value) if value is not None else None


def is_live(conn: Connection, tenant_ref: int, user_ref: int) -> bool:
    """Whether namespace ``user_ref`` of tenant ``tenant_ref`` exists with its data key and no
    erasure open (a session may be made in it)."""
    return (
        conn.execute(
            select(users.c.id)
            .join(user_keys, user_keys.c.user_ref == users.c.id)
            .where(
                users.c.id == user_ref,
                users.c.tenant_ref == tenant_ref,
                ~select(erasures.c.id)
                .where(erasures.c.user_ref == users.c.id, erasures.c.finished_at.is_(None))
                .exists(),
            )
        ).first()
        is not None
    )


def insert_key(conn: Connection, user_ref: int, wrapped: bytes) -> None:
    conn.execute(insert(user_keys).values(user_ref=user_ref, wrapped=wrapped, created_at=now()))


def destroy_key(conn: Connection, user_ref: int) -> bool:
    """Overwrite, then delete, a namespace's wrapped key; return whether there was one."""
    conn.execute(update(user_keys).where(user_keys.c.user_ref == user_ref).values(wrapped=b"\0" * 60))
    return bool(conn.execute(delete(user_keys).where(user_keys.c.user_ref == user_ref)).rowcount)


def users_without_key(conn: Connection) -> list[int]:
    """Namespaces that have no data key and no erasure under way (rows from before revision 0002)."""
    erasing = select(erasures.c.user_ref).where(erasures.c.user_ref.is_not(None))
    return [
        r[0]
        for r in conn.execute(
            select(users.c.id).where(
                ~select(user_keys.c.user_ref).where(user_keys.c.user_ref == users.c.id).exists(),
                users.c.id.not_in(erasing),
            )
        )
    ]


def meta(conn: Connection, key: str) -> bytes | None:
    value = conn.execute(select(store_meta.c.value).where(store_meta.c.key == key)).scalar()
    return bytes(value) if value is not None else None


def set_meta(conn: Connection, key: str, value: bytes) -> None:
    conn.execute(insert(store_meta).values(key=key, value=value))
