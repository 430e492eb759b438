"""Where the suite's time goes: per-file seconds from the JUnit report that ``make test`` writes.

    python -m tests.durations [outputs/test-report.xml] [--tests N]

Prints a Markdown table, the files by worker-seconds (setup, call and teardown of their tests, summed
over the xdist workers that ran them), most first, with each file's count of tests and its slowest test;
then the N slowest tests. docs/testing.md's tables are this output of one `make test`.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

DEFAULT_REPORT = Path("outputs") / "test-report.xml"


def seconds_by_test(report: Path) -> dict[str, float]:
    """``file::test`` -> seconds, from a JUnit XML report (pytest's ``--junitxml``)."""
    seconds = {}
    for case in ElementTree.parse(report).iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        path = module.replace(".", "/") + ".py"
        seconds[f"{path}::{name}"] = float(case.get("time", 0.0))
    return seconds


def tables(seconds: dict[str, float], slowest: int) -> str:
    """The per-file table, then the slowest tests'."""
    by_file: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for test, time in seconds.items():
        path, _, name = test.partition("::")
        by_file[path].append((time, name))
    total = sum(seconds.values())
    lines = ["| file | tests | seconds | share | slowest test (s) |", "|---|---:|---:|---:|---|"]
    for path, cases in sorted(by_file.items(), key=lambda item: -sum(t for t, _ in item[1])):
        spent, (worst, name) = sum(t for t, _ in cases), max(cases)
        lines.append(f"| {path} | {len(cases)} | {spent:.0f} | {spent / total:.0%} | {name} ({worst:.0f}) |")
    lines += ["", f"{len(seconds)} tests, {total:.0f} worker-seconds", ""]
    lines += ["| test | seconds |", "|---|---:|"]
    for test, time in sorted(seconds.items(), key=lambda item: -item[1])[:slowest]:
        lines.append(f"| {test} | {time:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durations", description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", type=Path, default=DEFAULT_REPORT, help="JUnit XML of a run")
    parser.add_argument("--tests", type=int, default=25, help="how many of the slowest tests to list")
    options = parser.parse_args(argv)
    if not options.report.is_file():
        print(f"no report at {options.report}: `make test` writes it (pytest --junitxml)", file=sys.stderr)
        return 2
    print(tables(seconds_by_test(options.report), options.tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
