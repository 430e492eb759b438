"""Teacher-forced passes over an Experience: the policy's log-probs and entropy, the critic's values.

Each pass takes the padded layout (left-padded prompts, right-padded responses) or, with
``padding_free``, the packed one (``lit_offpolicy.training.packing``); both return (B, R) tensors, with the
same values at the response tokens. With a ``sequence`` group the packed row is split across its ranks
(``lit_offpolicy.training.sequence_shard``), with the same results on every rank of the group.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.logprobs import at_least_float32, token_log_probs
from lit_offpolicy.losses import entropy_from_logits
from lit_offpolicy.training import chunked_head
from lit_offpolicy.training.packing import PackedBatch, pack
from lit_offpolicy.training.sequence_parallel import SequenceGroup
from lit_offpolicy.training.sequence_shard import SequenceShard, shard
from lit_offpolicy.training.shared_prefix import shared_row

# configs whose causal LM transforms the head's logits before returning them (Gemma 2's soft-capping,
# Cohere's scale): the chunked path applies the bare head, so these models take the plain path
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale")
LOGPROB_CHUNK_SIZE: int | None = 256
"""The module's default ``logprob_chunk_size``: on CPU (benchmarks/pytorch/logprob_chunks.py, vocabularies of
32000 and 151936) 256-token chunks made an update 1.5x faster than the whole logits and cut its peak
extra memory 1.6x and 3.9x (docs/parameters.md)."""


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as ``generate`` assigns them: 0 at each row's first real token."""
    return (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)


def _forward(model: nn.Module, exp: Experience, **kwargs):
    attention_mask = exp.attention_mask
    return model(
        input_ids=exp.input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        **kwargs,
    )


def _packed_forward(model: nn.Module, packed: PackedBatch | SequenceShard, **kwargs):
    """The packed row (or this rank's shard of it) without an attention mask: each sample attends to
    itself only, by one attention call per sample (``lit_offpolicy.training.packed_attention``) or, for other
    models, by the mask the model builds from the restarting positions."""
    with packed.attention(model):
        return model(
            input_ids=packed.input_ids,
            attention_mask=None,
            position_ids=packed.position_ids,
            use_cache=False,
            **kwargs,
        )


def _at_response(per_position: Tensor, exp: Experience) -> Tensor:
    """The positions that predict each response token: P − 1 … P + R − 2 of the prompt+response input."""
    prompt_len, response_len = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    return per_position[:, prompt_len - 1 : prompt_len + response_len - 1]


def response_logits(model: nn.Module, exp: Experience) -> Tensor:
    """The logits at the positions that predict the response tokens, (B, R, V).

    A Hugging Face causal LM is asked for its last R + 1 positions only (``logits_to_keep``): the LM
    head and its B × L × V output, the largest activation of a step for a real vocabulary, then cover
    the response instead of prompt + response. The last kept position predicts past the response and
    is dropped. A model without ``logits_to_keep`` returns every position and is sliced.
    """
    if _accepts_logits_to_keep(model):
        response_len = exp.response_ids.shape[1]
        return _forward(model, exp, logits_to_keep=response_len + 1).logits[:, :-1]
    return _at_response(_forward(model, exp).logits, exp)


def _row(
    model: nn.Module, exp: Experience, padding_free: bool, sequence: SequenceGroup | None, shared_prefix: bool
) -> PackedBatch | SequenceShard | None:
    """``exp`` packed (``padding_free``), and split across the ``sequence`` group where there is one; with
    ``shared_prefix``, as shared-prefix rows where ``model`` runs them (``training.shared_prefix``)."""
    if sequence is not None:
        return shard(pack(exp), sequence)
    row = shared_row(model, exp) if shared_prefix else None
    if row is not None:
        return row
    return pack(exp) if padding_free else None


def _packed_response_logits(model: nn.Module, packed: PackedBatch | SequenceShard) -> Tensor:
    """The logits at the packed positions that predict the response tokens, (1, T, V): the positions
    themselves as ``logits_to_keep`` where the model takes it, otherwise every position, then indexed."""
    if _accepts_logits_to_keep(model):
        return _packed_forward(model, packed, logits_to_keep=packed.predicting).logits
    return _packed_forward(model, packed).logits[:, packed.predicting]


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    # a peft model (LoRA actor) passes its keyword arguments on to the causal LM it wraps
    wrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(wrapped.forward).parameters


def policy_log_probs(
    model: nn.Module,
    exp: Experience,
    temperature: float,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    padding_free: bool = False,
    sequence: SequenceGroup | None = None,
    shared_prefix: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log π(response token | prefix) at ``temperature`` (the engines' convention), and the entropy.

    (B, R) each, 0 at padding with ``padding_free``.

    ``chunk_size``: tokens per LM-head chunk (``chunked_log_probs``), for a model that supports it
    (``supports_chunks``); None, or any other model: the (B, R, V) logits at once.
    ``padding_free``: one packed row (``lit_offpolicy.training.packing``) instead of the padded batch.
    ``sequence``: the packed row split across this sequence group (``padding_free`` implied).
    ``shared_prefix``: each prompt once for the samples sharing it, where ``model`` runs that
    (``training.shared_prefix``; ``sequence`` takes precedence).
    """
    packed = _row(model, exp, padding_free, sequence, shared_prefix)
    if chunk_size is not None and supports_chunks(model):
        return chunked_log_probs(model, exp, temperature, chunk_size, with_entropy, packed)
    if packed is None:
        logits, tokens = response_logits(model, exp), exp.response_ids
    else:
        logits, tokens = _packed_response_logits(model, packed), packed.targets
    log_probs = token_log_probs(logits, tokens, temperature)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(at_least_float32(logits) / (temperature if temperature > 0 else 1.0))
    if packed is None:
        return log_probs, entropy
    return packed.unpack(log_probs), None if entropy is None else packed.unpack(entropy)


def supports_chunks(model: nn.Module) -> bool:
    """Whether ``chunked_log_probs`` can run the model's LM head in chunks.

    It can for a causal LM whose logits are its output embedding (LM head) applied to its last hidden
    states, unchanged (no soft-capping or scale), and that keeps only its last positions
    (``logits_to_keep``).

    Not under DeepSpeed ZeRO-3 (parameters with a ``ds_id``): it gathers the head's weight only around
    the head's own calls, and the backward's recomputation of a chunk would find it partitioned.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Module) or not _accepts_logits_to_keep(model):
        return False
    config = getattr(model, "config", None)
    transformed = any(getattr(config, name, None) for name in _LOGIT_TRANSFORMS)
    partitioned = any(hasattr(p, "ds_id") for p in head.parameters())
    return not transformed and not partitioned


def chunked_log_probs(
    model: nn.Module,
    exp: Experience,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    packed: PackedBatch | SequenceShard | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``policy_log_probs`` without the (B, R, V) logits: the LM head in chunks of ``chunk_size`` tokens.

    The model runs its own forward (so that strategies' hooks, FSDP2's gathers, see a normal call)
    with its head replaced, for that call, by ``_head_statistics``: for each chunk of the B·R response
    positions, z = head(h) / T in float32, log π = z[token] − logsumexp(z) and, with entropy,
    H = logsumexp(z) − Σ_v softmax(z)_v z_v. Only one chunk's logits exist at a time, in the forward
    and again in the backward, which recomputes them (``_head_statistics``: a plain linear head by
    ``chunked_head``'s own backward, any other under activation checkpointing); the values and
    gradients are the plain path's. ``packed``: ``exp``
    packed (``lit_offpolicy.training.packing.pack``), whose T response positions are the head's input.
    """
    scale = temperature if temperature > 0 else 1.0
    head = model.get_output_embeddings()
    tokens = exp.response_ids if packed is None else packed.targets
    statistics = _head_statistics(head, tokens, scale, chunk_size, with_entropy)
    with _replaced_forward(head, statistics):
        if packed is None:
            stacked = _forward(model, exp, logits_to_keep=exp.response_ids.shape[1] + 1).logits
        else:
            stacked = packed.unpack(_packed_forward(model, packed, logits_to_keep=packed.predicting).logits)
    if not with_entropy:
        return stacked, None
    return stacked[..., 0], stacked[..., 1]


@contextlib.contextmanager
def _replaced_forward(module: nn.Module, forward) -> Iterator[None]:
    """``module``'s forward is ``forward`` inside the block (its hooks still run around it)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward  # the instance attribute: the class's forward again


def _head_statistics(head: nn.Module, tokens: Tensor, scale: float, chunk_size: int, with_entropy: bool):
    """The head's replacement: hidden states (B, R + 1, H) -> log-probs (B, R), or (B, R, 2) with the
    entropy; the last position predicts past the response and is dropped (packed: (1, T, H), all kept).

    A plain linear head takes ``chunked_head`` (its own backward, one buffer for the weight's
    gradient); any other, each chunk of ``_chunk_statistics`` under non-reentrant checkpointing."""
    head_forward = head.forward

    def statistics(hidden: Tensor) -> Tensor:
        batch, width = tokens.shape
        flat_hidden = hidden[:, :width].reshape(batch * width, hidden.shape[-1])
        flat_tokens = tokens.reshape(-1)
        if chunked_head.applies(head):
            stacked = chunked_head.head_statistics(
                head, flat_hidden, flat_tokens, scale, chunk_size, with_entropy
            )
        else:
            parts = [
                checkpoint(
                    _chunk_statistics,
                    head_forward,
                    flat_hidden[start : start + chunk_size],
                    flat_tokens[start : start + chunk_size],
                    scale,
                    with_entropy,
                    use_reentrant=False,
                )
                for start in range(0, max(batch * width, 1), chunk_size)  # one (empty) chunk for R = 0
            ]
            stacked = torch.cat(parts)
        # a copy (B·R values), not a view: this is the model's output, on which FSDP2 registers the
        # backward's all-gather; it warns of a view output, which an in-place op would cut off from it
        return (stacked.reshape(batch, width, 2) if with_entropy else stacked.reshape(batch, width)).clone()

    return statistics


def _chunk_statistics(
    head_forward, hidden: Tensor, tokens: Tensor, scale: float, with_entropy: bool
) -> Tensor:
    """z = head(h) / T (float32 or wider): log π = z[token] − logsumexp(z), shape (N,); with the entropy
    H = logsumexp(z) − Σ_v softmax(z)_v z_v, the pair (log π, H), shape (N, 2)."""
    scaled = at_least_float32(head_forward(hidden)) / scale
    log_norm = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    if not with_entropy:
        return log_probs
    entropy = log_norm - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
    return torch.stack((log_probs, entropy), dim=-1)


def critic_values(
    critic: nn.Module,
    exp: Experience,
    padding_free: bool = False,
    sequence: SequenceGroup | None = None,
    shared_prefix: bool = False,
) -> Tensor:
    """V(prefix) for the state before each response token (the critic returns one value per position);
    ``padding_free``: from one packed row, 0 at padding; ``sequence``, ``shared_prefix``: as
    ``policy_log_probs``."""
    packed = _row(critic, exp, padding_free, sequence, shared_prefix)
    if packed is None:
        return _at_response(_forward(critic, exp), exp).float()
    return packed.unpack(_packed_forward(critic, packed)[:, packed.predicting]).float()


@torch.no_grad()
def frozen_log_probs(
    model: nn.Module,
    exp: Experience,
    temperature: float,
    micro_batches: int | Sequence[Tensor],
    chunk_size: int | None = None,
    padding_free: bool = False,
    sequence: SequenceGroup | None = None,
    shared_prefix: bool = False,
) -> Tensor:
    """log-probs without gradient, by micro-batch: ``micro_batches`` samples at a time, or the groups of
    sample indices it lists (each a forward; the results go back to their samples' rows).
    ``chunk_size``, ``padding_free``, ``sequence``, ``shared_prefix``: as ``policy_log_probs``."""
    groups = torch.arange(len(exp)).split(micro_batches) if isinstance(micro_batches, int) else micro_batches
    options = (chunk_size, padding_free, sequence, shared_prefix)
    parts = [
        policy_log_probs(model, part, temperature, False, *options)[0]
        for part in (exp.select(group.to(exp.response_ids.device)) for group in groups)
    ]
    order = torch.cat(list(groups)).to(exp.response_ids.device)
    return torch.cat(parts)[torch.argsort(order)]
