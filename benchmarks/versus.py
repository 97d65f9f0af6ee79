"""Run a benchmark in this checkout and in another (a previous commit's), turn about, and print
every figure of its tables with the ratio this/base: how a redesign proves it costs nothing.

    git worktree add ../dss-base HEAD~1 && (cd ../dss-base && scripts/env server)
    .venv/bin/python benchmarks/versus.py --base ../dss-base --rounds 3 -- benchmarks/resume.py
    .venv/bin/python benchmarks/versus.py --base ../dss-base --rounds 3 -- \\
        benchmarks/service_load.py --clients 32 --duration 20

Each checkout runs its own copy of the benchmark with its own ``.venv``, alternately (base,
this, base, this, ...), so the machine's drift hits both alike. A figure is a number in a row
of a table the benchmark prints (markdown ``| ... |`` rows or space-aligned columns), named by
the row's first cell and its column's header; the table shows the median over the rounds of
each, and this/base (below 1: this checkout takes less).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
_NUMBER = re.compile(r"^-?\d+(?:[.,]\d+)*x?$")


def figures(output: str) -> dict[tuple[str, str], float]:
    """``(row, column) -> value`` of every number in the tables of a benchmark's output."""
    out: dict[tuple[str, str], float] = {}
    header: list[str] = []
    for line in output.splitlines():
        text = line.strip()
        if not text or set(text) <= set("|-: "):
            continue
        cells = (
            [c.strip() for c in text.strip("|").split("|")]
            if text.startswith("|")
            else re.split(r"\s{2,}|\s+(?=\d)", text)
        )
        numeric = [bool(_NUMBER.match(c)) for c in cells[1:]]
        if cells and not any(numeric):
            header = cells
            continue
        for column, (cell, is_number) in enumerate(zip(cells[1:], numeric), start=1):
            if is_number:
                name = header[column] if column < len(header) else f"#{column}"
                out[(cells[0], name)] = float(cell.rstrip("x").replace(",", ""))
    return out


def run(root: Path, command: list[str]) -> dict[tuple[str, str], float]:
    done = subprocess.run(
        [str(root / ".venv" / "bin" / "python"), *command], cwd=root, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"{command[0]} failed in {root}:\n{done.stderr[-2000:]}")
    return figures(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout (with its own .venv)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- BENCHMARK [ARGS...], relative to each checkout")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    base_runs, this_runs = [], []
    for n in range(args.rounds):
        print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
        base_runs.append(run(args.base.resolve(), command))
        this_runs.append(run(HERE, command))
    keys = [k for k in this_runs[0] if all(k in r for r in (*base_runs, *this_runs))]
    print(f"{' '.join(command)}: median of {args.rounds} alternating rounds, base = {args.base}")
    print("| row | column | base | this | this/base |")
    print("|---|---|---|---|---|")
    for key in keys:
        base = statistics.median(r[key] for r in base_runs)
        this = statistics.median(r[key] for r in this_runs)
        ratio = f"{this / base:.2f}" if base else "-"
        print(f"| {key[0]} | {key[1]} | {base:g} | {this:g} | {ratio} |")


if __name__ == "__main__":
    main()
