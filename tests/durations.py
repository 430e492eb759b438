"""Where the suite's time goes: per-file seconds from the JUnit report that ``make test`` writes.

    python -m tests.durations [outputs/test-report.xml] [--tests N]

Prints a Markdown table, the files by worker-seconds (setup, call and teardown of their tests, summed
over the xdist workers that ran them), most first, with each file's count of tests, its CPU seconds
(its tests' own and those of the processes they started and reaped: tests/conftest.py's
``cpu_seconds``; processes it did not reap, as SLURM's tasks, are left out) and its slowest test; then
the N slowest tests. A test's wall seconds include waiting for its neighbour's processes; the whole
machine's CPU seconds over a run are the ``machine:`` line pytest prints at its end.
docs/testing.md's tables are this output of one `make test`.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

DEFAULT_REPORT = Path("outputs") / "test-report.xml"


def seconds_by_test(report: Path) -> dict[str, tuple[float, float]]:
    """``file::test`` -> (wall seconds, CPU seconds; 0 where the report has none), from a JUnit XML
    report (pytest's ``--junitxml``)."""
    seconds = {}
    for case in ElementTree.parse(report).iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        path = module.replace(".", "/") + ".py"
        cpu = [float(p.get("value", 0)) for p in case.iter("property") if p.get("name") == "cpu_seconds"]
        seconds[f"{path}::{name}"] = (float(case.get("time", 0.0)), sum(cpu))
    return seconds


def tables(seconds: dict[str, tuple[float, float]], slowest: int) -> str:
    """The per-file table, then the slowest tests'."""
    by_file: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for test, (wall, cpu) in seconds.items():
        path, _, name = test.partition("::")
        by_file[path].append((wall, cpu, name))
    total = sum(wall for wall, _ in seconds.values())
    total_cpu = sum(cpu for _, cpu in seconds.values())
    lines = ["| file | tests | seconds | share | CPU s | slowest test (s) |", "|---|---:|---:|---:|---:|---|"]
    for path, cases in sorted(by_file.items(), key=lambda item: -sum(t for t, _, _ in item[1])):
        spent, cpu = sum(t for t, _, _ in cases), sum(c for _, c, _ in cases)
        worst, _, name = max(cases)
        share = f"{spent / total:.0%}" if total else "-"
        lines.append(f"| {path} | {len(cases)} | {spent:.0f} | {share} | {cpu:.0f} | {name} ({worst:.0f}) |")
    lines += ["", f"{len(seconds)} tests, {total:.0f} worker-seconds, {total_cpu:.0f} CPU seconds", ""]
    lines += ["| test | seconds | CPU s |", "|---|---:|---:|"]
    for test, (wall, cpu) in sorted(seconds.items(), key=lambda item: -item[1][0])[:slowest]:
        lines.append(f"| {test} | {wall:.0f} | {cpu:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.durations",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("report", nargs="?", type=Path, default=DEFAULT_REPORT, help="JUnit XML of a run")
    parser.add_argument("--tests", type=count, default=25, help="how many of the slowest tests to list")
    options = parser.parse_args(argv)
    if not options.report.is_file():
        print(f"no report at {options.report}: `make test` writes it (pytest --junitxml)", file=sys.stderr)
        return 2
    try:
        seconds = seconds_by_test(options.report)
    except (ElementTree.ParseError, ValueError) as error:
        print(f"{options.report} is not a JUnit XML report ({error})", file=sys.stderr)
        return 2
    print(tables(seconds, options.tests))
    return 0


def count(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: allowed values: a whole number of at least 0")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
