"""The README documents every public function, Store method, error and CLI command."""

from __future__ import annotations

import inspect
from pathlib import Path

import click

import dss
from dss.cli.main import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_store_method_is_documented() -> None:
    public = [name for name, _ in inspect.getmembers(dss.Store) if not name.startswith("_")]
    missing = [name for name in public if f"{name}(" not in README and f"`{name}`" not in README]
    assert missing == []


def test_every_public_name_is_documented() -> None:
    missing = [name for name in dss.__all__ if name not in README]
    assert missing == []


def commands(group: click.Group, prefix: str = "dss") -> list[str]:
    out = []
    for name, command in group.commands.items():
        out.append(f"{prefix} {name}")
        if isinstance(command, click.Group):
            out.extend(commands(command, f"{prefix} {name}"))
    return out


def test_every_cli_command_is_documented() -> None:
    missing = [command for command in commands(main) if command not in README]
    assert missing == []
