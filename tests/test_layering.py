"""Layering: the floors of dss/ you can see in its folder names, each importing only from floors
below it (``TYPE_CHECKING`` imports included); no engine is ever imported by dss/.

Floors, lowest first (DESIGN §7). A unit is a package (a folder) or one of
the two modules directly in ``dss/``; modules of one package may import each other. Adapters use
only the public ``dss`` API.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS = [
    {"core"},
    {"catalog", "tiers"},
    {"placement"},
    {"pages"},
    {"sessions"},
    {"approx"},
    {"erasure", "writes"},
    {"store"},
    {"service"},
    {"cli"},
    {"__init__", "__main__"},
]
ENGINES = {"vllm", "transformers", "torch"}


def floor_of(unit: str) -> int:
    for level, names in enumerate(FLOORS):
        if unit in names:
            return level
    raise AssertionError(f"dss.{unit} is on no floor: add it to FLOORS in {__file__}")


def imports(path: Path) -> set[str]:
    """Modules a file imports, ``if TYPE_CHECKING:`` blocks and function bodies included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "dss":  # ``from dss import x`` imports the module dss.x, not the package's names
                found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def unit(module: str) -> str:
    """The floor unit of a dotted module name (``dss.catalog.schema`` -> ``catalog``; ``dss`` -> ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_imports_only_lower_floors() -> None:
    problems = []
    units = {name for floor in FLOORS for name in floor}
    for path in sorted((ROOT / "dss").rglob("*.py")):
        rel = path.relative_to(ROOT / "dss").with_suffix("")
        own = rel.parts[0]
        level = floor_of(own)
        for name in imports(path):
            if name.split(".")[0] in ENGINES:
                problems.append(f"dss/{rel}.py imports the engine {name}")
            if name.split(".")[0] != "dss":
                continue
            target = unit(name)
            if target == own or target not in units:
                continue  # its own package, or a name imported from a module (checked as the module)
            if floor_of(target) >= level:
                problems.append(f"dss/{rel}.py (floor {level}) imports dss.{target} (floor {floor_of(target)})")
    assert problems == []


def test_every_module_is_on_a_floor() -> None:
    units = {
        path.relative_to(ROOT / "dss").parts[0].removesuffix(".py")
        for path in (ROOT / "dss").glob("*")
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())
    }
    assert units == {name for floor in FLOORS for name in floor}


def test_sql_is_written_only_in_the_catalog() -> None:
    """Outside dss/catalog/, no module builds a statement (SQLAlchemy Core or raw text)."""
    words = ("from sqlalchemy import", "exec_driver_sql", "sa.text(", "select(")
    found = [
        f"{path.relative_to(ROOT)}: {word}"
        for path in sorted((ROOT / "dss").rglob("*.py"))
        if "catalog" not in path.relative_to(ROOT / "dss").parts[:1]
        for word in words
        if word in path.read_text()
    ]
    assert found == []


def test_sqlalchemy_is_imported_only_by_the_catalog() -> None:
    """No module outside dss/catalog/ imports SQLAlchemy (catalog URLs too are built there)."""
    found = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "dss").rglob("*.py")
        if "catalog" not in path.relative_to(ROOT / "dss").parts[:1]
        and any(name.split(".")[0] == "sqlalchemy" for name in imports(path))
    )
    assert found == []


def test_adapters_use_only_the_public_api() -> None:
    problems = []
    for path in sorted((ROOT / "adapters").rglob("*.py")):
        for name in imports(path):
            if name.startswith("dss.") and not name.startswith("dss_adapters"):
                import dss

                if name.split(".")[1] not in dss.__all__:
                    problems.append(f"adapters/{path.relative_to(ROOT / 'adapters')} imports {name}")
    assert problems == []


def test_only_the_entry_points_lie_directly_in_dss() -> None:
    """Everything but the package's entry points is in a folder named by its role."""
    assert sorted(path.name for path in (ROOT / "dss").glob("*.py")) == ["__init__.py", "__main__.py"]


def test_no_module_is_over_400_lines() -> None:
    """A module that grows past 400 lines is split by role before it lands."""
    long = sorted(
        f"{path.relative_to(ROOT)}: {n} lines"
        for folder in ("dss", "adapters")
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    )
    assert long == []
