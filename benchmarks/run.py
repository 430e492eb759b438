"""``make bench``: run every benchmark, write benchmarks/results.json, docs/benchmarks.md's table, the plot.

Figures only, never a test: nothing here fails on a slow machine. A benchmark that raises is reported
and the others still run (the exit status is then 1). Register a new benchmark by adding one line to
``BENCHMARKS``: the module's ``main(**kwargs)`` returns its results.json entries.

    python -m benchmarks.run [--quick] [--only train_step memory ...]
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from benchmarks import plot, results_table  # noqa: E402
from benchmarks.results import record  # noqa: E402


@dataclass(frozen=True)
class Benchmark:
    name: str
    module: str
    kwargs: dict = field(default_factory=dict)
    quick: dict = field(default_factory=dict)  # overrides for --quick: a smoke run, not figures


BENCHMARKS = [
    Benchmark("train_step", "benchmarks.pytorch.train_step", {"repeats": 5}, {"repeats": 2}),
    Benchmark("loss_overhead", "benchmarks.pytorch.loss_overhead", {"repeats": 5}, {"repeats": 2}),
    Benchmark("memory", "benchmarks.pytorch.memory", {"repeats": 5}, {"repeats": 1}),
    Benchmark(  # one process per side and variant: ours (each memory option off in turn) and TRL's
        "memory_vs_trl",
        "benchmarks.peers.memory_vs_trl",
        {"argv": []},
        {"argv": ["--response-length", "32", "--variants", "ours"]},
    ),
    Benchmark("weight_sync", "benchmarks.engines.weight_sync", {"repeats": 3}, {"repeats": 1}),
    Benchmark(  # 1, 2 and 4 gloo ranks, a run each
        "sequence_parallel",
        "benchmarks.pytorch.sequence_parallel",
        {"argv": []},
        {"argv": ["--ranks", "1", "2", "--limit-mib", "800", "--repeats", "1"]},
    ),
    Benchmark(  # one process per side: ours packed, ours padded, TRL's (issue 17)
        "update_throughput_vs_trl",
        "benchmarks.peers.update_throughput_vs_trl",
        {"argv": []},
        {"argv": ["--quick"]},
    ),
    Benchmark(  # per-sample attention against the masked packed row (issue 17)
        "packed_attention",
        "benchmarks.pytorch.packed_attention",
        {"repeats": 5},
        {"repeats": 1, "budget": 1024},
    ),
    Benchmark(  # each prompt once for its n samples against a row per sample (issue 60)
        "shared_prefix", "benchmarks.pytorch.shared_prefix", {"repeats": 5}, {"repeats": 1}
    ),
    Benchmark(  # compile: true against eager, tiny Llama and the Qwen3 shape (issue 17)
        "compile_step", "benchmarks.pytorch.compile_step", {"steps": 8}, {"steps": 4, "workloads": ("tiny",)}
    ),
    Benchmark("rollout_vllm", "benchmarks.engines.rollout_vllm", {"repeats": 5}, {"repeats": 2}),
    Benchmark(  # generation through the agents' endpoint against the same prompts to the engine (issue 57)
        "agent_endpoint",
        "benchmarks.engines.agent_endpoint",
        {"repeats": 5},
        {"repeats": 1, "max_tokens": (16,)},
    ),
    Benchmark(  # generation through vllm serve, the weight push, async training on servers (issue 34)
        "rollout_servers",
        "benchmarks.engines.rollout_servers",
        {"repeats": 5, "steps": 20},
        {"repeats": 2, "steps": 6},
    ),
    Benchmark("end_to_end_trl", "benchmarks.peers.end_to_end_trl", {"steps": 30}, {"steps": 3}),
    Benchmark(  # each stage's MFU and tokens/s in a GRPO fit at the Qwen3 shape (issue 35)
        "stage_mfu", "benchmarks.machine.stage_mfu", {}, {"steps": 2, "prompts": 1, "max_tokens": 8}
    ),
    Benchmark(  # whole GRPO steps against TRL's GRPOTrainer at the Qwen3 shape (issue 35)
        "end_to_end_qwen", "benchmarks.peers.end_to_end_qwen", {"steps": 4}, {"steps": 2, "quick": True}
    ),
    Benchmark(  # RSS, descriptors, threads, children and the event file over 2,000 + 1,000 steps (issue 37)
        "soak", "benchmarks.learning.soak", {"quick": False}, {"quick": True}
    ),
    Benchmark(  # server processes SIGKILLed again and again: every one comes back, the run learns (issue 59)
        "server_faults", "benchmarks.learning.server_faults", {"argv": []}, {"argv": ["--quick"]}
    ),
    Benchmark(  # CodeExecutionReward, harness vs a sandbox run per test, real problems (issue 48)
        "code_harness", "benchmarks.engines.code_harness", {"repeats": 3}, {"repeats": 1, "apps": 2}
    ),
    Benchmark(  # on-policy distillation against RL alone from the demo's warm-up (issue 36)
        "distill_vs_rl",
        "benchmarks.learning.distill_vs_rl",
        {"seeds": [0, 1, 2], "steps": 200, "teacher_steps": 500},
        {"seeds": [0], "steps": 10, "teacher_steps": 10, "quick": True},
    ),
    Benchmark(
        "async_vs_sync",
        "benchmarks.learning.async_vs_sync",
        {"argv": ["--no-record"]},
        {"argv": ["--max-steps", "3", "--no-record"]},
    ),
    Benchmark(  # the same with configs/async.yaml's correction
        "async_vs_sync_seq_is_rs",
        "benchmarks.learning.async_vs_sync",
        {"argv": ["--rollout-correction", "seq_is_rs", "--no-record"]},
        {"argv": ["--rollout-correction", "seq_is_rs", "--max-steps", "3", "--no-record"]},
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewest repeats/steps: checks that all runs")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARKS], help="run these only")
    args = parser.parse_args(argv)
    failed = []
    started = time.perf_counter()
    for bench in BENCHMARKS:
        if args.only and bench.name not in args.only:
            continue
        kwargs = {**bench.kwargs, **(bench.quick if args.quick else {})}
        print(f"\n=== {bench.name} {kwargs} (at {time.perf_counter() - started:.0f} s)", flush=True)
        try:
            record(importlib.import_module(bench.module).main(**kwargs))
        except Exception:
            traceback.print_exc()
            failed.append(bench.name)
    results_table.main()
    plot.main()
    print(f"\n=== benchmarks done in {time.perf_counter() - started:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
