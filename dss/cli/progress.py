"""Progress bars for long commands: a bar on a terminal, nothing otherwise.

The bar goes to standard error, and only when standard error is a terminal and the caller
did not ask for quiet (``--json``), so piped or machine-read output never holds one. It is
click's own bar (``click.progressbar``); this module only decides whether there is one.
Used by the CLI and the benchmarks; the core knows nothing of it (it reports progress
through plain callbacks, such as ``Store.forget_user``'s ``progress``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Bar:
    """A bar of ``total`` steps (:func:`bar` makes one); :meth:`advance` moves it, or does
    nothing when there is no terminal to draw on."""

    def __init__(self, drawn: Any | None, total: int) -> None:
        self._drawn = drawn
        self.total = total
        self.done = 0
        self._begun = False

    def advance(self, steps: int = 1, note: str | None = None) -> None:
        """Count ``steps`` more as done (never past ``total``) and show ``note`` beside the bar."""
        steps = max(0, min(steps, self.total - self.done))
        self.done += steps
        if self._drawn is None:
            return
        if steps:
            self._drawn.update(steps, note)
        elif note is not None:  # click draws on a step only: show the new note in place
            self._drawn.current_item = note
            self._drawn.render_progress()

    def begin(self, note: str) -> None:
        """A step starts (its name is ``note``): the step that began before it is done."""
        self.advance(1 if self._begun else 0, note)
        self._begun = True

    def finish(self) -> None:
        """Mark every step done (work that resumed halfway skips the steps already done)."""
        self.advance(self.total - self.done)


@contextmanager
def bar(total: int, label: str, *, quiet: bool = False) -> Iterator[Bar]:
    """A :class:`Bar` of ``total`` steps labelled ``label`` on standard error, drawn only if
    that is a terminal and not ``quiet``; the line is ended when the block ends."""
    stream = sys.stderr
    if quiet or not stream.isatty():
        yield Bar(None, total)
        return
    import click

    with click.progressbar(
        length=total, label=label, file=stream, show_pos=True, show_eta=False, item_show_func=lambda note: note
    ) as drawn:
        yield Bar(drawn, total)
