"""Core result types on the wire: response models derived from their fields, and their JSON
both ways.

A core result — a ``NamedTuple`` or a dataclass such as :class:`~dss.core.types.Session`,
:class:`~dss.core.types.Version`, :class:`~dss.sessions.resume.Candidate`,
:class:`~dss.approx.explanation.Explanation` or :class:`~dss.writes.compaction.Compaction` — is
the one place its fields are written. :func:`model_of` derives from the type's annotations
the pydantic model the HTTP API documents (a field's attribute docstring is its description);
:func:`dump` turns a value into that model's data and :func:`load` makes the value again
from it, on the client's side: ``load(T, dump(value)) == value``.

On the wire a :class:`~dss.core.types.Layout` is an object (:class:`LayoutModel`), a page id
lowercase hex, a time ISO 8601 text, a tuple a list, and a nested result an object of its own
model. The results with a wire format of their own (a resume's answer, saved pages, rates, SQL
rows) have ``*_out`` and ``*_from`` functions, inverse to each other.

Binary data travels as standard base64 (page payloads) or lowercase hex (page ids). SQL
result cells that JSON cannot carry exactly are tagged: ``{"type": "bytes", "value":
<base64>}``, ``{"type": "float", "value": "nan" | "inf" | "-inf"}``, ``{"type": "datetime" |
"date" | "time" | "decimal", "value": <ISO text>}``, ``{"type": "json", "value": <JSON text>}``
(PostgreSQL json and arrays), and ``{"type": "text", ...}`` for anything else.
"""

from __future__ import annotations

import ast
import base64
import binascii
import dataclasses
import datetime as dt
import decimal
import functools
import inspect
import json
import math
import textwrap
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model, model_validator

from dss.core.errors import InvalidPage
from dss.core.types import Layout, PageId, PageRef, SavedPages, SqlResult, VersionId
from dss.sessions.resume import Candidate, Rates, ResumeResult
from dss.writes.compaction import Compaction

PageIdHex = Annotated[str, Field(pattern=r"^([0-9a-fA-F]{2}){0,64}$", description="A page id, hex.")]


class LayoutModel(BaseModel):
    """A page layout: ``name``, ``page_tokens``, ``page_bytes`` and free-form scalar fields."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    name: str
    page_tokens: StrictInt
    page_bytes: StrictInt


UNCHECKED = frozenset({"tokens", "pages", "page_ids"})
"""Request fields that hold no free text (validated by type, pattern or base64 instead)."""


def check_unicode(data: Any) -> None:
    """Raise ``ValueError`` for a string (key or value) that UTF-8 cannot encode (a lone surrogate,
    which JSON's ``\\ud800`` escapes can carry): no catalog could store it, no response could carry it."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    elif isinstance(data, dict):
        for key, value in data.items():
            check_unicode(key)
            if key not in UNCHECKED:
                check_unicode(value)
    elif isinstance(data, list):
        for value in data:
            check_unicode(value)


def is_result(tp: Any) -> bool:
    """Whether ``tp`` is a result type: a ``NamedTuple`` or a dataclass."""
    return isinstance(tp, type) and (dataclasses.is_dataclass(tp) or (issubclass(tp, tuple) and hasattr(tp, "_fields")))


@functools.cache
def fields_of(tp: type) -> dict[str, Any]:
    """A result type's fields and their annotations, in order (resolved once per type: every
    value a response carries goes through here)."""
    hints = typing.get_type_hints(tp)
    names = [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else list(tp._fields)  # type: ignore[attr-defined]
    return {name: hints[name] for name in names}


@functools.cache
def model_of(tp: type, name: str | None = None) -> type[BaseModel]:
    """The response model of a result type (named ``name``, else the type's name and ``Out``):
    every field required, each described by its attribute docstring where it has one."""
    notes = _attribute_docs(tp)
    definitions: dict[str, Any] = {
        field: (_wire(hint), Field(..., description=notes.get(field))) for field, hint in fields_of(tp).items()
    }
    return create_model(name or f"{tp.__name__}Out", __doc__=inspect.getdoc(tp), **definitions)


def list_of(model: type[BaseModel]) -> Any:
    """``list[model]``, for a model made at run time (where a type checker wants a class)."""
    return list[model]  # type: ignore[valid-type]


def _wire(hint: Any) -> Any:
    """The type a field of annotation ``hint`` has on the wire."""
    if hint is Layout:
        return LayoutModel
    if hint is PageId:
        return PageIdHex
    if is_result(hint):
        return model_of(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return Union[tuple(_wire(arg) for arg in args)]  # noqa: UP007  (built from a tuple)
    if origin is not None and args:
        return origin[tuple(_wire(arg) for arg in args)]
    return hint


def _attribute_docs(tp: type) -> dict[str, str]:
    """``field -> docstring`` of the fields a string literal follows in the class body."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(tp))).body[0]
    except (OSError, TypeError, IndexError):
        return {}
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def dump(value: Any) -> Any:
    """A value as the data of its response model (times stay ``datetime``: the framework writes them)."""
    if isinstance(value, Layout):
        return value.to_dict()
    kind: type = value.__class__
    if is_result(kind):
        return {field: dump(getattr(value, field)) for field in fields_of(kind)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [dump(item) for item in value]
    if isinstance(value, dict):
        return {key: dump(item) for key, item in value.items()}
    return value


def load(hint: Any, data: Any) -> Any:
    """The value of annotation ``hint`` that :func:`dump` wrote as ``data`` (the client's side)."""
    if data is None:
        return None
    if hint is Layout:
        return Layout.from_dict(data)
    if hint is PageId:
        return PageId(bytes.fromhex(data))
    if hint is dt.datetime:
        return dt.datetime.fromisoformat(data)
    if is_result(hint):
        return hint(**{field: load(inner, data[field]) for field, inner in fields_of(hint).items()})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = [arg for arg in args if arg is not type(None)]  # results use only ``X | None``
        return load(inner, data)
    if origin is list:
        return [load(args[0], item) for item in data]
    if origin is tuple:
        return tuple(load(arg, item) for arg, item in zip(args, data))
    if origin is dict:
        return {load(args[0], key): load(args[1], item) for key, item in data.items()}
    return data


# -- the results with a wire format of their own --------------------------------------------


def layout_of(model: LayoutModel) -> Layout:
    """The :class:`Layout` a request names; raises ``InvalidLayout``."""
    return Layout.from_dict(model.model_dump())


def resume_out(r: ResumeResult) -> dict[str, Any]:
    return {
        "session_id": r.session_id,
        "version_id": r.version_id,
        "matched_tokens": r.matched_tokens,
        "num_prompt_tokens": r.num_prompt_tokens,
        "num_history_tokens": r.num_history_tokens,
        "num_new_tokens": r.num_new_tokens,
        "page_tokens": r.page_tokens,
        "page_bytes": r.page_bytes,
        "tiers": r.tiers,
        "load_seconds": r.load_seconds,
        "recompute_seconds": r.recompute_seconds,
        "should_load": r.should_load,
        "pages": [{"index": p.index, "page_id": p.page_id.hex(), "tier": p.tier} for p in r.pages],
        "source": r.source,
        "num_candidates": r.num_candidates,
        "near": dump(r.near),
        "encodings": r.encodings,
        "lossy_tokens": r.lossy_tokens,
    }


def resume_from(d: dict[str, Any], rates: Rates | None) -> ResumeResult:
    pages = [PageRef(p["index"], PageId(bytes.fromhex(p["page_id"])), p["tier"]) for p in d["pages"]]
    return ResumeResult(
        d["session_id"],
        load(VersionId | None, d["version_id"]),
        d["matched_tokens"],
        d["num_prompt_tokens"],
        d["num_history_tokens"],
        d["page_tokens"],
        d["page_bytes"],
        pages=pages,
        rates=rates,
        source=d.get("source"),
        num_candidates=d.get("num_candidates", 0),
        near=load(Candidate, d.get("near")),
        encodings={str(k): int(v) for k, v in (d.get("encodings") or {}).items()},
    )


def compaction_out(c: Compaction) -> dict[str, Any]:
    return {**dump(c), "freed_bytes": c.freed_bytes}


def saved_out(s: SavedPages) -> dict[str, Any]:
    return {"page_ids": {i: p.hex() for i, p in s.page_ids.items()}, "num_new_pages": s.num_new}


def saved_from(d: dict[str, Any]) -> SavedPages:
    return SavedPages({int(i): PageId(bytes.fromhex(p)) for i, p in d["page_ids"].items()}, d["num_new_pages"])


def rates_out(rates: Rates) -> dict[str, Any]:
    return {"tier_bytes_per_s": dict(rates.tier_bytes_per_s), "recompute_tokens_per_s": rates.recompute_tokens_per_s}


def rates_from(d: dict[str, Any]) -> Rates:
    return Rates(dict(d["tier_bytes_per_s"]), d["recompute_tokens_per_s"])


def encode_page(payload: bytes | None) -> str | None:
    return None if payload is None else base64.b64encode(payload).decode("ascii")


def decode_pages(pages: dict[int, str]) -> dict[int, bytes]:
    """Page payloads from base64; raises ``InvalidPage`` naming the first that is not base64."""
    out: dict[int, bytes] = {}
    for index, text in pages.items():
        try:
            out[index] = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidPage(f"page {index} is not valid base64") from None
    return out


def sql_out(result: SqlResult) -> dict[str, Any]:
    return {"columns": list(result.columns), "rows": [[_cell_out(v) for v in row] for row in result.rows]}


def sql_from(d: dict[str, Any]) -> SqlResult:
    return SqlResult(list(d["columns"]), [tuple(_cell_from(v) for v in row) for row in d["rows"]])


def _cell_out(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"type": "float", "value": str(value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"type": "bytes", "value": base64.b64encode(bytes(value)).decode("ascii")}
    for kind, cls in (("datetime", dt.datetime), ("date", dt.date), ("time", dt.time)):
        if isinstance(value, cls):
            return {"type": kind, "value": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"type": "decimal", "value": str(value)}
    if isinstance(value, (dict, list)):  # PostgreSQL json, jsonb and arrays
        try:
            return {"type": "json", "value": json.dumps(value, allow_nan=False)}
        except (TypeError, ValueError):
            pass  # it holds what JSON cannot carry (dates, NaN): as text, below
    return {"type": "text", "value": str(value)}


_CELL_DECODERS: dict[str, Any] = {
    "bytes": base64.b64decode,
    "float": float,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "decimal": decimal.Decimal,
    "text": str,
    "json": json.loads,
}


def _cell_from(value: Any) -> Any:
    if isinstance(value, dict):
        return _CELL_DECODERS[value["type"]](value["value"])
    return value
