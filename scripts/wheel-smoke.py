"""Import smoke of an installed dss-store wheel, run by ``scripts/wheel-check`` with the bare
environment's Python (``python -I``, from a folder outside the source tree).

Imports every module of ``dss``, ``dss_adapters`` and ``dss_migrations`` and checks that each
comes from that environment's site-packages. The bare environment holds the wheel and its
runtime dependencies only, so the modules in :data:`NEEDS_EXTRA` cannot import there; each must
fail with a ``ModuleNotFoundError`` for a package of its extra and nothing else, and every
other module must import. An entry that imports without its extra is stale and fails too.
Then checks the data files, and that a bare install names the extra to install where one is
missing. Prints one line per check; exits 1 on the first failure.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.resources
import pkgutil
import sys
import sysconfig
import tempfile
from pathlib import Path

SERVER = {"fastapi", "starlette", "uvicorn", "prometheus_client", "redis"}
ENGINE = {"torch", "transformers", "vllm"}
NEEDS_EXTRA: dict[str, tuple[str, set[str]]] = {
    # the PostgreSQL change feed (LISTEN/NOTIFY); imported only for a postgresql:// catalog
    "dss.catalog.listen": ("postgres", {"psycopg"}),
    # the HTTP service and its parts; `dss serve` imports them only when it runs
    "dss.service.backends": ("server", SERVER),
    "dss.service.calls": ("server", SERVER),
    "dss.service.docs": ("server", SERVER),
    "dss.service.metrics": ("server", SERVER),
    "dss.service.middleware": ("server", SERVER),
    "dss.service.router": ("server", SERVER),
    "dss.service.server": ("server", SERVER),
    **{
        f"dss.service.routes.{tag}": ("server", SERVER)
        for tag in ("admin", "engines", "erasure", "meta", "pages", "resume", "sessions", "versions")
    },
    # the engine adapters: loaded by vLLM or transformers, which bring torch
    "dss_adapters.dequantize": ("transformers or vllm", ENGINE),
    "dss_adapters.staging": ("transformers or vllm", ENGINE),
    "dss_adapters.transformers.blend": ("transformers", ENGINE),
    "dss_adapters.transformers.blend_select": ("transformers", ENGINE),
    "dss_adapters.transformers.cache": ("transformers", ENGINE),
    "dss_adapters.transformers_cache": ("transformers", ENGINE),
    "dss_adapters.vllm.connector": ("vllm", ENGINE),
    "dss_adapters.vllm_connector": ("vllm", ENGINE),
    "dss_adapters.vllm.copy": ("vllm", ENGINE),
    "dss_adapters.vllm.cuda": ("vllm", ENGINE),
    "dss_adapters.vllm.loader": ("vllm", ENGINE),
    "dss_adapters.vllm.meta": ("vllm", ENGINE),
    "dss_adapters.vllm.metrics": ("vllm", ENGINE),
    "dss_adapters.vllm.scheduler": ("vllm", ENGINE),
    "dss_adapters.vllm.worker": ("vllm", ENGINE),
}
"""Modules that need an optional extra, with the extra and the packages it may be missing."""
NOT_IMPORTED = {
    "dss.__main__": "`python -m dss`: it runs the command line (scripts/wheel-check runs `dss` itself)",
    "dss_migrations.env": "Alembic's environment script, run by Alembic on a connection (`dss demo` runs it)",
}
"""Modules that are run, not imported, and why."""
PACKAGES = ("dss", "dss_adapters", "dss_migrations")


def fail(message: str) -> None:
    print(f"wheel-smoke: FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


def modules() -> list[str]:
    """Every module of the installed packages, sorted."""
    names = []
    for top in PACKAGES:
        package = importlib.import_module(top)
        names.append(top)
        names.extend(m.name for m in pkgutil.walk_packages(package.__path__, top + ".", onerror=fail))
    return sorted(names)


def check_imports() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    found = modules()
    unknown = sorted((set(NEEDS_EXTRA) | set(NOT_IMPORTED)) - set(found))
    if unknown:
        fail(f"listed modules that the wheel does not hold: {unknown}")
    imported = skipped = 0
    for name in found:
        if name in NOT_IMPORTED:
            continue
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            _extra, allowed = NEEDS_EXTRA.get(name, ("", set()))
            if (exc.name or "").split(".")[0] not in allowed:
                fail(f"{name} does not import in a bare install: {exc!r}")
            skipped += 1
            continue
        if name in NEEDS_EXTRA:
            fail(f"{name} imports without the {NEEDS_EXTRA[name][0]} extra: drop it from NEEDS_EXTRA")
        origin = Path(module.__file__ or "").resolve()
        if site not in origin.parents:
            fail(f"{name} was imported from {origin}, not from the installed wheel in {site}")
        imported += 1
    print(
        f"wheel-smoke: imported {imported} modules from {site}; {skipped} need an extra, "
        f"{len(NOT_IMPORTED)} are run, not imported"
    )


def check_data_files() -> None:
    if not importlib.resources.files("dss").joinpath("py.typed").is_file():
        fail("dss/py.typed is missing")
    migrations = importlib.resources.files("dss_migrations")
    versions = sorted(p.name for p in migrations.joinpath("versions").iterdir() if p.name.endswith(".py"))
    if not migrations.joinpath("script.py.mako").is_file() or not versions:
        fail(f"the migration template or versions are missing (versions: {versions})")
    version = importlib.metadata.version("dss-store")
    print(f"wheel-smoke: dss-store {version}: py.typed, script.py.mako and {len(versions)} migrations present")


def check_hints() -> None:
    """Without an extra, dss says which one to install."""
    import dss
    from dss.core.errors import ConfigError

    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            (lambda: dss.open(Path(tmp, "a"), approximate=True), "pip install 'dss-store[lsh]'"),
            (
                lambda: dss.open("postgresql+psycopg://127.0.0.1:1/none", home=Path(tmp, "b")),
                "pip install 'dss-store[postgres]'",
            ),
        ]
        for call, hint in cases:
            try:
                call().close()
            except ConfigError as exc:
                if hint not in str(exc):
                    fail(f"the error does not say {hint!r}: {exc}")
            else:
                fail(f"no ConfigError where {hint!r} was expected")
    print("wheel-smoke: the lsh and postgres extras are named where they are missing")


if __name__ == "__main__":
    check_imports()
    check_data_files()
    check_hints()
