"""Shared-prefix rows against a row per sample: seconds and peak memory of the frozen pass and the update.

Issue #60's ``benchmarks/shared_prefix.py``, here in ``pytorch/`` with the other one-option-off comparisons.
A batch of ``--prompts`` random prompts of P tokens × n = 8 responses of R tokens (random ids, seeded), in
micro-batches of one prompt's n samples, through a Qwen3 shape (``benchmarks.shapes``, random weights,
float32, sdpa, 256-token head chunks). Two stages, as the trainer runs them:
- frozen: ``frozen_log_probs`` of the actor, no grad (π_old; a reference or teacher adds one more alike);
- update: per micro-batch, ``policy_log_probs`` with entropy, then the backward of a loss of both.
Sides, alternating round by round after a warm-up round (medians): ``shared`` (``shared_prefix=True``:
the prompt once, then each response) against ``padded`` (``shared_prefix=False``, the padded batch,
the baseline) and ``packed`` (``padding_free=True``: each sample its own packed row).
Peak memory of each stage: the rise of the process's peak RSS (VmHWM, reset before the stage, freed
heap returned first) over its RSS at the stage's start; on CUDA, ``max_memory_allocated`` over the
allocated memory at the start. No figure is reported unless every side's log-probs match the padded
ones (float32 tolerance) and the shared side's passes took each prompt once (tokens counted at the
embedding). Cases: P 1,024 / R 128 (4.5× fewer tokens) and P 256 / R 256 (1.8×).

    python -m benchmarks.pytorch.shared_prefix [--shape qwen3-sp] [--repeats 5] [--prompts 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from collections.abc import Callable

import torch

from benchmarks.common import MiB, alternate, entry, medians, timed
from benchmarks.results import record
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.memory import map_large_blocks, peak_rss_bytes, release_freed_heap, reset_peak_rss
from lit_offpolicy.models import load_actor
from lit_offpolicy.training.forward import frozen_log_probs, policy_log_probs

SHAPE, GROUP, CHUNK, TEMPERATURE = "qwen3-sp", 8, 256, 1.0
CASES = ((1024, 128), (256, 256))  # (prompt, response) tokens
SIDES = {  # policy_log_probs' layout options
    "padded": {"padding_free": False, "shared_prefix": False},
    "packed": {"padding_free": True, "shared_prefix": False},
    "shared": {"padding_free": False, "shared_prefix": True},
}
BASELINE, OURS = "padded", "shared"


def batch(prompts: int, prompt: int, response: int, vocab: int, seed: int = 0) -> Experience:
    """``prompts`` random prompts of ``prompt`` tokens, each with ``GROUP`` random responses of ``response``
    tokens (ids 3 .. vocab − 1: no pad, bos or eos), the rollout log-probs −2."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(3, vocab, (prompt,), generator=generator).tolist() for _ in range(prompts)]
    groups = [
        [
            Generation(
                torch.randint(3, vocab, (response,), generator=generator).tolist(),
                [-2.0] * response,
                "length",
            )
            for _ in range(GROUP)
        ]
        for _ in range(prompts)
    ]
    return Experience.from_generations(
        prompt_ids, groups, [0.0] * prompts * GROUP, pad_token_id=0, policy_version=0
    )


def token_ratio(prompt: int, response: int) -> float:
    """The tokens of the per-sample rows over those of a shared-prefix row: (n·P + n·R) / (P + n·R)."""
    return GROUP * (prompt + response) / (prompt + GROUP * response)


class Peak:
    """The rise of the peak memory during a stage over the memory at its start, in MiB: CUDA's allocated
    tensors on a CUDA device, else the process's resident set (VmHWM, reset by ``reset_peak_rss``)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        gc.collect(1)  # the young generations: what a stage left in cycles (a full collection takes 0.2 s)
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            release_freed_heap()
            reset_peak_rss()
            self.base = peak_rss_bytes()  # = the RSS just after the reset

    def rise_mib(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self.base) / MiB
        return (peak_rss_bytes() - self.base) / MiB


def stages(model, exp: Experience, options: dict, peak: Peak, sync: Callable | None) -> dict:
    """One frozen pass and one update of ``exp`` with ``options``: seconds, peak MiB, log-probs and the
    tokens the model took (its embedding's inputs) of each."""
    groups = list(torch.arange(len(exp)).split(GROUP))
    figures: dict = {}

    def frozen() -> torch.Tensor:
        with torch.no_grad():
            return frozen_log_probs(model, exp, TEMPERATURE, groups, CHUNK, **options)

    def update() -> torch.Tensor:
        kept = []
        for group in groups:
            micro = exp.select(group.to(exp.response_ids.device))
            log_probs, entropy = policy_log_probs(model, micro, TEMPERATURE, True, CHUNK, **options)
            mask = micro.response_mask
            loss = -((log_probs + 0.01 * entropy) * mask).sum() / mask.sum()
            loss.backward()
            kept.append(log_probs.detach())
        return torch.cat(kept)

    tokens = [0]
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: tokens.__setitem__(0, tokens[0] + args[0].numel())
    )
    try:
        for name, stage in (("frozen", frozen), ("update", update)):
            model.zero_grad(set_to_none=True)
            peak.start()
            tokens[0] = 0
            figures[f"{name}_s"], figures[f"{name}_log_probs"] = timed(stage, sync)
            figures[f"{name}_mib"] = peak.rise_mib()
            figures[f"{name}_tokens"] = tokens[0]
    finally:
        hook.remove()
    return figures


def tolerance(log_probs: torch.Tensor, hidden: int) -> float:
    """What float32 allows between two layouts of the same sums (the same additions in another order):
    ε = 2⁻²³ per rounding, √hidden of them per dot product, a margin of 2¹⁰ for the layers, softmax and
    head, times the log-probs' size: 0.022 on qwen3-sp. A wrong prompt moves them by more (1.3 there)."""
    return 2**10 * torch.finfo(torch.float32).eps * hidden**0.5 * max(1.0, log_probs.abs().max().item())


def run_case(model, prompts: int, prompt: int, response: int, repeats: int, device: torch.device) -> dict:
    exp = batch(prompts, prompt, response, model.config.vocab_size).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    peak, checks, tokens = Peak(device), {}, {}

    def side(name: str) -> Callable[[], dict]:
        def call() -> dict:
            figures = stages(model, exp, SIDES[name], peak, sync)
            for stage in ("frozen", "update"):
                checks[(name, stage)] = figures.pop(f"{stage}_log_probs").float().cpu()
                tokens[(name, stage)] = figures.pop(f"{stage}_tokens")
            print(
                f"[shared_prefix] P {prompt} R {response} {name}: frozen {figures['frozen_s']:.2f} s "
                f"{figures['frozen_mib']:.0f} MiB, update {figures['update_s']:.2f} s "
                f"{figures['update_mib']:.0f} MiB",
                flush=True,
            )
            return figures

        return call

    runs = alternate({name: side(name) for name in SIDES}, repeats)
    shared = prompts * (prompt + GROUP * response)  # each prompt once: else the side ran per-sample rows
    if tokens[(OURS, "frozen")] != shared or tokens[(OURS, "update")] != shared:
        raise AssertionError(f"the shared side's passes took {tokens} tokens, not {shared} each")
    mask = exp.response_mask.bool().cpu()
    reference = checks[(BASELINE, "frozen")][mask]
    allowed = tolerance(reference, model.config.hidden_size)
    differences = {
        f"{name}_{stage}": (checks[(name, stage)][mask] - reference).abs().max().item()
        for name in SIDES
        for stage in ("frozen", "update")
    }
    if max(differences.values()) > allowed:
        raise AssertionError(
            f"log-probs differ between the layouts by {differences}, more than {allowed:.2g}"
        )
    return {
        "figures": {name: medians(rows) for name, rows in runs.items()},
        "max_log_prob_difference": float(f"{max(differences.values()):.2g}"),
        "tolerance": float(f"{allowed:.2g}"),
        "tokens": {name: tokens[(name, "frozen")] for name in SIDES},
    }


def main(
    shape: str = SHAPE, repeats: int = 5, prompts: int = 1, device: str = "cpu", cases=CASES
) -> list[dict]:
    from benchmarks.shapes import build_model

    map_large_blocks()  # as OffPolicyModule: large freed tensors go back to the kernel
    target = torch.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(f"{tmp}/model", shape)
        model = load_actor(f"{tmp}/model", torch.float32, attn_implementation="sdpa").to(target)
    memory = "peak allocated CUDA memory" if target.type == "cuda" else "peak RSS (VmHWM)"
    entries, lines = [], []
    for prompt, response in cases:
        result = run_case(model, prompts, prompt, response, repeats, target)
        entries.append(case_entry(result, shape, prompts, prompt, response, repeats, device, memory))
        lines += table_lines(result["figures"], prompt, response)
    print(f"\n[shared_prefix] {shape}, {prompts} prompts x n={GROUP}, {device}, medians of {repeats}")
    print(f"MiB: the rise of the {memory} during the stage")
    print("    P     R stage   padded s packed s shared s  ratio tokens  padded MiB packed shared")
    print("\n".join(lines))
    return entries


def stage_figure(figures: dict, stage: str, key: str) -> float:
    """A side's median ``key`` ("s", "mib") of ``stage``; "sum": both stages' seconds."""
    if stage == "sum":
        return figures["frozen_s"] + figures["update_s"]
    return figures[f"{stage}_{key}"]


def table_lines(figures: dict, prompt: int, response: int) -> list[str]:
    """The printed table's rows of one case: each stage and their sum."""
    lines = []
    for stage in ("frozen", "update", "sum"):
        base, pack, ours = (stage_figure(figures[name], stage, "s") for name in (BASELINE, "packed", OURS))
        line = f"{prompt:5d} {response:5d} {stage:7s} {base:8.2f} {pack:8.2f} {ours:8.2f} {base / ours:6.2f} "
        line += f"{token_ratio(prompt, response):6.2f}"
        if stage != "sum":
            line += "".join(f" {figures[name][f'{stage}_mib']:8.0f}" for name in (BASELINE, "packed", OURS))
        lines.append(line)
    return lines


def case_entry(
    result: dict, shape: str, prompts: int, prompt: int, response: int, repeats: int, device: str, memory: str
) -> dict:
    """One case's results.json entry: seconds of both stages, ours (shared) against the padded batch."""
    from benchmarks.shapes import SHAPES

    figures, config = result["figures"], SHAPES[shape]
    seconds = {name: stage_figure(figures[name], "sum", "s") for name in SIDES}
    options = ("" if shape == SHAPE else f" --shape {shape}") + (
        "" if device == "cpu" else f" --device {device}"
    )
    name = f"shared_prefix_p{prompt}_r{response}" + ("" if shape == SHAPE else f"_{shape}")
    name += "" if device == "cpu" else f"_{device}"

    def ratios(key: str) -> dict:
        return {
            stage: round(figures[BASELINE][f"{stage}_{key}"] / max(figures[OURS][f"{stage}_{key}"], 1e-9), 3)
            for stage in ("frozen", "update")
        }

    return entry(
        name,
        "s",
        seconds[OURS],
        seconds[BASELINE],
        repeats,
        **({"target": 2.5} if (prompt, response, shape) == (*CASES[0], SHAPE) else {}),  # issue #60
        token_ratio=round(token_ratio(prompt, response), 2),
        stage_ratios=ratios("s"),
        memory_ratios=ratios("mib"),
        packed_over_ours=round(seconds["packed"] / seconds[OURS], 3),
        stages={
            side: {key: round(value, 3 if key.endswith("_s") else 1) for key, value in figures[side].items()}
            for side in SIDES
        },
        baseline_is=(
            "shared_prefix=False: each sample its own row of the padded batch (packed: padding_free=True, "
            "each sample its own packed row)"
        ),
        workload=(
            f"{prompts} prompts of {prompt} tokens x n={GROUP} responses of {response} (random ids), "
            f"micro-batches of one prompt's {GROUP} samples; {shape} ({config['num_hidden_layers']} "
            f"layers, hidden {config['hidden_size']}, vocabulary {config['vocab_size']}, float32, random "
            f"weights, sdpa), log-prob chunks of {CHUNK}, {device}"
        ),
        what=(
            "seconds of one frozen pass (no-grad log-probs) + one update (log-probs and entropy, then "
            f"the backward), medians; per stage its seconds and the rise of the {memory} in MiB"
        ),
        tokens_per_pass=result["tokens"],
        max_log_prob_difference=result["max_log_prob_difference"],
        log_prob_tolerance=result["tolerance"],
        command=f"python -m benchmarks.pytorch.shared_prefix{options}",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=SHAPE, help="a benchmarks.shapes shape: qwen3-sp, qwen3-180m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    record(main(args.shape, args.repeats, args.prompts, args.device))
