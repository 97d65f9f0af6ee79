"""The summary ``scripts/gpu-check`` prints at the end: what ran, passed and was skipped.

Usage: ``python scripts/gpu-summary.py JUNIT_XML UNRUNNABLE``. ``JUNIT_XML`` is pytest's report
(``--junitxml``, ``junit_family=xunit1`` so that recorded properties are kept; it may be
missing when no test file could run); ``UNRUNNABLE`` lists, one per line, a test file that was
not run and the module its imports lacked, separated by a tab. Prints one line per test file
(counts, and why tests were skipped), the properties the tests recorded (the time-to-first-token
figures), the files not run, and a last line ``gpu-check: N passed, N failed, N skipped``.
Exits 1 when a test failed or errored, else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped")


def outcome(case: ET.Element) -> str:
    """``passed``, ``failed`` (a failure or an error) or ``skipped``, from a ``testcase`` element."""
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if case.find("skipped") is not None else "passed"


def test_file(case: ET.Element) -> str:
    """The test file of a ``testcase`` (``tests.tiers.test_x`` -> ``tests/tiers/test_x.py``)."""
    return case.get("file") or case.get("classname", "?").replace(".", "/") + ".py"


def summarise(report: Path, unrunnable: Path) -> tuple[list[str], Counter[str]]:
    """The summary's lines and the counts of each outcome."""
    counts: Counter[str] = Counter()
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    reasons: dict[str, Counter[str]] = defaultdict(Counter)
    properties: list[str] = []
    cases = ET.parse(report).getroot().iter("testcase") if report.is_file() else iter(())
    for case in cases:
        name, result = test_file(case), outcome(case)
        counts[result] += 1
        per_file[name][result] += 1
        skipped = case.find("skipped")
        if skipped is not None:
            reasons[name][(skipped.get("message") or "").removeprefix("Skipped: ")] += 1
        properties += [f"  {case.get('name')}: {p.get('name')} = {p.get('value')}" for p in case.iter("property")]
    lines = ["summary of the gpu tests:"]
    for name in sorted(per_file):
        shown = ", ".join(f"{per_file[name][o]} {o}" for o in OUTCOMES if per_file[name][o])
        lines.append(f"  {name}: {shown}")
        lines += [f"      skipped {n}: {reason}" for reason, n in sorted(reasons[name].items())]
    for line in unrunnable.read_text().splitlines() if unrunnable.is_file() else []:
        name, _, missing = line.partition("\t")
        lines.append(f"  {name}: not run (its imports need {missing}, which is not installed)")
    if properties:
        lines += ["measured:", *properties]
    return lines, counts


def main() -> int:
    lines, counts = summarise(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(lines))
    print("gpu-check: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
