"""The documentation is complete and every code block in it works.

The site (``mkdocs build --strict``) builds without a warning; the README stays short; every
public function, ``Store`` method, error and CLI command is documented; the generated references
cover every setting, command and route; and every fenced block of the README and of ``docs/``
is checked as ``docs/development.md`` says: Python and shell blocks run in a temporary folder
per page, formats parse, marked output is exactly what its command prints. Blocks that need an
engine or a server are run by the tests their ``run-by`` marker names (``test_docs_servers.py``,
``test_docs_engines.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import dss
from tests.docblocks import LANGUAGES, ROOT, Block, all_blocks, blocks, blocks_run_by, hand_written_text, pages

BIN = Path(sys.executable).parent
MAX_README_LINES = 300


def hooks() -> ModuleType:
    """The site's generator hook (``docs/hooks/reference.py``), imported as MkDocs imports it."""
    spec = importlib.util.spec_from_file_location("dss_docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "docs" / "hooks"))
    return module


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """The site builds with ``--strict`` (a warning fails it), by the command its page gives."""
    (block,) = blocks_run_by("test_the_site_builds_strictly")
    command = shlex.split(block.text.strip())
    assert command[:5] == [".venv/bin/python", "-m", "mkdocs", "build", "--strict"]
    command[command.index("--site-dir") + 1] = str(tmp_path / "site")
    done = subprocess.run(
        [sys.executable, *command[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"cli/index.html", "http-api/index.html", "configuration/index.html"} <= built
    assert not (tmp_path / "site" / "hooks").exists()


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_every_store_method_is_documented() -> None:
    text = hand_written_text()
    public = [name for name, _ in inspect.getmembers(dss.Store) if not name.startswith("_")]
    assert [name for name in public if f"{name}(" not in text and f"`{name}`" not in text] == []


def test_every_public_name_is_documented() -> None:
    text = hand_written_text()
    assert [name for name in dss.__all__ if not re.search(rf"\b{name}\b", text)] == []


def test_every_error_is_in_the_table_of_errors() -> None:
    page = (ROOT / "docs" / "python-api.md").read_text()
    section = page.split("## Errors", 1)[1].split("\n## ", 1)[0]
    errors = [
        name
        for name in dss.__all__
        if inspect.isclass(getattr(dss, name)) and issubclass(getattr(dss, name), dss.DssError)
    ]
    assert [name for name in errors if f"`{name}`" not in section] == []


def test_every_cli_command_has_help_and_is_in_the_reference() -> None:
    reference = hooks()
    from dss.cli.main import main

    page = reference.generated("cli")
    names = [path for path, _ in reference.commands(main)]
    assert {"dss", "dss demo", "dss forget-user", "dss keys add", "dss db upgrade", "dss route", "dss serve"} <= set(
        names
    )
    assert [name for name in names if f"## `{name}`" not in page] == []


def test_the_configuration_reference_has_every_setting_and_variable() -> None:
    from dss_adapters.vllm.settings import Settings

    from dss.core import config
    from dss.service import config as server_config

    reference = hooks()
    store, server = reference.generated("store-settings"), reference.generated("server-settings")
    connector = reference.generated("connector-settings")
    assert [f for f in config.StoreConfig.model_fields if f"| `{f}` |" not in store] == []
    assert [v for v in config._ENV if f"`{v}`" not in store] == []
    assert [f for f in server_config.ServerConfig.model_fields if f"| `{f}` |" not in server] == []
    assert [v for v in server_config._ENV if f"`{v}`" not in server] == []
    assert [f for f in Settings.__dataclass_fields__ if f"| `{f}` |" not in connector] == []
    assert "| `host_bytes` | `DSS_HOST_BYTES` | 1 GiB |" in store


def test_the_http_reference_has_every_route() -> None:
    httpapi = hooks().httpapi
    doc = httpapi.openapi()
    page = httpapi.http_reference(doc)
    missing = [
        f"{method.upper()} {path}"
        for path, item in doc["paths"].items()
        for method in item
        if f"### `{method.upper()} {path}`" not in page
    ]
    assert missing == []
    assert "### `VersionOut`" not in page and "### VersionOut" in page


def test_every_block_has_a_known_language() -> None:
    assert [f"{b.where}: {b.language or 'none'}" for b in all_blocks() if b.language not in LANGUAGES] == []


def test_every_run_by_marker_names_a_test_that_runs_its_blocks() -> None:
    """A ``run-by`` marker names a test function of ``tests/`` whose body reads its blocks."""
    sources = {path: path.read_text() for path in (ROOT / "tests").rglob("test_*.py")}
    wrong = []
    for name in sorted({b.marked("run-by") for b in all_blocks()} - {None}):
        readers = [
            path
            for path, text in sources.items()
            if re.search(rf"^def {name}\(.*?(?=^def |\Z)", text, re.DOTALL | re.MULTILINE)
            and f'blocks_run_by("{name}")' in text
        ]
        if not readers:
            wrong.append(name)
    assert wrong == []


def test_every_test_the_documentation_names_exists() -> None:
    text = hand_written_text()
    wrong = []
    for path, name in set(re.findall(r"tests/((?:\w+/)*test_\w+\.py)(?:::(\w+))?", text)):
        source = ROOT / "tests" / path
        if not source.is_file() or (name and f"def {name}(" not in source.read_text()):
            wrong.append(f"{path}::{name}" if name else path)
    assert wrong == []


# -- running the blocks of a page --


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_the_blocks_of_a_page_work(page: Path, tmp_path: Path) -> None:
    """Every block of the page that no other test runs, in order, in one folder of its own."""
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "DSS_HOME": str(work / "dss-data"),
        "DSS_MASTER_KEY_FILE": str(tmp_path / "master.key"),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    for name in ("DSS_CONFIG", "DSS_CATALOG_URL", "DSS_API_KEY", "DSS_SERVER_CONFIG"):
        env.pop(name, None)
    for number, block in enumerate(blocks(page)):
        if block.marked("run-by"):
            continue
        CHECKS[block.language](block, work, env, number)


def _python(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    script = work / f"block_{number}.py"
    script.write_text(block.text)
    done = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.where}:\n{done.stderr[-3000:]}"


def _bash(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    for line in logical_lines(block.text):
        words = shlex.split(line, comments=True)
        assignments = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
        words = words[len(assignments) :] if words[: len(assignments)] == assignments else words
        check = next((c for prefix, c in SHELL if words and words[0].startswith(prefix)), None)
        assert check is not None, f"{block.where}: no test checks this shell line: {line}"
        check(block, line, words, work, env)


def logical_lines(text: str) -> list[str]:
    """Shell lines, with backslash continuations joined; blank and comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _dss_line(block: Block, line: str, words: list[str], work: Path, env: dict[str, str]) -> None:
    expected = re.search(r"#.*exit status (\d+)", line)
    done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    code = int(expected.group(1)) if expected else 0
    assert done.returncode == code, f"{block.where}: {line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def _script_line(block: Block, line: str, words: list[str], work: Path, env: dict[str, str]) -> None:
    script = ROOT / words[0].removeprefix("./")
    assert script.is_file() and os.access(script, os.X_OK), f"{block.where}: {words[0]} is not an executable script"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, f"{block.where}: {words[0]} does not parse"


def _pip_line(block: Block, line: str, words: list[str], work: Path, env: dict[str, str]) -> None:
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e for target in words[2:] for group in re.findall(r"\[([\w,-]+)\]", target) for e in group.split(",")}
    assert words[1] == "install" and named and named <= extras, f"{block.where}: {line}"


def _benchmark_line(block: Block, line: str, words: list[str], work: Path, env: dict[str, str]) -> None:
    script, arguments = words[1], words[2:]
    assert re.fullmatch(r"benchmarks/\w+\.py", script) and (ROOT / script).is_file(), f"{block.where}: {line}"
    options = {
        a.split("=")[0] for a in arguments[: arguments.index("--") if "--" in arguments else None] if a.startswith("--")
    }
    usage = benchmark_help(script)
    assert [o for o in sorted(options) if not re.search(rf"{o}\b", usage)] == [], f"{block.where}: {line}"


@functools.cache
def benchmark_help(script: str) -> str:
    done = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


SHELL = (
    ("dss", _dss_line),
    ("scripts/", _script_line),
    ("./scripts/", _script_line),
    ("pip", _pip_line),
    (".venv/bin/python", _benchmark_line),
)
"""How each kind of shell line is checked, by its first word."""


def _text(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    command = block.marked("output-of")
    if command is None:
        return
    folder = work / f"output_{number}"
    folder.mkdir()
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=folder,
        env={**env, "DSS_HOME": str(folder / "dss-data")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    shown = [line.rstrip() for line in block.text.splitlines()]
    starts = [i for i, line in enumerate(printed) if line == shown[0]]
    assert any(printed[i : i + len(shown)] == shown for i in starts), f"{block.where}: not what {command} prints"


def _yaml(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    assert isinstance(yaml.safe_load(block.text), dict), block.where


def _toml(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    values = tomllib.loads(block.text)
    if block.marked("config") == "store":
        from dss.core.config import load_config
        from dss.service.config import ServerConfig

        home = work / f"config_{number}"
        home.mkdir()
        (home / "dss.toml").write_text(block.text)
        load_config(home)  # a setting that is not one, or a bad value, is a ConfigError
        ServerConfig(keys_file=home / "keys.json", **values.get("server", {}))


def _json(block: Block, work: Path, env: dict[str, str], number: int) -> None:
    value = json.loads(block.text)
    name = block.marked("json-model")
    if name is not None:
        module, _, attribute = name.rpartition(".")
        getattr(importlib.import_module(module), attribute).model_validate(value)


CHECKS = {"python": _python, "bash": _bash, "text": _text, "yaml": _yaml, "toml": _toml, "json": _json}
"""How a block of each language is checked."""
