"""Lint, format and types, checked by the test command: ``ruff check``, ``ruff format --check``
and ``mypy`` (each configured in ``pyproject.toml``, at the versions the ``test`` extra pins)
find nothing in the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECKS = {
    "ruff check": ["ruff", "check", "."],
    "ruff format": ["ruff", "format", "--check", "."],
    "mypy": ["mypy"],
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_finds_nothing(name: str) -> None:
    out = subprocess.run([sys.executable, "-m", *CHECKS[name]], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"{name} found problems:\n{out.stdout}{out.stderr}"
