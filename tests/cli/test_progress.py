"""Progress on long commands (:mod:`dss.cli.progress`): a bar on a terminal, nothing when the output
is piped or ``--json``. The commands run as real processes, on a pseudo-terminal (``pty``)
or on pipes, exactly as a person or a script would run them.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dss
from dss.catalog.database import Catalog, _alembic_config
from tests.conftest import LAYOUT, pages_for

SESSIONS = 40
BAR = re.compile(
    rb"\r(?:\x1b\[\?25l)?(?P<label>[^\r\[]+?)  \[(?P<bar>[#-]+)\]  (?P<pos>\d+/\d+)(?:  (?P<note>[^\r\x1b]*?))?\s*"
    rb"(?=\r|\x1b\[\?25h)"
)


def dss_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dss", *args]


def on_terminal(command: list[str]) -> bytes:
    """Everything the command writes to a pseudo-terminal (its stdout and stderr), once it exits 0."""
    main, child = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert process.wait() == 0, out.decode(errors="replace")
    return out


def piped(command: list[str]) -> tuple[str, str]:
    run = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout, run.stderr


def bars(out: bytes) -> list[tuple[str, str, str | None]]:
    """Every drawing of a bar in ``out``: ``(label, position, note)``."""
    return [
        (m["label"].decode(), m["pos"].decode(), m["note"].decode() if m["note"] else None) for m in BAR.finditer(out)
    ]


@pytest.fixture
def home(tmp_path: Path) -> str:
    """A store where user ``u1`` of tenant ``t`` has many sessions, and ``u2`` one."""
    with dss.open(tmp_path / "store") as store:
        for n in range(SESSIONS):
            tokens = [n, *range(100, 111)]
            store.create_session(f"s{n}", user_id="u1", tenant_id="t", layout=LAYOUT)
            store.commit(f"s{n}", tokens, pages_for(tokens, tag=n), tenant_id="t")
        store.create_session("other", user_id="u2", tenant_id="t", layout=LAYOUT)
        store.commit("other", list(range(12)), pages_for(list(range(12))), tenant_id="t")
    return str(tmp_path / "store")


def test_forget_user_on_a_terminal_draws_a_bar_of_the_erasure_steps(home: str) -> None:
    out = on_terminal(dss_command("--home", home, "forget-user", "u1", "--tenant", "t", "--yes"))
    assert bars(out) == [
        ("erasing user 'u1'", "0/5", None),
        ("erasing user 'u1'", "0/5", "planned -> key_destroyed"),
        ("erasing user 'u1'", "1/5", "key_destroyed -> catalog_purged"),
        ("erasing user 'u1'", "2/5", "catalog_purged -> files_deleted"),
        ("erasing user 'u1'", "3/5", "files_deleted -> compacted"),
        ("erasing user 'u1'", "4/5", "compacted -> done"),
        ("erasing user 'u1'", "5/5", "compacted -> done"),
    ]
    receipt = json.loads(out[out.index(b"\x1b[?25h") + len(b"\x1b[?25h") :].decode())
    assert receipt["removed"]["sessions"] == SESSIONS and receipt["verification"]["ok"]


def test_forget_user_piped_or_json_prints_the_receipt_and_nothing_else(home: str) -> None:
    stdout, stderr = piped(dss_command("--home", home, "forget-user", "u1", "--tenant", "t", "--yes"))
    assert stderr == ""
    assert json.loads(stdout)["removed"]["sessions"] == SESSIONS
    out = on_terminal(dss_command("--home", home, "forget-user", "u2", "--tenant", "t", "--yes", "--json"))
    assert bars(out) == []
    receipt = json.loads(out.decode())
    assert (receipt["user_id"], receipt["removed"]["sessions"]) == ("u2", 1)


def old_catalog(tmp_path: Path) -> str:
    """A store folder whose catalog is at revision 0001 (five migrations behind)."""
    from alembic import command

    catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    with catalog.engine.begin() as conn:
        config = _alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
    catalog.close()
    return str(tmp_path)


def test_db_upgrade_on_a_terminal_draws_a_bar_of_the_migrations(tmp_path: Path) -> None:
    out = on_terminal(dss_command("--home", old_catalog(tmp_path), "db", "upgrade"))
    assert bars(out) == [
        ("applying catalog migrations", "0/6", None),
        ("applying catalog migrations", "1/6", "0002"),
        ("applying catalog migrations", "2/6", "0003"),
        ("applying catalog migrations", "3/6", "0004"),
        ("applying catalog migrations", "4/6", "0005"),
        ("applying catalog migrations", "5/6", "0006"),
        ("applying catalog migrations", "6/6", "0007"),
    ]
    assert out.endswith(b"catalog upgraded from 0001 to 0007\r\n")


def test_db_upgrade_piped_prints_one_line(tmp_path: Path) -> None:
    assert piped(dss_command("--home", old_catalog(tmp_path), "db", "upgrade")) == (
        "catalog upgraded from 0001 to 0007\n",
        "",
    )


def test_a_bar_never_counts_past_its_total_and_finish_fills_it() -> None:
    from dss.cli.progress import Bar

    steps = Bar(None, 3)
    steps.begin("a")
    assert steps.done == 0
    steps.begin("b")
    steps.advance(5)
    assert steps.done == 3
    partial = Bar(None, 5)
    partial.advance(2)
    partial.finish()
    assert partial.done == 5


BENCHMARK = (
    "import sys; sys.path.insert(0, 'benchmarks'); from progress import track, wait; "
    "print(sum(track(range(3), 'counting'))); wait(0.2, 'waiting')"
)


def test_benchmarks_show_progress_the_same_way() -> None:
    """``benchmarks/progress.py``: a bar per loop on a terminal; piped, only the benchmark's own output."""
    root = str(Path(__file__).resolve().parents[2])
    out = on_terminal([sys.executable, "-c", f"import os; os.chdir({root!r}); {BENCHMARK}"])
    assert bars(out) == [
        ("counting", "0/3", None),
        ("counting", "1/3", None),
        ("counting", "2/3", None),
        ("counting", "3/3", None),
        ("waiting", "0/1", None),
        ("waiting", "1/1", None),
    ]
    assert b"\r\n3\r\n" in out
    assert piped([sys.executable, "-c", f"import os; os.chdir({root!r}); {BENCHMARK}"]) == ("3\n", "")
