"""Core result types on the wire: response models derived from their fields, and their JSON
both ways.

A core result — a ``NamedTuple`` or a dataclass such as :class:`~dss.core.types.Session`,
:class:`~dss.core.types.Version`, :class:`~dss.sessions.resume.Candidate`,
:class:`~dss.approx.nearest.Explanation` or :class:`~dss.writes.compaction.Compaction` — is
the one place its fields are written. :func:`model_of` derives from the type's annotations
the pydantic model the HTTP API documents (a field's attribute docstring is its description);
:func:`dump` turns a value into that model's data and :func:`load` makes the value again
from it, on the client's side: ``load(T, dump(value)) == value``.

On the wire a :class:`~dss.core.types.Layout` is an object (:class:`LayoutModel`), a page id
lowercase hex, a time ISO 8601 text, a tuple a list, and a nested result an object of its own
model.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime as dt
import functools
import inspect
import textwrap
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, create_model, model_validator

from dss.core.types import Layout, PageId

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


def fields_of(tp: type) -> dict[str, Any]:
    """A result type's fields and their annotations, in order."""
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
    if is_result(type(value)):
        return {field: dump(getattr(value, field)) for field in fields_of(type(value))}
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
