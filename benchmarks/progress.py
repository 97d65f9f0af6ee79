"""Progress for the benchmarks, shown as dss's commands show it (:mod:`dss.cli.progress`): a bar on
standard error when it is a terminal, nothing when the output is piped or redirected, so the
tables a benchmark prints stay clean.

    from progress import track           # benchmarks/ is the script's folder
    for turn in track(range(40), "building the session"):
        ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from dss.cli.progress import bar

T = TypeVar("T")


def track(items: Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    """Yield ``items``, moving a bar one step per item (``total`` defaults to ``len(items)``)."""
    count = total if total is not None else len(items)  # type: ignore[arg-type]
    with bar(count, label) as steps:
        for item in items:
            yield item
            steps.advance()


def wait(seconds: float, label: str) -> None:
    """Sleep ``seconds`` with a bar of the whole seconds gone (for benchmarks that run for a fixed time)."""
    deadline = time.monotonic() + seconds
    with bar(max(1, round(seconds)), label) as steps:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            steps.advance(round(seconds - max(0.0, deadline - time.monotonic())) - steps.done)
        steps.finish()


def run_until(targets: Sequence[Callable[[], object]], deadline: float, label: str) -> float:
    """Run each target in a thread of its own, show a bar until ``deadline`` (``time.monotonic``),
    join them all; return the seconds from their start to the last one's end."""
    threads = [threading.Thread(target=target) for target in targets]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    wait(deadline - time.monotonic(), label)
    for thread in threads:
        thread.join()
    return time.perf_counter() - start
