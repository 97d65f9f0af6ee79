"""The HTTP API reference, written from the OpenAPI document of the service's own app.

:func:`openapi` builds the FastAPI app exactly as ``dss serve`` does (``dss.service.server
.create_app``) on a throwaway store and returns its document; :func:`http_reference` turns it
into Markdown: every operation grouped by tag (method, path, summary, the key it needs, its
parameters and body fields, its answers), then every model an answer names. Nothing here is
written by hand, so the page cannot fall behind the routes; the prose around it (tenancy,
errors, admin keys) lives in ``docs/http-api.md``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

Schema = dict[str, Any]

TAG_TITLES = {
    "service": "Service",
    "sessions": "Sessions",
    "versions": "Versions",
    "resume": "Resume and lookup",
    "pages": "Pages",
    "engines": "Engines (device tier)",
    "erasure": "Erasure",
    "admin": "Administration",
}
"""Section titles of the tags the routes carry, in the order the page shows them."""


def openapi() -> Schema:
    """The OpenAPI document of ``dss serve``'s app, built on a store in a temporary folder."""
    import dss
    from dss.service.apikeys import KeyRing
    from dss.service.config import load_server_config
    from dss.service.server import create_app

    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "store"
        store = dss.open(home, master_key=os.urandom(32).hex(), fsync=False, mover=False)
        try:
            config = load_server_config(home)
            return create_app(store, config, KeyRing(config.keys_file)).openapi()
        finally:
            store.close()


def http_reference(doc: Schema) -> str:
    """Markdown for every operation of ``doc`` and every model its answers name."""
    operations: dict[str, list[tuple[str, str, Schema]]] = {}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            tag = (operation.get("tags") or ["service"])[0]
            operations.setdefault(tag, []).append((method.upper(), path, operation))
    unknown = sorted(set(operations) - set(TAG_TITLES))
    if unknown:
        raise ValueError(f"routes carry tags the HTTP reference has no title for: {unknown}")
    schemas = doc["components"]["schemas"]
    out: list[str] = []
    named: set[str] = set()
    for tag, title in TAG_TITLES.items():
        if tag in operations:
            out.append(f"## {title}\n")
            for method, path, operation in operations[tag]:
                out.append(_operation(method, path, operation, schemas, named))
    out.append("## Models\n\nThe bodies of the answers above, field by field.\n")
    for name in sorted(_closure(named, schemas)):
        out.append(f"### {name}\n\n" + _fields(schemas[name], schemas))
    return "\n".join(out)


def _operation(method: str, path: str, operation: Schema, schemas: dict[str, Schema], named: set[str]) -> str:
    lines = [f"### `{method} {path}`\n", _text(operation.get("description") or operation.get("summary", "")), ""]
    if operation.get("security"):
        key = "an admin API key" if "admin" in operation.get("tags", []) else "an API key"
        lines.append(f"Needs {key} (`Authorization: Bearer <key>`).\n")
    else:
        lines.append("Needs no API key.\n")
    params = operation.get("parameters", [])
    if params:
        lines += ["| query parameter | type | required | meaning |", "|---|---|---|---|"]
        lines += [
            f"| `{p['name']}` | {_type(p['schema'], schemas)} | {'yes' if p.get('required') else 'no'} | "
            f"{_cell(p.get('description') or p['schema'].get('description', ''))} |"
            for p in params
        ]
        lines.append("")
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        lines.append(f"Body ({_type(body, schemas)}):\n")
        lines.append(_fields(_resolve(body, schemas), schemas))
    lines.append("| answer | body |\n|---|---|")
    for code, answer in operation["responses"].items():
        content = answer.get("content", {})
        schema = next(iter(content.values()), {}).get("schema") if content else None
        if schema is not None and code.startswith("2"):
            named.update(_refs(schema))
        shown = _type(schema, schemas) if schema else "—"
        lines.append(f"| {code} | {_cell(answer.get('description', ''))}: {shown} |")
    return "\n".join(lines) + "\n"


def _fields(schema: Schema, schemas: dict[str, Schema]) -> str:
    properties = schema.get("properties", {})
    if not properties:
        return _text(schema.get("description", "A JSON value.")) + "\n"
    required = set(schema.get("required", []))
    lines = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for name, field in properties.items():
        default = f" Default `{field['default']}`." if "default" in field and field["default"] is not None else ""
        lines.append(
            f"| `{name}` | {_type(field, schemas)} | {'yes' if name in required else 'no'} | "
            f"{_cell(field.get('description', ''))}{default} |"
        )
    return "\n".join(lines) + "\n"


def _type(schema: Schema, schemas: dict[str, Schema]) -> str:
    """A short name of a JSON schema's type: ``VersionOut``, ``list of integer``, ``string or null``."""
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[1]}`"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(_type(s, schemas) for s in schema.get("anyOf") or schema["oneOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}), schemas)}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"object of {_type(schema['additionalProperties'], schemas)}"
    return str(kind)


def _refs(schema: Schema) -> set[str]:
    """Names of the models ``schema`` refers to, at any depth."""
    found: set[str] = set()
    if isinstance(schema, dict):
        if "$ref" in schema:
            found.add(schema["$ref"].rsplit("/", 1)[1])
        for value in schema.values():
            found |= _refs(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _refs(value)
    return found


def _closure(names: set[str], schemas: dict[str, Schema]) -> set[str]:
    """``names`` and every model they refer to."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += _refs(schemas[name])
    return seen


def _resolve(schema: Schema, schemas: dict[str, Schema]) -> Schema:
    return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema


def _text(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|")
