"""Catalog rows of nodes: the store folders that share one catalog (a fleet).

Functions here run on an open connection and neither begin nor commit.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection

from dss.catalog.database import insert_id, now
from dss.catalog.schema import nodes


class NodeRecord(NamedTuple):
    ref: int
    node_id: str
    folder_id: bytes


def all_nodes(conn: Connection) -> list[NodeRecord]:
    """Every node, oldest first."""
    return [
        NodeRecord(r[0], r[1], bytes(r[2]))
        for r in conn.execute(select(nodes.c.id, nodes.c.node_id, nodes.c.folder_id).order_by(nodes.c.id))
    ]


def insert_node(conn: Connection, node_id: str, folder_id: bytes) -> int:
    """Register a folder as node ``node_id``; return its row number."""
    return insert_id(conn, insert(nodes).values(node_id=node_id, folder_id=folder_id, created_at=now()))
