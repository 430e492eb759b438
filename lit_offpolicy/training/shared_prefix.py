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
a response): ``applies``. This is the tree attention of AReaL's tree training and of the shared-prefix
training RFC of verl, with the exact SDPA calls of ``packed_attention``.
"""

from __future__ import annotations

import torch
from torch import nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.training.packed_attention import runs_per_sample
from lit_offpolicy.training.packing import PackedBatch


def prompt_groups(exp: Experience) -> list[list[int]]:
    """The samples of ``exp`` grouped by their prompt's real tokens, each group in sample order, the
    groups in the order of their first sample."""
    groups: dict[tuple[int, ...], list[int]] = {}
    real = exp.prompt_mask.bool().cpu()
    for index, (ids, mask) in enumerate(zip(exp.prompt_ids.cpu(), real, strict=True)):
        groups.setdefault(tuple(ids[mask].tolist()), []).append(index)
    return list(groups.values())


def applies(model: nn.Module, exp: Experience) -> bool:
    """Whether ``model``'s attention runs ``exp`` as shared-prefix rows exactly (``runs_per_sample`` for
    its longest prompt plus response)."""
    longest = int((exp.prompt_mask.sum(1) + exp.response_mask.sum(1)).max()) if len(exp) else 0
    return runs_per_sample(model, longest)


def pack_shared(exp: Experience) -> PackedBatch:
    """``exp`` as shared-prefix rows, one per prompt group, end to end in one row (see the module)."""
    if not exp.prompt_mask.bool().any(dim=1).all():
        raise ValueError("shared-prefix rows need at least one prompt token per sample; got an empty prompt")
    device, prompt_mask = exp.prompt_ids.device, exp.prompt_mask.bool()
    response_lengths = exp.response_mask.sum(1).tolist()
    pieces, positions, predicting, lengths, fan_out, order = [], [], [], [], [], []
    end = 0  # the row's tokens so far
    for group in prompt_groups(exp):
        prompt = exp.prompt_ids[group[0]][prompt_mask[group[0]]]
        width = len(prompt)
        pieces.append(prompt)
        positions.append(torch.arange(width, device=device))
        lengths.append(width)
        end += width
        last_of_prompt = end - 1  # predicts the first token of each response
        for sample in group:
            length = response_lengths[sample]
            pieces.append(exp.response_ids[sample, :length])
            positions.append(torch.arange(width, width + length, device=device))
            before = torch.arange(end - 1, end + length - 1, device=device)
            before[:1] = last_of_prompt
            predicting.append(before)
            lengths.append(length)
            end += length
        fan_out.append(len(group))
        order += group
    lengths_in_order = torch.tensor([response_lengths[sample] for sample in order], device=device)
    rows = torch.tensor(order, device=device).repeat_interleave(lengths_in_order)
    columns = torch.cat([torch.arange(response_lengths[sample], device=device) for sample in order])
    return PackedBatch(
        input_ids=torch.cat(pieces).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        predicting=torch.cat(predicting),
        targets=exp.response_ids[rows, columns].unsqueeze(0),
        rows=rows,
        columns=columns,
        shape=tuple(exp.response_ids.shape),
        lengths=tuple(lengths),
        fan_out=tuple(fan_out),
    )


def check_option(option: bool | None, models: list[nn.Module | None]) -> None:
    """``update.shared_prefix=True`` needs every model's attention to run shared-prefix rows (one line
    naming what runs instead); None and False need nothing."""
    if option is not True:
        return
    for model in models:
        if model is not None and not runs_per_sample(model, longest=0):
            config = getattr(model, "config", None)
            attention = getattr(config, "_attn_implementation", None)
            raise ValueError(
                "update.shared_prefix=True needs 'sdpa' attention on a llama, mistral, qwen2 or qwen3 model; "
                f"found {attention!r} attention on {getattr(config, 'model_type', None)!r}; allowed values: "
                "update.shared_prefix None (wherever a model runs it) or False"
            )
