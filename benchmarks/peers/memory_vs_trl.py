"""Peak memory of RL updates, ours against TRL's ``GRPOTrainer``, on a Qwen-shaped model (real vocabulary).

The model is built here with random weights (``SHAPES``): on the CPU (the ``make bench`` entry) a
Qwen3 of 180M parameters (151,936-token vocabulary, hidden 512, 8 layers, untied embeddings),
float32; on CUDA (``--device cuda``) Qwen2.5-1.5B's shape in bfloat16. Both sides run ``UPDATES`` = 2
updates on the same batch (``fixed_batch``: B sequences of left-padded random prompts and random
responses of up to R tokens, GRPO advantages over pairs), each side in a fresh process that builds
nothing else. Two, because the first update allocates AdamW's state only at its optimizer step,
after its activations are gone; the second holds that state through its forward and backward, as
every later step of a run does.

- ours: ``Trainer.fit`` of OffPolicyModule (prepare + update; GRPO, PPO clip, token-mean, no KL,
  π_old read off the update's forward), with the memory options of a variant (``VARIANTS``:
  gradient checkpointing and chunked log-probs (the default 256-token chunks) on, smaller chunks,
  then each off, then both off; a variant whose option this build lacks is reported as skipped);
- TRL: ``GRPOTrainer.train`` (``benchmarks/peers/trl_grpo.py``'s settings: loss ``dapo`` = token-mean, no
  KL, one iteration so π_old = π_θ detached), with ``gradient_checkpointing=True`` and the
  generation replaced by the same batch (``_generate_and_score_completions`` returns it). TRL's
  log-probs always go through its fused LM head (vocabulary tiles with an online log-sum-exp), which
  it has no switch for. Its other memory options: ``per_device_train_batch_size`` with
  ``steps_per_generation`` (micro-batches; ours: ``update.micro_batch_size``; both off here, the whole
  batch at once), PEFT/LoRA, ``cast_lm_head_to_fp32`` (more memory, not less), Liger kernels
  (deprecated, Triton GPUs) and DeepSpeed/FSDP offload (GPUs).

The figure is the process's peak: on the CPU its resident set (``VmHWM``, benchmarks.pytorch.memory), which
includes the Python packages each side imports (``rss_before_update_mib`` shows where each started);
on CUDA ``torch.cuda.max_memory_allocated``. A parent watchdog kills a CPU child whose RSS passes
``--rss-limit-gib`` and reports it as not fitting. ``--find-max`` searches, for ours and for TRL, the
largest response length that fits (doubling from ``--response-length``, then bisection to
``--resolution`` tokens, every trial a fresh process). Each entry is printed as one JSON line.

    python -m benchmarks.peers.memory_vs_trl                         # CPU, the make-bench entry
    python -m benchmarks.peers.memory_vs_trl --device cuda           # Qwen2.5-1.5B shape, bf16, one GPU
    python -m benchmarks.peers.memory_vs_trl --device cuda --find-max [--gpu-memory-gib 80]
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO, repo_env
from benchmarks.common import MiB, as_experience, entry, process_peak_rss_mib, status_mib, timed
from benchmarks.peers.end_to_end_trl import BENCH_PYTHON, OFFLINE, require_trl_python
from benchmarks.results import record_or_print
from benchmarks.shapes import SHAPES, build_in_child

DEFAULT_SHAPE = {"cpu": "qwen3-180m", "cuda": "qwen2.5-1.5b"}
ENTRY_NAME = {"cpu": "memory_vs_trl_qwen_shaped", "cuda": "memory_vs_trl_qwen25_1p5b_cuda"}
MAX_LENGTH_ENTRY_NAME = {
    "cpu": "max_response_len_vs_trl_qwen_shaped",
    "cuda": "max_response_len_vs_trl_qwen25_1p5b_cuda",
}
CHUNK = 256  # logprob_chunk_size: the module's default
# name -> OffPolicyModule options; "ours" is the one compared with TRL. Add a line for a new variant.
VARIANTS = {
    "ours": {"gradient_checkpointing": True, "logprob_chunk_size": CHUNK},
    "chunks_of_64": {"gradient_checkpointing": True, "logprob_chunk_size": 64},
    "no_checkpointing": {"gradient_checkpointing": False, "logprob_chunk_size": CHUNK},
    "no_chunks": {"gradient_checkpointing": True, "logprob_chunk_size": None},
    "neither": {"gradient_checkpointing": False, "logprob_chunk_size": None},
    "lora_r16": {  # runs where OffPolicyModule has the `lora` option (issue 16, item 3)
        "gradient_checkpointing": True,
        "logprob_chunk_size": CHUNK,
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
    },
}
BATCH, PROMPT_LENGTH, RESPONSE_LENGTH, GROUP = 8, 64, 512, 2
UPDATES = 2  # the second runs its forward and backward with AdamW's state allocated: a run's steady peak
LR = 1e-6


# ----------------------------------------------------------------------------- the model and the batch


def fixed_batch(batch: int, prompt_length: int, response_length: int, vocab: int, seed: int = 0) -> dict:
    """The update's batch as tensors: left-padded prompts of ``prompt_length`` / 2 .. ``prompt_length``
    tokens, responses of 3/4 .. 1 × ``response_length`` tokens (the first at full length) right-padded,
    pad id 0, random scores, group ids in pairs, GRPO advantages (score − group mean) / group std."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(prompt_length // 2, prompt_length + 1, (batch,), generator=g)
    response_lengths = torch.randint(response_length * 3 // 4, response_length + 1, (batch,), generator=g)
    prompt_lengths[0], response_lengths[0] = prompt_length, response_length
    columns = torch.arange(prompt_length)[None, :]
    prompt_mask = (columns >= prompt_length - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(response_length)[None, :] < response_lengths[:, None]).long()
    prompt_ids = torch.randint(1, vocab, (batch, prompt_length), generator=g) * prompt_mask
    response_ids = torch.randint(1, vocab, (batch, response_length), generator=g) * response_mask
    scores = torch.rand(batch, generator=g)
    group_ids = torch.arange(batch) // GROUP
    grouped = scores.view(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rollout_log_probs": (-2.0 - torch.rand(batch, response_length, generator=g)) * response_mask,
        "scores": scores,
        "group_ids": group_ids,
        "advantages": advantages,
    }


# ----------------------------------------------------------------------------- the two sides (children)


def peak(device: str) -> dict:
    """The process's peak memory since it started (MiB, across OffPolicyModule's per-step resets of
    the peak: ``lit_offpolicy.core.memory``) and where it stands now."""
    from lit_offpolicy.core.memory import process_max_memory_allocated

    if device == "cuda":
        import torch

        return {
            "peak_mib": process_max_memory_allocated() / MiB,
            "now_mib": torch.cuda.memory_allocated() / MiB,
        }
    return {"peak_mib": process_peak_rss_mib(), "now_mib": status_mib("VmRSS")}


def run_ours(model_dir: str, variant: str, device: str, shape: str, batch: int, prompt: int, response: int):
    """``UPDATES`` steps of OffPolicyModule under a Trainer on ``fixed_batch``; the peak and the memory
    before the first."""
    from benchmarks.common import fit_on_fixed_experience
    from lit_offpolicy import OffPolicyModule
    from lit_offpolicy.advantages import GRPO
    from lit_offpolicy.losses import PPO
    from lit_offpolicy.training.options import OptimOptions

    exp = as_experience(fixed_batch(batch, prompt, response, SHAPES[shape]["vocab_size"]))
    module = OffPolicyModule(
        model_dir,
        policy_loss=PPO(pg_clip=0.2, loss_agg_mode="token-mean"),
        advantage=GRPO(norm_by_std=True),
        dtype=SHAPES[shape]["dtype"],
        optim=OptimOptions(lr=LR),
        **VARIANTS[variant],
    )
    before = peak(device)["now_mib"]
    with tempfile.TemporaryDirectory() as root:
        fit_on_fixed_experience(module, exp, UPDATES, [], root, accelerator=device)
    trained = sum(p.numel() for p in module.actor.parameters() if p.requires_grad)
    return {**peak(device), "before_update_mib": before, "trained_parameters": trained}


def run_trl(model_dir: str, device: str, shape: str, batch: int, prompt: int, response: int) -> dict:
    """``UPDATES`` steps of TRL's GRPOTrainer (gradient checkpointing on), generation replaced by
    ``fixed_batch``."""
    import torch
    import trl

    from benchmarks.peers.trl_side import fixed_batch_trainer, grpo_config
    from lit_offpolicy.models import load_actor, load_tokenizer

    data = fixed_batch(batch, prompt, response, SHAPES[shape]["vocab_size"])
    bf16 = SHAPES[shape]["dtype"] == "bfloat16"
    config = grpo_config(
        output_dir=tempfile.mkdtemp(),
        use_cpu=device == "cpu",
        bf16=bf16,
        gradient_checkpointing=True,
        per_device_train_batch_size=batch,
        num_generations=GROUP,
        max_completion_length=response,
        learning_rate=LR,
        epsilon=0.2,
        max_steps=UPDATES,
        logging_steps=1,
    )
    model = load_actor(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32)
    trainer = fixed_batch_trainer(
        data, device, model=model, args=config, processing_class=load_tokenizer(model_dir)
    )
    before = peak(device)["now_mib"]
    trainer.train()
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        **peak(device),
        "before_update_mib": before,
        "trained_parameters": trained,
        "trl": trl.__version__,
    }


def child(kind: str, args: argparse.Namespace) -> dict:
    """Run one side in this (fresh) process; a CUDA out-of-memory is a result (fits: false)."""
    import torch

    torch.manual_seed(0)
    sizes = (args.shape, args.batch, args.prompt_length, args.response_length)
    try:
        if kind == "trl":
            result = run_trl(args.model, args.device, *sizes)
        else:
            result = run_ours(args.model, kind, args.device, *sizes)
    except torch.OutOfMemoryError:
        return {"fits": False, "why": "torch.OutOfMemoryError"}
    return {"fits": True, **result}


# ----------------------------------------------------------------------------- the parent


def spawn(kind: str, model_dir: str, args: argparse.Namespace, response_length: int) -> dict:
    """``kind`` in a fresh process (TRL's with ``args.trl_python``), its RSS watched on the CPU."""
    python = args.trl_python if kind == "trl" else sys.executable
    command = [python, "-m", "benchmarks.peers.memory_vs_trl", "--child", kind, "--model", model_dir]
    command += ["--device", args.device, "--shape", args.shape, "--batch", str(args.batch)]
    command += ["--prompt-length", str(args.prompt_length), "--response-length", str(response_length)]
    if args.gpu_memory_gib:
        command += ["--gpu-memory-gib", str(args.gpu_memory_gib)]
    limit_mib = args.rss_limit_gib * 1024 if args.device == "cpu" else None

    def run() -> tuple[subprocess.Popen, float | None, str, str]:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(
                command, stdout=out, stderr=err, env=repo_env(**OFFLINE), cwd=REPO, text=True
            )
            killed_at = _watch(process, limit_mib)
            out.seek(0)
            err.seek(0)
            return process, killed_at, out.read(), err.read()

    seconds, (process, killed_at, stdout, stderr) = timed(run)
    seconds = round(seconds, 1)
    if killed_at is not None:
        return {
            "fits": False,
            "killed_at_mib": killed_at,
            "why": f"RSS passed {args.rss_limit_gib} GiB ({killed_at:.0f} MiB)",
            "seconds": seconds,
        }
    if process.returncode != 0:
        raise RuntimeError(
            f"{kind} (R={response_length}) failed with status {process.returncode}:\n{stderr[-3000:]}"
        )
    return {**json.loads(stdout.strip().splitlines()[-1]), "seconds": seconds}


def _watch(process: subprocess.Popen, limit_mib: float | None) -> float | None:
    """Wait for ``process``; kill it once its RSS passes ``limit_mib`` and return that RSS (else None)."""
    status = Path(f"/proc/{process.pid}/status")
    while process.poll() is None:
        if limit_mib is not None:
            try:
                rss = next(
                    int(line.split()[1]) / 1024
                    for line in status.read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            except (OSError, StopIteration):
                rss = 0.0
            if rss > limit_mib:
                process.kill()
                process.wait()
                return rss
        time.sleep(0.2)
    return None


def without_none(**fields) -> dict:
    return {name: value for name, value in fields.items() if value is not None}


def options_text(options: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in options.items())


def available_variants() -> list[str]:
    """``VARIANTS`` whose options OffPolicyModule has in this build."""
    from lit_offpolicy import OffPolicyModule

    accepted = set(inspect.signature(OffPolicyModule.__init__).parameters)
    return [name for name, options in VARIANTS.items() if set(options) <= accepted]


def compare(model_dir: str, args: argparse.Namespace) -> list[dict]:
    """Every variant and TRL at ``args.response_length``: ours against TRL, each variant against ours."""
    runnable = available_variants()
    skipped = [name for name in VARIANTS if name not in runnable]
    side = {}
    chosen = [name for name in dict.fromkeys(["ours", *(args.variants or runnable)]) if name in runnable]
    for kind in [*chosen, "trl"]:
        print(
            f"[memory_vs_trl] {kind}: B={args.batch}, R={args.response_length}, {args.shape}, {args.device}",
            flush=True,
        )
        side[kind] = spawn(kind, model_dir, args, args.response_length)
        print(f"[memory_vs_trl] {kind}: {json.dumps(side[kind])}", flush=True)
    # a child killed at the RSS limit needed at least that much: its figure is a lower bound
    unit_peak = {kind: result.get("peak_mib", result.get("killed_at_mib")) for kind, result in side.items()}
    what = (
        "peak RSS (VmHWM) of a fresh process" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
    )
    workload = (
        f"{UPDATES} GRPO updates, {args.batch} sequences x {args.prompt_length} prompt + "
        f"{args.response_length} response tokens, {args.shape} ({SHAPES[args.shape]['dtype']}, random "
        f"weights), {args.device}"
    )
    common = {"workload": workload, "what": what, "sides": side, "skipped_variants": skipped}
    name = ENTRY_NAME[args.device]
    state = {kind: training_state_mib(side[kind], args.shape) for kind in ("ours", "trl")}
    entries = [
        entry(
            name,
            "MiB",
            unit_peak["ours"],
            unit_peak["trl"],
            1,
            target=2.0,
            baseline_is=f"trl {side['trl'].get('trl', '')} GRPOTrainer, gradient_checkpointing=True",
            ours_options=options_text(VARIANTS["ours"]),
            training_state_mib=state["ours"],
            rest_mib={kind: round(unit_peak[kind] - state[kind], 1) for kind in ("ours", "trl")},
            **without_none(held_back_by=held_back_by(unit_peak["ours"], unit_peak["trl"], state["ours"])),
            **common,
        )
    ]
    for kind in side:
        if kind in ("ours", "trl") or unit_peak[kind] is None:
            continue
        entries.append(
            entry(
                f"{name}_{kind}",
                "MiB",
                unit_peak["ours"],
                unit_peak[kind],
                1,
                baseline_is="ours with " + options_text(VARIANTS[kind]),
                **({"baseline_at_least": True} if not side[kind]["fits"] else {}),
                workload=workload,
                what=f"{what}: ours ({options_text(VARIANTS['ours'])}) against the variant",
            )
        )
    return entries


def training_state_mib(side: dict, shape: str) -> float:
    """What every trainer holds at the peak, from the trained parameter count: weights, gradients and
    AdamW's two moments, in the model's dtype."""
    element_bytes = {"float32": 4, "bfloat16": 2}[SHAPES[shape]["dtype"]]
    return round(side["trained_parameters"] * element_bytes * 4 / MiB, 1)


def held_back_by(ours: float, trl: float, state: float) -> str | None:
    """Where the target's ratio (2x) is out of reach: the peak beside the training state both hold;
    None where it is met."""
    room = trl / 2.0 - state
    if ours <= trl / 2.0:
        return None
    return (
        f"the training state (weights, gradients, AdamW moments: {state:,.0f} MiB, "
        f"{100 * state / ours:.0f}% of ours' peak, the same in TRL's); 2x TRL's peak needs the rest of "
        f"ours (process, activations, transients) at {max(room, 0):,.0f} MiB, not {ours - state:,.0f}"
    )


def largest_fitting(kind: str, model_dir: str, args: argparse.Namespace) -> dict:
    """``kind``'s largest response length that fits, each trial a fresh process (``search_largest``)."""
    trials: dict[int, dict] = {}

    def fits(length: int) -> bool:
        trials[length] = spawn(kind, model_dir, args, length)
        print(f"[memory_vs_trl] {kind} R={length}: {json.dumps(trials[length])}", flush=True)
        return trials[length]["fits"]

    low, high = search_largest(fits, args.response_length, args.max_response_length, args.resolution)
    return {
        "largest_fitting": low,
        "first_failing": high,
        "trials": {str(k): v for k, v in sorted(trials.items())},
    }


def search_largest(fits, start: int, maximum: int, resolution: int) -> tuple[int, int | None]:
    """(largest length found to fit, smallest found not to; None: none failed up to ``maximum``) for a
    ``fits(length)`` that holds below some length and fails from there: ``start``, 2·``start``, ...
    until one fails (or, when ``start`` fails, ``start``/2, ``start``/4, ... down to ``resolution``
    until one fits), then bisection down to ``resolution`` (lengths stay multiples of it). 0: not even
    ``resolution`` fits."""
    low, high, length = 0, None, start
    while length <= maximum:
        if not fits(length):
            high = length
            break
        low, length = length, length * 2
    if high is None:
        return low, None
    while low == 0 and high // 2 >= resolution:
        if fits(high // 2):
            low = high // 2
        else:
            high //= 2
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        if middle in (low, high):
            break
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, high


def find_max(model_dir: str, args: argparse.Namespace) -> list[dict]:
    """Both sides' largest fitting length. A side that fits at ``--max-response-length`` is stopped
    there (every trial is two updates at that length: minutes on a CPU); its figure is then a lower
    bound, and so is the ratio when it is ours (``lower_bound``)."""
    sides = {kind: largest_fitting(kind, model_dir, args) for kind in ("ours", "trl")}
    capped = [kind for kind, side in sides.items() if side["first_failing"] is None]
    gpu = f"{args.gpu_memory_gib:g} GiB of the GPU" if args.gpu_memory_gib else "the GPU's memory"
    limit = f"an RSS of {args.rss_limit_gib:g} GiB" if args.device == "cpu" else gpu
    return [
        entry(
            MAX_LENGTH_ENTRY_NAME[args.device]
            if args.shape == DEFAULT_SHAPE[args.device]
            else f"max_response_len_vs_trl_{args.shape.replace('.', 'p')}_{args.device}",
            "tokens",
            sides["ours"]["largest_fitting"],
            sides["trl"]["largest_fitting"],
            1,
            target=2.0,
            baseline_is="trl GRPOTrainer, gradient_checkpointing=True",
            ours_options=options_text(VARIANTS["ours"]),
            workload=f"{UPDATES} GRPO updates, B={args.batch}, prompt {args.prompt_length}, {args.shape}, "
            f"{args.device}",
            what=f"largest response length whose update fits in {limit} (resolution {args.resolution} "
            f"tokens, searched up to {args.max_response_length})",
            lower_bound=capped,
            sides=sides,
        )
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv or [])
    require_trl_python(args.trl_python)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / args.shape)
        print(f"[memory_vs_trl] building {args.shape} with random weights", flush=True)
        build_in_child(model_dir, args.shape)
        return find_max(model_dir, args) if args.find_max else compare(model_dir, args)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--shape", choices=tuple(SHAPES), help="default: qwen3-180m on cpu, qwen2.5-1.5b on cuda"
    )
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--prompt-length", type=int, default=PROMPT_LENGTH)
    parser.add_argument("--response-length", type=int, default=RESPONSE_LENGTH)
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(VARIANTS), help="ours with these (always 'ours'); default: all"
    )
    parser.add_argument(
        "--find-max", action="store_true", help="largest response length that fits, ours and TRL"
    )
    parser.add_argument("--max-response-length", type=int, default=65536)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument(
        "--rss-limit-gib", type=float, default=12.0, help="CPU: a child past this RSS is killed"
    )
    parser.add_argument("--gpu-memory-gib", type=float, help="CUDA: cap each process at this much GPU memory")
    default_trl = BENCH_PYTHON if BENCH_PYTHON.exists() else Path(sys.executable)
    parser.add_argument(
        "--trl-python", default=str(default_trl), help="an interpreter with trl (default .venv-bench)"
    )
    parser.add_argument("--no-record", action="store_true", help="print the entries, leave results.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shape = args.shape or DEFAULT_SHAPE[args.device]
    return args


def _cap_gpu_memory(args: argparse.Namespace) -> None:
    """``--gpu-memory-gib``: this process allocates at most that much of the GPU (80 GB on a larger card)."""
    if args.device == "cuda" and args.gpu_memory_gib:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total))


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.child:
        _cap_gpu_memory(arguments)
        print(json.dumps(child(arguments.child, arguments)))
    else:
        record_or_print(main(sys.argv[1:]), arguments.no_record)
