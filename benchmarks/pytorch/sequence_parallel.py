"""The longest response an update fits in a per-rank memory limit, with the row split across N ranks.

``update.sequence_parallel`` (``lit_offpolicy.training.sequence_parallel``) for N = 1, 2 and 4 CPU ranks
(gloo), one run each: every rank of a run takes one sample of a 64-token prompt and a response of
L tokens (random ids) through the update's policy pass, log-probs and entropy with the chunked head,
then the backward of a loss on both (no gradient checkpointing: the activations are what N divides).
A length fits when every rank's peak RSS (VmHWM, reset before each trial) stays within
``--limit-mib``. Lengths double from 1,024 until one does not fit, then bisect to 256 tokens
(``memory_vs_trl.search_largest``); the ranks agree on each trial (the largest peak of any rank).

Then each N's seconds per update at the same length (N = 1's largest) and the share of them spent in
the exchanges (the all-to-alls of the attention, forward and backward, and the gather of the
log-probs): medians of ``--repeats``. On this machine's 2 cores, 4 ranks share 2 cores: the seconds
show the exchanges' cost, not the speed-up the ranks would give on their own cores.

    python -m benchmarks.pytorch.sequence_parallel [--limit-mib 1024] [--repeats 3] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import MiB, entry, median, timed
from benchmarks.results import record
from lit_offpolicy.rollout.server.process import free_port

PROMPT = 64
SHAPE = "qwen3-sp"
START, MAXIMUM, RESOLUTION = 1024, 65536, 256


def _trial(model, sequence, length: int) -> dict:
    """One update's policy pass at ``length`` response tokens: peak RSS, seconds, exchange seconds."""
    from lit_offpolicy.core.memory import peak_rss_bytes, release_freed_heap, reset_peak_rss
    from lit_offpolicy.training.forward import policy_log_probs

    exp = _sample(length, model.config.vocab_size)
    model.zero_grad(set_to_none=True)
    gc.collect()
    release_freed_heap()
    reset_peak_rss()
    _EXCHANGES["seconds"] = 0.0

    def update():
        log_probs, entropy = policy_log_probs(model, exp, 1.0, True, 256, True, sequence)
        mask = exp.response_mask
        loss = -(log_probs * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
        loss.backward()
        return log_probs, entropy, loss  # freed after the peak is read, outside the timing

    seconds, outputs = timed(update)
    peak = peak_rss_bytes() / MiB
    del outputs
    return {"peak_mib": peak, "seconds": seconds, "exchange_seconds": _EXCHANGES["seconds"]}


def _sample(length: int, vocab: int):
    from lit_offpolicy.core.experience import Experience
    from lit_offpolicy.core.generation import Generation

    generator = torch.Generator().manual_seed(length)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=generator).tolist()
    response = torch.randint(3, vocab, (length,), generator=generator).tolist()
    generation = Generation(response, [0.0] * length, "length")
    return Experience.from_generations([prompt], [[generation]], [0.0], pad_token_id=0, policy_version=0)


_EXCHANGES = {"seconds": 0.0}


def _time_exchanges() -> None:
    """Add the seconds of every exchange (all-to-all, gather) of ``training.sequence_shard``."""
    import lit_offpolicy.training.sequence_shard as sp

    def counted(function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                _EXCHANGES["seconds"] += time.perf_counter() - started

        return wrapper

    sp._all_to_all = counted(sp._all_to_all)
    sp._GatherTokens.forward = staticmethod(counted(sp._GatherTokens.forward))


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one run: the search (or the timing at ``--length``), results as JSON on rank 0."""
    import torch.distributed as dist

    from benchmarks.peers.memory_vs_trl import search_largest
    from lit_offpolicy.core.memory import map_large_blocks
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.training.sequence_parallel import start

    torch.set_num_threads(1)
    map_large_blocks()  # as OffPolicyModule: freed activations go back to the kernel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    model = load_actor(args.model, torch.float32, attn_implementation="sdpa")
    sequence = start(args.world, [model], None, False)  # the module's setup
    _time_exchanges()
    trials: dict[int, dict] = {}

    def agreed(length: int) -> dict:
        result = _trial(model, sequence, length)
        figures = torch.tensor([result["peak_mib"], result["seconds"], result["exchange_seconds"]])
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        return dict(zip(("peak_mib", "seconds", "exchange_seconds"), figures.tolist(), strict=True))

    def fits(length: int) -> bool:
        trials[length] = agreed(length)
        if args.rank == 0:
            print(
                f"{args.world} rank(s): {length} tokens, peak {trials[length]['peak_mib']:.0f} MiB",
                flush=True,
            )
        return trials[length]["peak_mib"] <= args.limit_mib

    if args.length is None:
        largest, failing = search_largest(fits, START, MAXIMUM, RESOLUTION)
        result = {"largest_fitting": largest, "first_failing": failing, "trials": trials}
    else:
        agreed(args.length)  # warm-up
        runs = [agreed(args.length) for _ in range(args.repeats)]
        result = {"length": args.length, "runs": runs}
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _launch(model_dir: str, world: int, args: argparse.Namespace, length: int | None) -> dict:
    """Run ``world`` ranks of this script; rank 0's JSON."""
    port = free_port()
    out = Path(tempfile.mkdtemp()) / "result.json"
    common = ["--model", model_dir, "--world", str(world), "--port", str(port), "--out", str(out)]
    common += ["--limit-mib", str(args.limit_mib), "--repeats", str(args.repeats)]
    common += [] if length is None else ["--length", str(length)]
    command = [sys.executable, "-m", "benchmarks.pytorch.sequence_parallel", "--child", *common]
    ranks = [subprocess.Popen([*command, "--rank", str(rank)]) for rank in range(world)]
    if any(rank.wait() for rank in ranks):
        raise RuntimeError(f"a rank of the {world}-rank run failed")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        rank_main(args)
        return []
    from benchmarks.shapes import SHAPES, build_model

    model_dir = tempfile.mkdtemp()
    build_model(model_dir, SHAPE)
    searches = {world: _launch(model_dir, world, args, None) for world in args.ranks}
    length = searches[1]["largest_fitting"]
    timings = {world: _launch(model_dir, world, args, length) for world in args.ranks}
    seconds = {w: median([run["seconds"] for run in t["runs"]]) for w, t in timings.items()}
    exchange = {w: median([run["exchange_seconds"] for run in t["runs"]]) for w, t in timings.items()}
    shape = SHAPES[SHAPE]
    workload = (
        f"one sample, a {PROMPT}-token prompt + L response tokens: log-probs and entropy (chunked head), "
        f"then the backward; {SHAPE} ({shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']} heads, float32, random weights), no gradient checkpointing, CPU"
    )
    largest = {w: searches[w]["largest_fitting"] for w in args.ranks}
    entries = [
        entry(
            f"max_response_len_sp{world}",
            "tokens",
            largest[world],
            largest[1],
            1,
            threads=1,
            **({"target": 1.7} if world == 2 else {}),
            baseline_is="the same pass on one rank (update.sequence_parallel=1)",
            limit_mib=args.limit_mib,
            workload=workload,
            what=f"largest L whose pass fits every rank's peak RSS in {args.limit_mib} MiB, {world} ranks",
            first_failing=searches[world]["first_failing"],
            trials={
                str(k): v for k, v in sorted(searches[world]["trials"].items(), key=lambda kv: int(kv[0]))
            },
            command="python -m benchmarks.pytorch.sequence_parallel",
        )
        for world in args.ranks
        if world > 1
    ]
    entries.append(
        entry(
            "seconds_per_update_sp",
            "s",
            seconds[max(args.ranks)],
            seconds[1],
            args.repeats,
            threads=1,
            baseline_is="the same pass on one rank",
            length=length,
            seconds={str(w): round(s, 3) for w, s in seconds.items()},
            exchange_share={str(w): round(exchange[w] / seconds[w], 3) for w in args.ranks if w > 1},
            workload=workload.replace("L response", f"{length} response"),
            what="median seconds of the pass on the slowest rank; ours: the most ranks; exchange_share: the "
            f"all-to-alls and the gather's part of it ({os.cpu_count()} cores shared by all ranks)",
            command="python -m benchmarks.pytorch.sequence_parallel",
        )
    )
    record(entries)
    return entries


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-mib", type=float, default=1024.0, help="each rank's peak RSS limit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--port", "--length"):
        parser.add_argument(name, type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
