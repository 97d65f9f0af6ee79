"""Tables and JSON as every ``dss`` command prints them: one row a line under a header row, or
one JSON list with ``--json`` (datetimes as ISO text, bytes as hex, ``None`` as ``-`` in tables)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

import click


def emit(rows: Sequence[dict[str, Any]], as_json: bool, columns: Sequence[str] | None = None) -> None:
    if as_json:
        click.echo(json.dumps(list(rows), default=_json_default, indent=None))
        return
    columns = list(columns or (rows[0].keys() if rows else []))
    if not columns:
        click.echo("(none)")
        return
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"cannot encode {type(value).__name__}")
