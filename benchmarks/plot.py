"""Draw docs/images/benchmarks.png from benchmarks/results.json: ratios against their targets (green:
met, red: not, grey: no target), and the shares of a step that loss computation and weight sync take.

    python -m benchmarks.plot
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import REPO
from benchmarks.results import RESULTS

PLOT = REPO / "docs" / "images" / "benchmarks.png"


def main(path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = json.loads(RESULTS.read_text())
    compared = [e for e in entries if "fraction" not in e and e["ratio"] is not None]
    shares = [e for e in entries if "fraction" in e]
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(11, 0.5 * max(len(compared), len(shares), 4) + 1.5), width_ratios=(3, 2)
    )
    names = [e["name"] for e in compared]
    ratios = [e["ratio"] for e in compared]
    colors = [
        "tab:grey" if "target" not in e else "tab:green" if e["ratio"] >= e["target"] else "tab:red"
        for e in compared
    ]
    left.barh(names, ratios, color=colors)
    for row, e in enumerate(compared):
        if "target" in e:
            left.plot([e["target"]] * 2, [row - 0.4, row + 0.4], color="black", linewidth=2)
        left.text(e["ratio"], row, f" {e['ratio']:.2f}", va="center")
    left.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="ratio vs baseline (higher is better for us; black tick: target)")
    left.invert_yaxis()
    right.barh([e["name"] for e in shares], [100 * e["fraction"] for e in shares], color="tab:blue")
    for row, e in enumerate(shares):
        right.text(100 * e["fraction"], row, f" {100 * e['fraction']:.2g}%", va="center")
    right.set(xlabel="% of one step (lower is better)")
    right.invert_yaxis()
    fig.suptitle("lit-offpolicy benchmarks (benchmarks/results.json)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
