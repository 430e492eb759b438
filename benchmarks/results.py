"""benchmarks/results.json: the entries of the latest run of each benchmark, merged by name; the command
lines that record them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).with_name("results.json")


def record(entries: list[dict]) -> None:
    """Replace the entries of the same names in results.json (others are kept) and print them."""
    existing = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    names = {entry["name"] for entry in entries}
    merged = [entry for entry in existing if entry["name"] not in names] + entries
    RESULTS.write_text(json.dumps(merged, indent=2) + "\n")
    for entry in entries:
        print(json.dumps(entry))


def record_or_print(entries: list[dict], print_only: bool, indent: int | None = None) -> None:
    """``record`` the entries, or (``--no-record``: ``print_only``) only print each as JSON."""
    if print_only:
        for entry in entries:
            print(json.dumps(entry, indent=indent))
    else:
        record(entries)


def repeats_main(main: Callable[[int], list[dict]], doc: str, default: int = 5) -> None:
    """The command line of a benchmark whose one option is ``--repeats``: ``record`` what ``main`` returns."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=default)
    record(main(parser.parse_args().repeats))
