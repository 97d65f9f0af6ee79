"""The packages of the distribution, found rather than listed; everything else is in pyproject.toml.

Each import name maps to a folder, and every package under that folder (a folder with an
``__init__.py``) is shipped under the import name, so a new subpackage needs no edit here.
``adapters/`` and ``migrations/`` install as ``dss_adapters`` and ``dss_migrations`` (a top-level
``adapters`` package already exists on PyPI); ``[tool.setuptools.packages.find]`` cannot express
that, because it names a package after its folder. ``tests/test_packaging.py`` checks the wheel.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIRS = {"dss": "dss", "dss_adapters": "adapters", "dss_migrations": "migrations"}
"""Import name of each package folder."""


def packages() -> list[str]:
    """Every package under the folders of :data:`PACKAGE_DIRS`, under its import name, sorted."""
    return sorted(
        f"{name}.{sub}" if sub else name
        for name, folder in PACKAGE_DIRS.items()
        for sub in ["", *find_packages(str(ROOT / folder))]
    )


setup(package_dir=PACKAGE_DIRS, packages=packages())
