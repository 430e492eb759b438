"""Peak memory (RSS) of training steps: OffPolicyModule under a Trainer against the bare PyTorch loop.

Each measurement is a fresh child process that imports the same packages, builds the tiny Llama
and the fixed batch of ``benchmarks.pytorch.train_step`` (GRPO, 128 prompts × 4 samples), runs a warm-up
step and ``STEPS`` more, and reports its peak resident set size and its RSS just before the first
step. Separate processes keep the two peaks apart; the figure is the median over ``--repeats``
children of each kind, run alternately. The peak is ``VmHWM`` of /proc/self/status, not
``ru_maxrss``: on Linux ``ru_maxrss`` survives ``exec``, so a child started from a large parent
reports the parent's peak at fork time. OffPolicyModule resets ``VmHWM`` after each step (its
``perf/peak_rss`` metric), so the peak read is ``lit_offpolicy.core.memory.process_peak_rss_bytes``: the
largest ``VmHWM`` of the process across those resets.

    python -m benchmarks.pytorch.memory [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from benchmarks.common import entry, median, process_peak_rss_mib, status_mib
from benchmarks.results import record

STEPS = 3
KINDS = ("ours", "bare")


def child(kind: str) -> dict:
    """Run in a fresh process: warm-up + STEPS training steps of ``kind``; report RSS in MiB."""
    from benchmarks.common import fit_on_fixed_experience, fixed_experience
    from benchmarks.pytorch import bare_loop
    from benchmarks.pytorch.train_step import bare_optimizer, build_module
    from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny_model(f"{tmp}/tiny"))
        exp = fixed_experience(load_tokenizer(model_dir))
        if kind == "ours":
            module = build_module(model_dir, "grpo")
            before = status_mib("VmRSS")
            fit_on_fixed_experience(module, exp, 1 + STEPS, [], tmp)
        else:
            actor = load_actor(model_dir)
            optimizer = bare_optimizer(actor, None)
            before = status_mib("VmRSS")
            for _ in range(1 + STEPS):
                bare_loop.step(actor, optimizer, exp)
    return {"peak_rss_mib": process_peak_rss_mib(), "rss_before_steps_mib": before}


def run_child(kind: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.pytorch.memory", "--child", kind],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(repeats: int = 5) -> list[dict]:
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for index in range(repeats):
        print(f"[memory] child processes {index + 1}/{repeats} (ours, bare)", flush=True)
        for kind in KINDS:
            results[kind].append(run_child(kind))
    peak = {kind: median([r["peak_rss_mib"] for r in results[kind]]) for kind in KINDS}
    before = {kind: median([r["rss_before_steps_mib"] for r in results[kind]]) for kind in KINDS}
    return [
        entry(
            "memory",
            "MiB",
            peak["ours"],
            peak["bare"],
            repeats,
            rss_before_steps_mib={kind: round(value, 1) for kind, value in before.items()},
            workload=f"GRPO update, 512 samples (128 x 4), warm-up + {STEPS} steps, tiny Llama float32",
            what="peak RSS (VmHWM) of a fresh process: Trainer.fit of OffPolicyModule vs the bare loop",
        )
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
    else:
        record(main(args.repeats))
