"""Layering: a dss module imports only from layers below it; no engine is ever imported by dss/.

Layers, lowest first (DESIGN §7). Adapters use only the public ``dss`` API.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = [
    {"errors"},
    {"types", "problems"},
    {"config", "hashing", "tokens", "epoch", "validate", "crypto", "rawscan"},
    {"trie", "tiers", "schema", "server_config", "apikeys"},
    {"readonly_sql"},
    {"catalog"},
    {"records"},
    {"keys", "folder"},
    {"pageindex", "resume", "placement"},
    {"sessions", "pages", "api_models"},
    {"mirror", "integrity", "erase"},
    {"matcher"},
    {"store"},
    {"demo", "client", "tenancy", "service_metrics", "service_process"},
    {"server_middleware"},
    {"server"},
    {"server_cli", "progress"},
    {"cli"},
    {"__main__", "__init__"},
]
ENGINES = {"vllm", "transformers", "torch"}


def layer_of(module: str) -> int:
    for level, names in enumerate(LAYERS):
        if module in names:
            return level
    raise AssertionError(f"dss.{module} is in no layer: add it to LAYERS in {__file__}")


def imports(path: Path) -> set[str]:
    """Modules a file imports, leaving out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "dss" and len(parts) > 1 else ""


def test_core_modules_import_only_lower_layers() -> None:
    problems = []
    for path in sorted((ROOT / "dss").rglob("*.py")):
        rel = path.relative_to(ROOT / "dss").with_suffix("")
        own = rel.parts[0]
        level = layer_of(own)
        for name in imports(path):
            if name.split(".")[0] in ENGINES:
                problems.append(f"dss/{rel}.py imports the engine {name}")
            target = top(name)
            if not target or target == own or target.startswith("_") and target != "__init__":
                continue
            if target in {m for layer in LAYERS for m in layer} and layer_of(target) >= level and own != "__init__":
                problems.append(f"dss/{rel}.py (layer {level}) imports dss.{target} (layer {layer_of(target)})")
    assert problems == []


def test_adapters_use_only_the_public_api() -> None:
    problems = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        for name in imports(path):
            if name.startswith("dss.") and not name.startswith("dss_adapters"):
                import dss

                if name.split(".")[1] not in dss.__all__:
                    problems.append(f"adapters/{path.relative_to(ROOT / 'adapters')} imports {name}")
    assert problems == []
