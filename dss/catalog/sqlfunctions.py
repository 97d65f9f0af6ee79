"""The SQL functions ``sql()`` may call on a SQLite catalog: an allow-list, everything else refused.

SQLite's authorizer reports each function a statement calls (``SQLITE_FUNCTION``, by its
registered lower-case name) while the statement is prepared, views included; the reader's
authorizer (:mod:`dss.catalog.readonly`) allows a call only when the name is in
:data:`SQLITE_FUNCTIONS`. The list holds SQLite's core scalar, aggregate, window, date and
time, math and JSON functions: what the catalog's views and an operator's questions need.
It leaves out on purpose what reads or changes the process rather than the data
(``load_extension``, ``fts3_tokenizer``, which hands out and accepts raw pointers), the
full-text, R-tree and geopoly helpers (they serve virtual tables dss has none of), and
facts about the connection or the build (``changes``, ``last_insert_rowid``,
``total_changes``, ``sqlite_compileoption_*``, ``sqlite_log``, ``sqlite_offset``,
``subtype``). A name listed that this SQLite lacks is simply unknown to it.

What a listed function may cost is bounded elsewhere: every value by the reader
connection's length limit, the whole statement by the time limit (see :mod:`dss.catalog.readonly`).
PostgreSQL needs no list here: there ``sql()`` runs as a role that PostgreSQL itself keeps
from the privileged functions.
"""

from __future__ import annotations

import math
import re
import sqlite3
from typing import Any

_SCALAR = frozenset(
    {
        "abs",
        "char",
        "coalesce",
        "concat",
        "concat_ws",
        "format",
        "glob",
        "hex",
        "if",
        "ifnull",
        "iif",
        "instr",
        "length",
        "like",
        "likelihood",
        "likely",
        "lower",
        "ltrim",
        "max",
        "min",
        "nullif",
        "octet_length",
        "printf",
        "quote",
        "random",
        "randomblob",
        "replace",
        "round",
        "rtrim",
        "sign",
        "soundex",
        "sqlite_source_id",
        "sqlite_version",
        "substr",
        "substring",
        "trim",
        "typeof",
        "unhex",
        "unicode",
        "unistr",
        "unistr_quote",
        "unlikely",
        "upper",
        "zeroblob",
    }
)
_AGGREGATE = frozenset(
    {
        "avg",
        "count",
        "group_concat",
        "max",
        "median",
        "min",
        "percentile",
        "percentile_cont",
        "percentile_disc",
        "string_agg",
        "sum",
        "total",
    }
)
_WINDOW = frozenset(
    {
        "cume_dist",
        "dense_rank",
        "first_value",
        "lag",
        "last_value",
        "lead",
        "nth_value",
        "ntile",
        "percent_rank",
        "rank",
        "row_number",
    }
)
_DATE_TIME = frozenset(
    {
        "current_date",
        "current_time",
        "current_timestamp",
        "date",
        "datetime",
        "julianday",
        "strftime",
        "time",
        "timediff",
        "unixepoch",
    }
)
_MATH = frozenset(
    {
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "ceil",
        "ceiling",
        "cos",
        "cosh",
        "degrees",
        "exp",
        "floor",
        "ln",
        "log",
        "log10",
        "log2",
        "mod",
        "pi",
        "pow",
        "power",
        "radians",
        "sin",
        "sinh",
        "sqrt",
        "tan",
        "tanh",
        "trunc",
    }
)
_JSON = frozenset(
    {
        "->",
        "->>",
        "json",
        "json_array",
        "json_array_length",
        "json_error_position",
        "json_extract",
        "json_group_array",
        "json_group_object",
        "json_insert",
        "json_object",
        "json_patch",
        "json_pretty",
        "json_quote",
        "json_remove",
        "json_replace",
        "json_set",
        "json_type",
        "json_valid",
        "jsonb",
        "jsonb_array",
        "jsonb_extract",
        "jsonb_group_array",
        "jsonb_group_object",
        "jsonb_insert",
        "jsonb_object",
        "jsonb_patch",
        "jsonb_remove",
        "jsonb_replace",
        "jsonb_set",
    }
)

SQLITE_FUNCTIONS: frozenset[str] = _SCALAR | _AGGREGATE | _WINDOW | _DATE_TIME | _MATH | _JSON
"""Every function ``sql()`` may call on SQLite, by its lower-case name (operators such as
``LIKE``, ``GLOB`` and ``->`` are calls of the functions of those names)."""


def is_allowed(name: str) -> bool:
    """Whether ``sql()`` may call the SQLite function ``name`` (case-insensitive). Pure."""
    return name.lower() in SQLITE_FUNCTIONS


class BoundedPrintf:
    """``printf()`` and ``format()`` for a reader connection: SQLite's own, after a check that no
    width or precision passes ``max_bytes``.

    SQLite builds ``printf('%.*c', N, 'x')`` one character at a time, past its length limit and
    inside one step of the statement, where neither the progress handler nor an interrupt can stop
    it (seconds of CPU for N near a billion). So a call whose format has a number, or whose
    format has ``*`` and whose arguments have a number (as SQLite would read it), larger than
    ``max_bytes`` is refused: the call raises ``ValueError`` (SQLite fails the statement) and
    :attr:`refusal` says why. The check is conservative. Other calls run SQLite's ``printf`` on a private in-memory connection
    with the same length limit. Not thread-safe: one per reader connection; :meth:`close` it.
    """

    __slots__ = ("_conn", "max_bytes", "refusal")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.refusal: str | None = None
        self._conn: sqlite3.Connection | None = None

    def __call__(self, *args: Any) -> Any:
        if not args or not isinstance(args[0], str):
            return self._delegate(args)
        numbers = [int(n) for n in _DIGITS.findall(args[0])]
        if "*" in args[0]:
            numbers += [abs(n) for n in map(_as_int, args[1:]) if n is not None]
        if any(n > self.max_bytes for n in numbers):
            self.refusal = (
                f"a printf() width or precision is larger than {self.max_bytes >> 20} MiB, "
                "the most sql() allows for one string"
            )
            raise ValueError(self.refusal)
        return self._delegate(args)

    def _delegate(self, args: tuple[Any, ...]) -> Any:
        if self._conn is None:
            self._conn = sqlite3.connect(":memory:")
            self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_bytes)
        marks = ", ".join("?" * len(args))
        return self._conn.execute(f"SELECT printf({marks})", args).fetchone()[0]

    def close(self) -> None:
        """Close the private connection (if one was opened). Idempotent."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


_DIGITS = re.compile(r"\d+")


def _as_int(value: Any) -> int | None:
    """``value`` as SQLite's printf reads a ``*`` argument (``None`` where it reads no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) else None
