"""Per-sample attention against transformers' masked row: seconds of one packed micro-batch's pass.

The micro-batch of ``update_throughput_vs_trl``: samples of that benchmark's batch (prompts of 32..64
tokens, responses of 16..512, seeded), taken in order while they fit its token budget (8 × 576 =
4,608 tokens), packed into one row (``padding_free``). One pass is ``policy_log_probs`` with entropy,
then the backward of a loss on both, through the Qwen3-shaped model (random weights, float32):
- ours: the default, one causal SDPA call per sample (``lit_offpolicy.training.packed_attention``);
- baseline: the same row through transformers' "sdpa" with its N × N block-diagonal mask (the per-sample
  switch turned off for the run).
Sides alternate pass by pass in one process; medians. The log-probs of both sides are compared.

    python -m benchmarks.pytorch.packed_attention [--repeats 5] [--budget 4608]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from types import SimpleNamespace

import torch

import lit_offpolicy.training.packed_attention as packed_attention
from benchmarks.common import alternate, as_experience, entry, median, timed, within
from benchmarks.results import record
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.models import load_actor
from lit_offpolicy.training.forward import policy_log_probs
from lit_offpolicy.training.packing import sample_lengths

SHAPE = "qwen3-180m"
BUDGET = 4608


def micro_batch(budget: int) -> Experience:
    """The update benchmark's samples, in order, while their prompt + response tokens fit ``budget``."""
    from benchmarks.peers.update_throughput_vs_trl import (
        MAX_RESPONSE,
        MIN_RESPONSE,
        PROMPT_LENGTH,
        PROMPTS,
        fixed_batch,
    )
    from benchmarks.shapes import SHAPES

    shape = SimpleNamespace(
        prompts=PROMPTS, prompt_length=PROMPT_LENGTH, min_response=MIN_RESPONSE, max_response=MAX_RESPONSE
    )
    exp = as_experience(fixed_batch(shape, SHAPES[SHAPE]["vocab_size"]))
    fits = sample_lengths(exp).cumsum(0) <= budget
    return exp.select(torch.nonzero(fits).flatten())


@contextlib.contextmanager
def masked_row():
    """transformers' own separation of the packed samples: no model type switches to per-sample."""
    kept = packed_attention.PER_SAMPLE_MODEL_TYPES
    packed_attention.PER_SAMPLE_MODEL_TYPES = frozenset()
    try:
        yield
    finally:
        packed_attention.PER_SAMPLE_MODEL_TYPES = kept


def one_pass(model, exp: Experience) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    log_probs, entropy = policy_log_probs(model, exp, 1.0, with_entropy=True, padding_free=True)
    ((log_probs + 0.01 * entropy) * exp.response_mask).sum().backward()
    return log_probs.detach()


def main(repeats: int = 5, budget: int = BUDGET) -> list[dict]:
    from benchmarks.shapes import build_model

    exp = micro_batch(budget)
    lengths = sample_lengths(exp).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        build_model(f"{tmp}/model", SHAPE)
        model = load_actor(f"{tmp}/model", attn_implementation="sdpa")
    results = {}

    def timed_pass(side: str) -> float:
        elapsed, results[side] = timed(lambda: one_pass(model, exp))
        print(f"[packed_attention] {side}: {elapsed:.2f} s", flush=True)
        return elapsed

    sides = {
        "ours": within(contextlib.nullcontext, lambda: timed_pass("ours")),
        "masked": within(masked_row, lambda: timed_pass("masked")),
    }
    seconds = alternate(sides, repeats)  # the first pass of each side is a warm-up
    mask = exp.response_mask.bool()
    difference = (results["ours"][mask] - results["masked"][mask]).abs().max().item()
    return [
        entry(
            "packed_attention_vs_masked_row",
            "s",
            median(seconds["ours"]),
            median(seconds["masked"]),
            repeats,
            baseline_is="the same packed row through transformers' sdpa with its block-diagonal mask",
            workload=(
                f"one packed micro-batch of {len(lengths)} samples, {sum(lengths)} tokens (lengths "
                f"{min(lengths)}..{max(lengths)}), {int(mask.sum())} response tokens; {SHAPE} (float32, "
                "random weights): log-probs + entropy, then the backward"
            ),
            what="seconds of one forward + backward (median, after one warm-up pass per side)",
            max_log_prob_difference=float(f"{difference:.2g}"),
        )
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=int, default=BUDGET)
    args = parser.parse_args()
    record(main(args.repeats, args.budget))
