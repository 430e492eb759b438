"""Shared-prefix rows: the samples of a micro-batch that share a prompt pass through the model once for
the prompt and once for each response.

A micro-batch's samples are grouped by their prompt (the same real tokens, left padding aside). Group g,
a prompt of P_g tokens and n_g responses of R_g1 … R_gn tokens, is packed as [prompt, r_1, …, r_n]:
P_g + Σ_i R_gi tokens instead of the n_g · P_g + Σ_i R_gi of the per-sample rows, with positions
0 … P_g − 1 for the prompt and P_g … P_g + R_gi − 1 for each response. The prompt attends causally to
itself; response i to the whole prompt and causally to itself, never to another response
(``shared_prefix_sdpa``). Every response's query then meets the same keys and values as in its own
row [prompt, r_i] at the same positions, so each hidden state, log-prob, entropy and value is the
per-sample one; the prompt's keys and values are one tensor that all the responses read, so their
gradients reach the prompt's activations summed, as the n per-sample rows' gradients sum in the
parameters (``tests/training/test_shared_prefix.py``, float64, every parameter's gradient).

Response token j of sample i is predicted by the hidden state before it: response token j − 1, or for
j = 0 the prompt's last token, which thus predicts the first token of every response of its group.

It applies where every attention of the model can run ``shared_prefix_sdpa`` (the models of
``packed_attention.PER_SAMPLE_MODEL_TYPES`` under "sdpa", no sliding window shorter than a prompt plus
a response): ``shared_row``. This is the tree attention of AReaL's tree training and of the shared-prefix
training RFC of verl, with the exact SDPA calls of ``packed_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.training.options import UpdateOptions
from lit_offpolicy.training.packed_attention import runs_per_sample
from lit_offpolicy.training.packing import PackedBatch


@dataclass(frozen=True)
class _Layout:
    """What a shared row needs of an Experience, on the host (one device-to-host read)."""

    prompts: list[list[int]]
    """Each prompt's samples, in sample order; the prompts in the order of their first sample."""
    prompt_lengths: list[int]
    response_lengths: list[int]


def _layout(exp: Experience) -> _Layout:
    """``exp``'s prompt groups and lengths from one host read of its prompts, masks and response lengths
    (the passes read nothing else of the host per micro-batch: tests/integration/test_step_metrics_fit.py)."""
    width = exp.prompt_ids.shape[1]
    host = torch.cat(
        [exp.prompt_ids, exp.prompt_mask, exp.response_mask.sum(1, keepdim=True)], dim=1
    ).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, row in enumerate(host):
        prompt = tuple(token for token, real in zip(row[:width], row[width : 2 * width], strict=True) if real)
        groups.setdefault(prompt, []).append(index)
    prompt_lengths = [sum(row[width : 2 * width]) for row in host]
    return _Layout(list(groups.values()), prompt_lengths, [row[-1] for row in host])


def prompt_groups(exp: Experience) -> list[list[int]]:
    """The samples of ``exp`` grouped by their prompt's real tokens, each group in sample order, the
    groups in the order of their first sample."""
    return _layout(exp).prompts


def shared_row(model: nn.Module, exp: Experience) -> PackedBatch | None:
    """``pack_shared(exp)`` where ``model``'s attention runs it (``runs_per_sample`` for the longest
    prompt plus response); else None."""
    layout = _layout(exp)
    return _pack(exp, layout) if runs_per_sample(model, _longest(layout)) else None


def shared_prompts(model: nn.Module, exp: Experience, micro_batches: list[torch.Tensor]) -> list[int]:
    """The prompt lengths that ``model``'s shared-prefix rows of ``micro_batches`` (groups of sample
    indices) compute once for several samples: a prompt's P once per sample beyond the first of each
    micro-batch that holds it."""
    layout = _layout(exp)
    if not runs_per_sample(model, _longest(layout)):
        return []
    order = torch.cat(micro_batches).tolist()  # one host read
    indices = [i for i, group in enumerate(micro_batches) for _ in range(len(group))]
    micro_batch = dict(zip(order, indices, strict=True))
    repeated = []
    for samples in layout.prompts:
        rows = len({micro_batch[sample] for sample in samples})  # one shared row per micro-batch
        repeated += [layout.prompt_lengths[samples[0]]] * (len(samples) - rows)
    return repeated


def _longest(layout: _Layout) -> int:
    """The longest sample, prompt plus response, of ``layout``."""
    return max(
        (p + r for p, r in zip(layout.prompt_lengths, layout.response_lengths, strict=True)), default=0
    )


def pack_shared(exp: Experience) -> PackedBatch:
    """``exp`` as shared-prefix rows, one per prompt, end to end in one row (see the module)."""
    return _pack(exp, _layout(exp))


def _pack(exp: Experience, layout: _Layout) -> PackedBatch:
    """The shared row's index tensors, built on the host and gathered from ``exp`` on its device."""
    if not all(layout.prompt_lengths):
        raise ValueError("shared-prefix rows need at least one prompt token per sample; got an empty prompt")
    prompt_width, response_width = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    taken, positions, predicting, lengths, fan_out, rows, columns = [], [], [], [], [], [], []
    for samples in layout.prompts:
        first, prompt = samples[0], layout.prompt_lengths[samples[0]]
        # token t of sample i in the flattened [prompts | responses] of (P + R) columns a sample
        start = first * (prompt_width + response_width) + prompt_width - prompt  # left-padded
        taken += range(start, start + prompt)
        positions += range(prompt)
        last_of_prompt = len(taken) - 1  # predicts the first token of each of its responses
        lengths.append(prompt)
        for sample in samples:
            response = layout.response_lengths[sample]
            start = sample * (prompt_width + response_width) + prompt_width
            predicting += [last_of_prompt, *range(len(taken), len(taken) + response - 1)][:response]
            taken += range(start, start + response)
            positions += range(prompt, prompt + response)
            rows += [sample] * response
            columns += range(response)
            lengths.append(response)
        fan_out.append(len(samples))
    device = exp.response_ids.device
    tokens = torch.cat([exp.prompt_ids, exp.response_ids], dim=1).flatten()
    rows_, columns_ = (torch.tensor(values, dtype=torch.long, device=device) for values in (rows, columns))
    return PackedBatch(
        input_ids=tokens[torch.tensor(taken, dtype=torch.long, device=device)].unsqueeze(0),
        position_ids=torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0),
        predicting=torch.tensor(predicting, dtype=torch.long, device=device),
        targets=exp.response_ids[rows_, columns_].unsqueeze(0),
        rows=rows_,
        columns=columns_,
        shape=tuple(exp.response_ids.shape),
        lengths=tuple(lengths),
        fan_out=tuple(fan_out),
    )


def check_option(update: UpdateOptions, *models: nn.Module | None) -> None:
    """``update.shared_prefix``, given the actor, critic, reference and teacher (None where absent):
    true needs every model's attention to run shared-prefix rows (else one line naming what runs
    instead); null says, in one line each, which models will run per-sample rows; false needs nothing."""
    if not update.shares_prefixes:
        return
    for role, model in zip(("actor", "critic", "reference", "teacher"), models, strict=True):
        if model is None or runs_per_sample(model, longest=0):
            continue
        config = getattr(model, "config", None)
        attention, family = getattr(config, "_attn_implementation", None), getattr(config, "model_type", None)
        found = f"{attention!r} attention on {family!r}"
        if update.shared_prefix:
            raise ValueError(
                "update.shared_prefix=true needs 'sdpa' attention on a llama, mistral, qwen2 or qwen3 "
                f"model; the {role} has {found}; allowed values: update.shared_prefix null (the default, "
                "left out: wherever a model runs it) or false, or attn_implementation 'sdpa' on one of "
                "those families"
            )
        rank_zero_info(
            f"lit-offpolicy: update.shared_prefix: the {role} has {found}: its passes run per sample"
        )
