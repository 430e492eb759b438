"""Teacher-forced passes (lit_offpolicy.training.forward): the LM head only at the response positions.

Real parts: the built-in tiny Llama (float64, so that the two paths agree to rounding) and batches of
prompts of different lengths (left padding) with responses of different lengths (right padding).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import reordered_sums
from torch import nn

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.models import load_actor
from lit_offpolicy.training import chunked_head
from lit_offpolicy.training.forward import policy_log_probs, position_ids, response_logits, supports_chunks


class WithoutLogitsToKeep(nn.Module):
    """The same model behind a forward that has no ``logits_to_keep``: every position comes back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    return load_actor(tiny_model_dir, dtype=torch.float64).eval()


def _experience(response_lengths: list[int]) -> Experience:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    generator = torch.Generator().manual_seed(0)
    groups = []
    for i in range(len(prompts)):
        length = response_lengths[i]
        tokens = torch.randint(3, 100, (length,), generator=generator).tolist()
        groups.append([Generation(tokens, [-1.0] * length, "length")])
    return Experience.from_generations(
        prompts, groups, [0.0] * len(prompts), pad_token_id=0, policy_version=0
    )


def _every_position_then_slice(model: nn.Module, exp: Experience) -> torch.Tensor:
    """The reference: logits at every position, then those predicting response tokens P − 1 … P + R − 2."""
    mask = exp.attention_mask
    logits = model(
        input_ids=exp.input_ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False
    ).logits
    prompt_len, response_len = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    return logits[:, prompt_len - 1 : prompt_len + response_len - 1]


@torch.no_grad()
def test_response_logits_are_those_of_the_full_pass(actor):
    exp = _experience([4, 1, 3])
    kept = response_logits(actor, exp)
    assert kept.shape == (3, 4, 100)
    # float64, the LM head on fewer positions: each logit is the same 128-term sum (logits ≤ 1), grouped
    # perhaps otherwise by the kernel: 2 × eps64 × √128 ≈ 5e-15 ≪ 1e-12 (see below on RMSNorm)
    torch.testing.assert_close(kept, _every_position_then_slice(actor, exp), rtol=0, atol=1e-12)


@torch.no_grad()
def test_a_model_without_logits_to_keep_is_sliced(actor):
    exp = _experience([2, 5, 1])
    wrapped = WithoutLogitsToKeep(actor)
    # float64, as above: ≈ 5e-15 ≪ 1e-12
    torch.testing.assert_close(response_logits(wrapped, exp), response_logits(actor, exp), rtol=0, atol=1e-12)


def test_log_probs_entropy_and_gradient_match_the_full_pass(actor):
    """The training path: log-probs, entropy and the gradient of a loss through both."""
    exp = _experience([3, 2, 4])
    losses = []
    for model in (actor, WithoutLogitsToKeep(actor)):
        actor.zero_grad()
        log_probs, entropy = policy_log_probs(model, exp, temperature=0.7, with_entropy=True)
        loss = (log_probs * exp.response_mask).sum() + (entropy * exp.response_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None])
        losses.append((log_probs.detach(), entropy.detach(), grads))
    (lp, ent, grad), (lp_ref, ent_ref, grad_ref) = losses
    # float64: the head's 128-term sums and the gradient's sums over ≤ 512 terms in 4 blocks, grouped
    # otherwise: 2 × 4 × eps64 × √512 × S ≈ 4e-14·S, S ≤ 6 for the log-probs (1e-12) and the gradient
    # (1e-10, whose largest entries are sums over every position). Llama's RMSNorm rounds its output to
    # float32 even in a float64 model; both paths round the same values, which differ by ~1e-15, so a
    # rounding flips only for a value within that of a float32 rounding boundary (~1e-8 per value).
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-10)
    assert grad.abs().max() > 0
    actor.zero_grad()


@torch.no_grad()
def test_empty_responses_give_no_positions(actor):
    exp = _experience([0, 0, 0])
    assert exp.response_ids.shape == (3, 0)
    assert response_logits(actor, exp).shape == (3, 0, 100)
    assert response_logits(WithoutLogitsToKeep(actor), exp).shape == (3, 0, 100)


# ----------------------------------------------------------------------------- the LM head in chunks


def _values_and_gradient(actor, exp, chunk_size, with_entropy):
    """log-probs, entropy and d/dθ of Σ mask·(log π + 0.3·H), through ``policy_log_probs``."""
    actor.zero_grad()
    log_probs, entropy = policy_log_probs(actor, exp, 0.7, with_entropy=with_entropy, chunk_size=chunk_size)
    loss = (log_probs * exp.response_mask).sum()
    if with_entropy:
        loss = loss + 0.3 * (entropy * exp.response_mask).sum()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None])
    actor.zero_grad()
    return log_probs.detach(), None if entropy is None else entropy.detach(), grads


@pytest.mark.parametrize("head_path", ["own_backward", "checkpointed"])
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("lengths", [[3, 2, 4], [0, 5, 1]])
def test_chunked_log_probs_entropy_and_gradient_equal_the_plain_path(
    actor, chunk_size, with_entropy, lengths, head_path, monkeypatch
):
    """float64, temperature 0.7, left-padded prompts, right-padded responses (one empty), chunks of one
    token, of 3 (not dividing B·R) and larger than B·R: the same values at every position, padding
    included, and the same gradient w.r.t. every parameter. Both ways of running the chunks: the
    linear head's own backward (``chunked_head``) and, as for any other head, checkpointing."""
    if head_path == "checkpointed":
        monkeypatch.setattr(chunked_head, "applies", lambda head: False)
    exp = _experience(lengths)
    plain = _values_and_gradient(actor, exp, None, with_entropy)
    chunked = _values_and_gradient(actor, exp, chunk_size, with_entropy)
    assert chunked[0].shape == exp.response_ids.shape
    for ours, theirs in zip(chunked, plain, strict=True):  # float64: as in the test above, ≲ 4e-14·S
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)
    assert plain[2].abs().max() > 0


def test_chunked_log_probs_match_in_float32(tiny_model_dir):
    """The model's own dtype, float32: agreement to summation order."""
    actor32 = load_actor(tiny_model_dir, dtype=torch.float32)
    exp = _experience([4, 1, 3])
    plain = _values_and_gradient(actor32, exp, None, True)
    chunked = _values_and_gradient(actor32, exp, 2, True)
    for ours, theirs in zip(chunked, plain, strict=True):
        # only the LM head's sums are grouped otherwise (its 128-term dot products, its gradient's sum
        # over positions); the blocks then repeat the same sums on inputs off by that: 2 × eps32 × √128
        # = 2.7e-6 of the largest value (≈ 5.3: 1.4e-5; measured 2.7e-6 with ATEN_CPU_CAPABILITY=default)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=reordered_sums(theirs, terms=128))


def test_all_responses_empty_give_empty_chunked_log_probs(actor):
    exp = _experience([0, 0, 0])
    log_probs, entropy = policy_log_probs(actor, exp, 0.7, with_entropy=True, chunk_size=4)
    assert log_probs.shape == entropy.shape == (3, 0)


def test_a_model_without_logits_to_keep_takes_the_plain_path(actor):
    exp = _experience([2, 3, 1])
    wrapped = WithoutLogitsToKeep(actor)
    assert not supports_chunks(wrapped) and supports_chunks(actor)
    with torch.no_grad():
        ours = policy_log_probs(wrapped, exp, 0.7, chunk_size=2)[0]
        theirs = policy_log_probs(actor, exp, 0.7)[0]
    # float64, the plain path's head on every position against the chunked one: ≈ 5e-15·|lp| ≪ 1e-12
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_the_head_is_restored_after_a_chunked_pass(actor):
    head = actor.get_output_embeddings()
    with torch.no_grad():
        policy_log_probs(actor, _experience([2, 2, 2]), 1.0, chunk_size=2)
    assert "forward" not in vars(head)


# ----------------------------------------------------------------------------- under FSDP2


def test_fsdp2_finds_no_view_among_the_models_outputs(tiny_model_dir, tmp_path):
    """FSDP2 registers the backward's all-gather on a sharded model's output and warns ("returned a view
    tensor ... wrong gradients") where that output is a view: an in-place op on it would drop the hook.
    The chunked head's log-probs (a reshape) and the critic's values (a squeeze) were views: the warning
    came once per rank of every FSDP2 run, sequence-parallel or not. One gloo rank, the strategy's
    sharding (``shard_fsdp2``), the padded and the packed passes with their backward."""
    import warnings
    from types import SimpleNamespace

    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_offpolicy.models import load_critic
    from lit_offpolicy.training.forward import critic_values
    from lit_offpolicy.training.strategy import shard_fsdp2

    ours = not dist.is_initialized()  # else a vLLM test in this process made it: one rank too
    if ours:
        dist.init_process_group(
            "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
        )
    try:
        strategy = ModelParallelStrategy()
        strategy.parallel_devices = [torch.device("cpu")]
        models = SimpleNamespace(actor=load_actor(tiny_model_dir), critic=load_critic(tiny_model_dir))
        shard_fsdp2(strategy, models)
        exp = _experience([3, 0, 2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for padding_free in (False, True):
                log_probs, entropy = policy_log_probs(models.actor, exp, 0.7, True, 2, padding_free)
                values = critic_values(models.critic, exp, padding_free)
                (log_probs.sum() + entropy.sum() + values.sum()).backward()
    finally:
        if ours:
            dist.destroy_process_group()
    assert not [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert all(p.grad is not None for p in models.actor.parameters())
