"""The fenced code blocks of the documentation (``docs/*.md`` and ``README.md``), read for the docs tests.

A block is the text between a fence line (three backticks and a language) and the next closing
fence. The HTML comment on the line just before a block, if any, is its marker
(``<!-- KEY: VALUE -->``): ``run-by`` names the test that reads the block and runs it (through
:func:`blocks_run_by`); ``output-of``, ``config`` and ``json-model`` say how a ``text``, ``toml``
or ``json`` block is checked (see ``docs/development.md``). Nothing here runs a block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LANGUAGES = {"python", "bash", "text", "yaml", "toml", "json"}
"""The languages a block may have: code that runs, and formats that are parsed."""

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- ([a-z-]+): (.+?) -->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and its marker."""

    page: Path
    line: int
    language: str
    text: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def marked(self, key: str) -> str | None:
        """The value of this block's marker ``key``, or ``None``."""
        return self.marker[1] if self.marker and self.marker[0] == key else None


def pages() -> list[Path]:
    """Every hand-written page: the README and ``docs/*.md``."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order; raises ``ValueError`` for a fence left open."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    start: int | None = None
    language = ""
    for number, line in enumerate(lines):
        fence = _FENCE.match(line)
        if not fence:
            continue
        if start is None:
            start, language = number, fence.group(1)
        elif fence.group(1) == "":
            before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
            marker = _MARKER.match(before.strip())
            found.append(
                Block(
                    page,
                    start + 1,
                    language,
                    "\n".join(lines[start + 1 : number]) + "\n",
                    (marker.group(1), marker.group(2)) if marker else None,
                )
            )
            start = None
    if start is not None:
        raise ValueError(f"{page.relative_to(ROOT)}:{start + 1}: a fence is never closed")
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def blocks_run_by(test_name: str) -> list[Block]:
    """The blocks whose marker says ``run-by: test_name``, in page order; at least one."""
    found = [block for block in all_blocks() if block.marked("run-by") == test_name]
    if not found:
        raise LookupError(f"no documentation block is marked run-by: {test_name}")
    return found


def hand_written_text() -> str:
    """The text of every hand-written page (generated sections are not in it)."""
    return "\n".join(page.read_text() for page in pages())
