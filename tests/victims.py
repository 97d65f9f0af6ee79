"""Run a victim process and SIGKILL it: the crash tests' common part.

A victim is ``python -m tests.<module> ARGS...`` that prints a marker line once it is under
way, then acknowledgements as it goes; :func:`kill_after` kills it a given time after the
marker and returns every complete line it printed (a line cut by the kill has no newline).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kill_after(
    module: str, args: Sequence[str], marker: str, delay: float, before: Callable[[], None] | None = None
) -> list[str]:
    """Start ``python -m tests.<module> *args``; once it printed a line starting with
    ``marker``, run ``before()`` (if given), wait ``delay`` seconds and SIGKILL it. Returns
    the lines it printed that end with a newline."""
    child = subprocess.Popen(
        [sys.executable, "-m", f"tests.{module}", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines: list[str] = []
    started = threading.Event()

    def pump() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(marker):
                started.set()
            lines.append(line)

    reader = threading.Thread(target=pump)
    reader.start()
    if not started.wait(60):
        child.kill()
        reader.join()
        raise AssertionError(f"the victim never printed {marker!r}: {child.stderr.read() if child.stderr else ''}")
    if before is not None:
        before()
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    reader.join()
    assert child.returncode == -signal.SIGKILL, child.stderr.read() if child.stderr else ""
    return [line for line in lines if line.endswith("\n")]
