"""Update throughput at real lengths against TRL's ``GRPOTrainer``: response tokens per second.

One GRPO update (prepare + update: π_old read off the update's forward, PPO clip, token-mean, no KL,
one optimizer step) on a fixed batch of ``PROMPTS`` prompts × ``GROUP`` samples whose response
lengths are drawn, seeded, uniformly between ``--min-response`` and ``--max-response`` tokens
(prompts: ``--prompt-length`` / 2 .. ``--prompt-length`` tokens), on benchmarks/peers/memory_vs_trl.py's
Qwen3-shaped model (180M parameters, 151,936-token vocabulary, random weights, float32), CPU.
Each side runs in a fresh process, ``--steps`` updates of the same batch; the figure is the
response tokens of the batch over the median update's seconds (the time between the ends of two
consecutive optimizer steps, the first from the start of training). Gradient checkpointing is off
on both sides; each bounds a micro-batch to ``MICRO`` samples' worth of padded tokens:

- ours: ``padding_free`` and ``update.max_tokens_per_micro_batch`` = ``MICRO`` × (prompt width +
  response width), the default 256-token LM-head chunks;
- ours_padded: the same module with ``update.micro_batch_size`` = ``MICRO`` on the padded batch;
- TRL: ``GRPOTrainer.train`` (``loss_type="dapo"`` = token-mean, ``beta=0``, one iteration),
  ``per_device_train_batch_size`` = ``MICRO`` with ``gradient_accumulation_steps`` = B / ``MICRO``
  (one optimizer step per generation batch), generation replaced by the same batch. TRL 1.16's
  GRPOTrainer has no padding-free option.

    python -m benchmarks.peers.update_throughput_vs_trl [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO, repo_env
from benchmarks.common import as_experience, entry, median, timed
from benchmarks.peers.end_to_end_trl import BENCH_PYTHON, OFFLINE, require_trl_python
from benchmarks.results import record_or_print
from benchmarks.shapes import SHAPES, build_in_child

SHAPE = "qwen3-180m"
PROMPTS, GROUP, MICRO = 8, 8, 8
PROMPT_LENGTH, MIN_RESPONSE, MAX_RESPONSE = 64, 16, 512
STEPS = 3
SIDES = ("ours", "ours_padded", "trl")
LR = 1e-6
NAME = "update_throughput_vs_trl_qwen_shaped"


def fixed_batch(args: argparse.Namespace, vocab: int, seed: int = 0) -> dict:
    """Left-padded prompts (one per group), responses of seeded uniform lengths in [min, max] right-
    padded to ``--max-response`` (the engine's max tokens), random scores, GRPO advantages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    batch = args.prompts * GROUP
    prompt_lengths = torch.randint(
        args.prompt_length // 2, args.prompt_length + 1, (args.prompts,), generator=g
    )
    prompt_lengths = prompt_lengths.repeat_interleave(GROUP)
    response_lengths = torch.randint(args.min_response, args.max_response + 1, (batch,), generator=g)
    prompt_mask = (
        torch.arange(args.prompt_length)[None, :] >= args.prompt_length - prompt_lengths[:, None]
    ).long()
    response_mask = (torch.arange(args.max_response)[None, :] < response_lengths[:, None]).long()
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_length), generator=g).repeat_interleave(
        GROUP, 0
    )
    responses = torch.randint(1, vocab, (batch, args.max_response), generator=g)
    scores = torch.rand(batch, generator=g)
    grouped = scores.view(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    return {
        "prompt_ids": prompts * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": responses * response_mask,
        "response_mask": response_mask,
        "rollout_log_probs": (-2.0 - torch.rand(batch, args.max_response, generator=g)) * response_mask,
        "scores": scores,
        "group_ids": torch.arange(batch) // GROUP,
        "advantages": advantages,
    }


def ours_options(kind: str, args: argparse.Namespace) -> dict:
    from lit_offpolicy.training.options import UpdateOptions

    if kind == "ours_padded":
        return {"update": UpdateOptions(micro_batch_size=MICRO)}
    budget = MICRO * (args.prompt_length + args.max_response)
    return {"padding_free": True, "update": UpdateOptions(max_tokens_per_micro_batch=budget)}


def run_ours(kind: str, args: argparse.Namespace) -> dict:
    from benchmarks.common import StepTimer, fit_on_fixed_experience
    from benchmarks.step_profile import Regions, install_ours
    from lit_offpolicy import OffPolicyModule
    from lit_offpolicy.advantages import GRPO
    from lit_offpolicy.losses import PPO
    from lit_offpolicy.training.options import OptimOptions

    exp = as_experience(fixed_batch(args, SHAPES[SHAPE]["vocab_size"]))
    module = OffPolicyModule(
        args.model,
        policy_loss=PPO(pg_clip=0.2, loss_agg_mode="token-mean"),
        advantage=GRPO(norm_by_std=True),
        optim=OptimOptions(lr=LR),
        gradient_checkpointing=False,
        **ours_options(kind, args),
    )
    regions = Regions()
    install_ours(regions)
    timer = StepTimer(after_step=lambda: regions.end_step(timer.seconds[-1]))
    with tempfile.TemporaryDirectory() as root:
        fit_on_fixed_experience(module, exp, args.steps, [timer], root)
    return {"seconds": timer.seconds, "profile": regions.medians(skip_first=0)}


def run_trl(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.peers.trl_side import StepTimer, fixed_batch_trainer, grpo_config
    from benchmarks.step_profile import Regions, install_trl
    from lit_offpolicy.models import load_actor, load_tokenizer

    data = fixed_batch(args, SHAPES[SHAPE]["vocab_size"])
    batch = len(data["scores"])
    config = grpo_config(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=batch // MICRO,
        num_generations=GROUP,
        max_completion_length=args.max_response,
        learning_rate=LR,
        epsilon=0.2,
        max_steps=args.steps,
        logging_steps=1,
    )
    regions = Regions()
    install_trl(regions)
    timer = StepTimer(regions)
    trainer = fixed_batch_trainer(
        data,
        model=load_actor(args.model, dtype=torch.float32),
        args=config,
        processing_class=load_tokenizer(args.model),
        callbacks=[timer],
    )
    trainer.train()
    return {"seconds": timer.seconds, "profile": regions.medians(skip_first=0)}


def spawn(kind: str, args: argparse.Namespace) -> dict:
    """``kind`` in a fresh process (TRL's with ``--trl-python``): its update seconds, and their median
    split over the step's regions (``benchmarks.step_profile``)."""
    python = args.trl_python if kind == "trl" else sys.executable
    command = [
        python,
        "-m",
        "benchmarks.peers.update_throughput_vs_trl",
        "--child",
        kind,
        "--model",
        args.model,
    ]
    command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
    command += ["--prompt-length", str(args.prompt_length), "--min-response", str(args.min_response)]
    command += ["--max-response", str(args.max_response)]

    def run() -> dict:
        process = subprocess.run(command, capture_output=True, text=True, env=repo_env(**OFFLINE), cwd=REPO)
        if process.returncode != 0:
            raise RuntimeError(f"{kind} failed with status {process.returncode}:\n{process.stderr[-3000:]}")
        return json.loads(process.stdout.strip().splitlines()[-1])

    seconds, result = timed(run)
    return {
        "step_seconds": [round(s, 2) for s in result["seconds"]],
        "process_seconds": round(seconds),
        "profile": result["profile"],
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv or [])
    require_trl_python(args.trl_python)
    data = fixed_batch(args, SHAPES[SHAPE]["vocab_size"])
    response_tokens = int(data["response_mask"].sum())
    padded_tokens = data["response_mask"].numel() + data["prompt_mask"].numel()
    real_tokens = response_tokens + int(data["prompt_mask"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        args.model = str(Path(tmp) / SHAPE)
        build_in_child(args.model, SHAPE)
        sides = {}
        for kind in args.sides:
            print(
                f"[update_throughput_vs_trl] {kind}: {args.prompts}x{GROUP} samples, {args.steps} updates",
                flush=True,
            )
            sides[kind] = spawn(kind, args)
            print(f"[update_throughput_vs_trl] {kind}: {json.dumps(sides[kind])}", flush=True)
    rate = {kind: response_tokens / median(side["step_seconds"]) for kind, side in sides.items()}
    workload = (
        f"one GRPO update of {args.prompts} prompts x {GROUP} samples, prompts of "
        f"{args.prompt_length // 2}..{args.prompt_length} tokens, responses of "
        f"{args.min_response}..{args.max_response} tokens (seeded uniform): "
        f"{response_tokens} response tokens, {real_tokens} real of {padded_tokens} padded tokens; {SHAPE} "
        f"(float32, random weights), no gradient checkpointing, cpu"
    )
    trl_version = _trl_version(args.trl_python)
    common = {
        "workload": workload,
        "what": "response tokens / median seconds of an update (fresh process per side)",
        "sides": sides,
        "baseline_is": f"trl {trl_version} GRPOTrainer, micro-batches of {MICRO}",
    }
    budget = MICRO * (args.prompt_length + args.max_response)
    entries = []
    if "ours" in sides:
        entries.append(
            entry(
                NAME,
                "tokens/s",
                rate["ours"],
                rate["trl"],
                args.steps,
                target=1.5,
                ours_options=f"padding_free=True, update.max_tokens_per_micro_batch={budget}",
                **common,
            )
        )
    if "ours_padded" in sides:
        entries.append(
            entry(
                f"{NAME}_padded",
                "tokens/s",
                rate["ours_padded"],
                rate["trl"],
                args.steps,
                ours_options=f"padding_free=False, update.micro_batch_size={MICRO}",
                **common,
            )
        )
    return entries


def _trl_version(python: str) -> str:
    result = subprocess.run(
        [python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
    )
    return result.stdout.strip()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 prompts, responses of 16..64 tokens, 2 updates"
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--prompt-length", type=int, default=PROMPT_LENGTH)
    parser.add_argument("--min-response", type=int, default=MIN_RESPONSE)
    parser.add_argument("--max-response", type=int, default=MAX_RESPONSE)
    default_trl = BENCH_PYTHON if BENCH_PYTHON.exists() else Path(sys.executable)
    parser.add_argument(
        "--trl-python", default=str(default_trl), help="an interpreter with trl (.venv-bench)"
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=list(SIDES),
        help="which sides to run (TRL's always): an entry per side of ours that ran",
    )
    parser.add_argument("--no-record", action="store_true", help="print the entries, leave results.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sides = [side for side in SIDES if side in args.sides or side == "trl"]
    if args.quick:
        args.prompts, args.max_response, args.steps = 2, 64, 2
    return args


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.child:
        import torch

        torch.manual_seed(0)
        kind = arguments.child
        print(json.dumps(run_trl(arguments) if kind == "trl" else run_ours(kind, arguments)))
    else:
        record_or_print(main(sys.argv[1:]), arguments.no_record)
