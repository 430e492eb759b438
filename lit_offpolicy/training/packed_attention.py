"""Attention within each packed sample: one causal SDPA call per sample instead of a masked call per row.

A padding-free row (``training.packing``) holds samples of L_1 … L_k tokens, N = Σ_i L_i. Hugging
Face's "sdpa" attention keeps them apart with an N × N block-diagonal causal mask: it builds the mask
and scores all N² query-key pairs, of which it keeps Σ_i L_i (L_i + 1) / 2. Here each sample's queries
attend to its own keys in one causal ``scaled_dot_product_attention`` call, with no mask: O(Σ_i L_i²)
work. The kept pairs are the same and the dropped ones had weight exp(−∞) = 0, so the outputs are the
masked path's (``tests/training/test_packing.py``, float64). It is the role flash-attention's variable-length
kernel plays on a GPU, for machines without it (any CPU; GPUs without ``flash_attn``).

``attention_within_samples(model, lengths)`` switches a model's "sdpa" attention to this for the
forward it encloses, for the model types in ``PER_SAMPLE_MODEL_TYPES`` (plain causal softmax attention
through transformers' attention interface) when no sample is longer than a sliding window the model
uses. Anything else keeps the masked path: correct, but O(N²). The switch and the lengths are the
row attention of ``core.row_attention``, which gradient checkpointing's recomputation gets back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from lit_offpolicy.core.row_attention import RowAttention, attending, row_attention

PER_SAMPLE_SDPA = "lit_offpolicy_per_sample_sdpa"
SHARED_PREFIX_SDPA = "lit_offpolicy_shared_prefix_sdpa"
PER_SAMPLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose equality with the masked path is tested (``tests/training/test_packing.py``)."""


@torch.compiler.disable  # the lengths change every micro-batch: run eagerly inside compiled blocks
def per_sample_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: (1, H, N, D) queries, (1, H_kv, N, D) keys and values
    -> (1, N, H, D) outputs. ``attention_mask`` is None (the implementation registers no mask)."""
    row = row_attention()
    lengths = None if row is None else row.lengths
    if lengths is None or sum(lengths) != query.shape[2]:
        raise RuntimeError(
            f"{PER_SAMPLE_SDPA} attention runs only inside attention_within_samples() over a packed row; "
            f"got {query.shape[2]} tokens and sample lengths {lengths}"
        )
    samples = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    grouped = key.shape[1] != query.shape[1]  # grouped-query attention: H_kv < H
    attend = torch.nn.functional.scaled_dot_product_attention
    outputs = [
        attend(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=grouped)
        for q, k, v in samples
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PER_SAMPLE_SDPA, per_sample_sdpa)


def _groups(lengths: Sequence[int], fan_out: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
    """A shared-prefix row's groups: (prompt length, response lengths) each."""
    start = 0
    for count in fan_out:
        yield lengths[start], list(lengths[start + 1 : start + 1 + count])
        start += 1 + count


@dataclass(frozen=True)
class SharedRowIndex:
    """Where ``shared_prefix_sdpa`` takes a shared-prefix row's G prompts and S non-empty responses
    from, as two padded batches. Padding takes position 0: no real query attends to it (the mask; the
    prompts' causal order, their padding last), and no output at padding is taken back."""

    prompts: Tensor
    """(G, P_max) each prompt's row positions, right-padded."""
    queries: Tensor
    """(S, R_max) each response's row positions, right-padded."""
    keys: Tensor
    """(S, P_max + R_max) its prompt's positions (padded), then its own."""
    mask: Tensor
    """(S, 1, R_max, P_max + R_max) bool: the prompt's real tokens, and causally the response's own."""
    back: Tensor
    """(N,) where each row position's output is among the G·P_max prompt outputs, then the S·R_max."""
    longest: int
    """The longest sample, a prompt and one response."""


def shared_row_index(lengths: Sequence[int], fan_out: Sequence[int], device: torch.device) -> SharedRowIndex:
    """The ``SharedRowIndex`` of a shared-prefix row of ``lengths`` (each prompt's, then its ``fan_out``
    responses'), built on the host."""
    groups, total = list(_groups(lengths, fan_out)), sum(lengths)
    p_max = max(prompt for prompt, _ in groups)
    r_max = max((r for _, responses in groups for r in responses), default=0)
    prompts, queries, keys, prompt_lengths, back = [], [], [], [], [0] * total
    start = 0
    for prompt, responses in groups:
        for t in range(prompt):
            back[start + t] = len(prompts) * p_max + t
        prompts.append([*range(start, start + prompt), *[0] * (p_max - prompt)])
        start += prompt
        for response in responses:
            if response:
                for t in range(response):
                    back[start + t] = len(groups) * p_max + len(queries) * r_max + t
                queries.append([*range(start, start + response), *[0] * (r_max - response)])
                keys.append(prompts[-1] + queries[-1])
                prompt_lengths.append(prompt)
            start += response
    as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
    sees_prompt = torch.arange(p_max, device=device) < as_index(prompt_lengths).view(-1, 1, 1)
    causal = torch.ones(r_max, r_max, dtype=torch.bool, device=device).tril()
    count = len(queries)
    mask = torch.cat([sees_prompt.expand(count, r_max, p_max), causal.expand(count, r_max, r_max)], dim=2)
    longest = max((p + r for p, responses in groups for r in responses), default=p_max)
    return SharedRowIndex(
        as_index(prompts),
        as_index(queries).view(count, r_max),
        as_index(keys).view(count, p_max + r_max),
        mask.unsqueeze(1),
        as_index(back),
        longest,
    )


def _take(states: Tensor, index: Tensor) -> Tensor:
    """(1, h, N, D) states -> (X, h, Y, D) at the (X, Y) row positions of ``index`` (``index_select``:
    its backward adds the gradients of a position taken several times, a prompt's keys, in one pass)."""
    return states[0].index_select(1, index.flatten()).unflatten(1, index.shape).transpose(0, 1)


@torch.compiler.disable  # the row's layout changes every micro-batch: run eagerly inside compiled blocks
def shared_prefix_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract over a shared-prefix row: one causal SDPA call over
    the G prompts, padded to a batch, and one over the S responses, each of whose R queries sees its
    prompt's keys and causally its own (``SharedRowIndex.mask``); padding is never attended to by a
    real query. (1, H, N, D) queries, (1, H_kv, N, D) keys and values -> (1, N, H, D)."""
    row = row_attention()
    index = None if row is None else row.shared
    if index is None or index.back.numel() != query.shape[2]:
        raise RuntimeError(
            f"{SHARED_PREFIX_SDPA} attention runs only inside attention_within_samples(shared=...) over a "
            f"shared-prefix row; got {query.shape[2]} tokens and the row attention {row}"
        )
    attend = functools.partial(
        torch.nn.functional.scaled_dot_product_attention,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],  # grouped-query attention: H_kv < H
    )
    prompts = (_take(states, index.prompts) for states in (query, key, value))
    outputs = [attend(*prompts, is_causal=True)]
    if index.queries.numel():
        keys, values = _take(key, index.keys), _take(value, index.keys)
        outputs.append(attend(_take(query, index.queries), keys, values, attn_mask=index.mask))
    # (G·P_max + S·R_max, H, D): every output position, prompts' then responses'
    flat = torch.cat([output.transpose(1, 2).flatten(0, 1) for output in outputs])
    return flat[index.back].unsqueeze(0), None


AttentionInterface.register(SHARED_PREFIX_SDPA, shared_prefix_sdpa)


def _switchable_configs(model: nn.Module, longest: int) -> list:
    """The distinct configs in ``model`` (wrappers, critic heads and adapters included) whose attention
    can run per sample for samples of at most ``longest`` tokens."""
    configs: dict[int, object] = {}
    for config in _attention_configs(model):
        if (
            getattr(config, "_attn_implementation", None) == "sdpa"
            and getattr(config, "model_type", None) in PER_SAMPLE_MODEL_TYPES
            and not _window_cuts(config, longest)
        ):
            configs[id(config)] = config
    return list(configs.values())


def _attention_configs(model: nn.Module) -> list:
    """The distinct configs in ``model`` that name an attention implementation."""
    configs = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) is not None:
            configs[id(config)] = config
    return list(configs.values())


def _window_cuts(config, longest: int) -> bool:
    """Whether a sliding window shorter than ``longest`` tokens applies to some layer."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return False
    return longest > window


def runs_per_sample(model: nn.Module, longest: int) -> bool:
    """Whether every attention of ``model`` can run ``per_sample_sdpa`` or ``shared_prefix_sdpa`` for
    samples (a prompt and one response) of at most ``longest`` tokens."""
    configs = _attention_configs(model)
    return bool(configs) and len(_switchable_configs(model, longest)) == len(configs)


@contextlib.contextmanager
def attention_within_samples(
    model: nn.Module,
    lengths: Sequence[int],
    implementation: str = PER_SAMPLE_SDPA,
    group: object = None,
    shared: SharedRowIndex | None = None,
) -> Iterator[tuple]:
    """Inside: ``model``'s forward over a packed row of samples of ``lengths`` tokens attends within each
    sample, one causal SDPA call each (see the module docstring for which models), or by another
    registered ``implementation`` reading ``row_attention()`` (``group``: its process group). With
    ``shared`` the row is a shared-prefix row (``training.shared_prefix``) and attends by
    ``shared_prefix_sdpa``. Yields the configs switched."""
    lengths = tuple(int(n) for n in lengths)
    if shared is not None:
        implementation = SHARED_PREFIX_SDPA
    longest = max(lengths, default=0) if shared is None else shared.longest
    configs = tuple(_switchable_configs(model, longest))
    with attending(RowAttention(lengths, implementation, configs, group, shared)):
        yield configs
