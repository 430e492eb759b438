"""Hand-made experiences: batches built from generations written here, no engine involved."""

from __future__ import annotations

import torch

from helpers.fits import N_SAMPLES
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.models import load_tokenizer


def fixed_experience(model_dir: str, seed: int = 0) -> Experience:
    """3 prompts of different lengths × 4 responses of 1..6 tokens (half end with eos), random scores."""
    tokenizer = load_tokenizer(model_dir)
    generator = torch.Generator().manual_seed(seed)
    prompts = [tokenizer(text).input_ids for text in ("1+2=", "13+57=", "9+9=")]
    generations = []
    for i in range(len(prompts)):
        group = []
        for j in range(N_SAMPLES):
            length = 1 + (i * N_SAMPLES + j) % 6
            token_ids = torch.randint(4, len(tokenizer), (length,), generator=generator).tolist()
            finish_reason = "length"
            if j % 2 == 0:
                token_ids[-1], finish_reason = tokenizer.eos_token_id, "stop"
            log_probs = (-3 * torch.rand(length, generator=generator)).tolist()
            group.append(Generation(token_ids, log_probs, finish_reason))
        generations.append(group)
    scores = torch.rand(len(prompts) * N_SAMPLES, generator=generator).tolist()
    return Experience.from_generations(
        prompts, generations, scores, pad_token_id=tokenizer.pad_token_id, policy_version=0
    )


def experience(response_lengths=(4, 0, 1, 6), width: int = 7, seed: int = 0) -> Experience:
    """Prompts of 6, 2, 3, 1, 6, 2 ... tokens (left-padded to 6), responses right-padded to ``width``."""
    prompts = [
        [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16]][i % 4] for i in range(len(response_lengths))
    ]
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for length in response_lengths:
        tokens = torch.randint(3, 90, (length,), generator=generator).tolist()
        groups.append([Generation(tokens, [-1.0] * length, "stop")])
    return Experience.from_generations(
        prompts,
        groups,
        [0.0] * len(response_lengths),
        pad_token_id=0,
        policy_version=0,
        response_width=width,
    )


def with_update_inputs(exp: Experience, seed: int = 2) -> Experience:
    """``exp`` with what the update reads filled in, in float64: π_old and π_ref log-probs in (−5, −4],
    standard normal advantages (a generator seeded with ``seed``), every response token in the loss."""
    generator = torch.Generator().manual_seed(seed)
    shape, dtype = exp.response_ids.shape, torch.float64
    exp.old_log_probs = -torch.rand(shape, generator=generator, dtype=dtype) - 4.0
    exp.ref_log_probs = -torch.rand(shape, generator=generator, dtype=dtype) - 4.0
    exp.advantages = torch.randn(shape, generator=generator, dtype=dtype)
    exp.loss_mask = exp.response_mask
    return exp
