"""Write docs/benchmarks.md's table from benchmarks/results.json (between two marker comments).

python -m benchmarks.results_table
"""

from __future__ import annotations

import json
import re

from benchmarks import REPO
from benchmarks.results import RESULTS

PAGE = REPO / "docs" / "benchmarks.md"
START, END = "<!-- benchmarks:start (benchmarks/results_table.py) -->", "<!-- benchmarks:end -->"


def number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) >= 0.01 else f"{value:.2g}"


def notes(entry: dict) -> str:
    parts = []
    if "target" in entry:
        met = entry["ratio"] is not None and entry["ratio"] >= entry["target"]
        parts.append(f"target ≥ {entry['target']:g} ({'met' if met else 'not met'})")
    if "goal" in entry:
        parts.append(f"goal: {entry['goal']} ({'met' if entry.get('goal_met') else 'not met'})")
    if "fraction" in entry:
        parts.append(f"{100 * entry['fraction']:.2g}% of a step")
    if entry.get("lower_bound"):
        parts.append(f"lower bound: {' and '.join(entry['lower_bound'])} fit at every length tried")
    if "standard_error" in entry:
        parts.append(f"± {entry['standard_error']:.2g} (1 s.e.)")
    if "seconds_per_gb" in entry:
        parts.append(f"{entry['seconds_per_gb']:.3g} s/GB")
    if "overlap_efficiency" in entry:
        parts.append(f"overlap efficiency {entry['overlap_efficiency']:.3g} (step / max(generation, update))")
    if "baseline_is" in entry:
        parts.append(f"baseline: {entry['baseline_is']}")
    if entry.get("baseline_at_least"):
        parts.append("baseline killed at the memory limit: at least this")
    if "val_accuracy_before_rl" in entry:
        parts.append(f"before RL {entry['val_accuracy_before_rl']:.3f}")
    return "; ".join(parts)


def device(machine: str) -> str:
    """The device of a figure, from its entry's ``machine`` line (``benchmarks.common.machine``): the
    GPU where it names one, else the CPU's core count."""
    found = re.match(r"\S+ (\d+) CPUs(?:, (.+?))?, torch ", machine)
    if found is None:
        return machine
    return found.group(2) or f"CPU, {found.group(1)} cores"


def table(entries: list[dict]) -> str:
    machines = sorted({entry["machine"] for entry in entries})
    lines = [
        "| entry | device | unit | ours | baseline | ratio | repeats | notes |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for e in entries:
        row = [f"`{e['name']}`", device(e["machine"]), e["unit"], number(e["ours"]), number(e["baseline"])]
        row += [number(e["ratio"]), str(e["repeats"]), notes(e)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Measured on: " + "; ".join(f"`{m}`" for m in machines) + "."]
    return "\n".join(lines)


def main() -> None:
    entries = json.loads(RESULTS.read_text())
    text = PAGE.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{PAGE.name} has no {START} ... {END} block to fill")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{START}\n{table(entries)}\n{END}{tail}")
    print(f"{PAGE}: benchmark table of {len(entries)} entries")


if __name__ == "__main__":
    main()
