"""benchmarks/results.json: the entries of the latest run of each benchmark, merged by name."""

from __future__ import annotations

import json
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
