"""Padding-free batches (training/packing.py) and token-budget micro-batches (training/micro_batches.py).

Real parts: tiny Llama, Qwen2, Qwen3 and Mistral in float64, so that the packed and the padded layouts
agree to rounding; batches with left-padded prompts of different lengths and right-padded responses of
0 (empty), 1 and more tokens.

Tolerances: the layouts group the same float64 sums differently (≤ 512 terms, the MLP, in each of
the 2 to 4 blocks, on both paths): 2 × 4 × eps64 (2.2e-16) × √512 × S ≈ 4e-14·S, with S ≤ 7 for
log-probs, entropies and values (atol 1e-12) and larger for gradient entries, which sum over every
position (1e-11). The RMSNorms round their output to float32 even in a float64 model: both layouts
round values ~1e-15 apart, so a rounding flips only for a value that close to a float32 boundary
(none in 120 packed-against-padded batches, with either CPU kernel path).
"""

from __future__ import annotations

import pytest
import torch
from helpers.experiences import experience, with_update_inputs
from transformers import AttentionInterface

import lit_offpolicy.training.packed_attention as packed_attention
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.logprobs import token_log_probs
from lit_offpolicy.losses import LOSS_AGG_MODES, PPO, micro_batch_weight
from lit_offpolicy.models import create_tiny_model, load_actor, load_critic
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.training.forward import critic_values, frozen_log_probs, policy_log_probs
from lit_offpolicy.training.micro_batches import by_size, by_token_budget, equalized
from lit_offpolicy.training.options import KLOptions, LossOptions, UpdateOptions
from lit_offpolicy.training.packed_attention import PER_SAMPLE_SDPA, attention_within_samples, per_sample_sdpa
from lit_offpolicy.training.packing import pack, sample_lengths


def test_pack_lays_samples_end_to_end_by_hand():
    exp = Experience.from_generations(
        [[5, 6, 7], [8]],
        [[Generation([20, 21], [0.0, 0.0], "stop")], [Generation([22], [0.0], "stop")]],
        [0.0, 0.0],
        pad_token_id=0,
        policy_version=0,
        response_width=3,
    )
    packed = pack(exp)
    assert packed.input_ids.tolist() == [[5, 6, 7, 20, 21, 8, 22]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed.predicting.tolist() == [2, 3, 5]  # 7 predicts 20, 20 predicts 21, 8 predicts 22
    assert packed.targets.tolist() == [[20, 21, 22]]
    assert packed.unpack(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]
    assert sample_lengths(exp).tolist() == [5, 2]


def test_an_empty_prompt_is_a_clear_error():
    exp = experience()
    exp.prompt_mask[1] = 0
    with pytest.raises(ValueError, match="padding_free=True needs at least one prompt token"):
        pack(exp)


def _log_probs_and_gradient(model, exp, chunk_size, padding_free):
    model.zero_grad()
    log_probs, entropy = policy_log_probs(model, exp, 0.7, True, chunk_size, padding_free)
    weights = torch.linspace(-1.0, 2.0, log_probs.numel(), dtype=log_probs.dtype).reshape(log_probs.shape)
    ((weights * log_probs + 0.3 * entropy) * exp.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_packed_log_probs_entropy_and_gradient_equal_the_padded_path(model_dir, chunk_size):
    model = load_actor(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    exp = experience()
    mask = exp.response_mask.bool()
    padded = _log_probs_and_gradient(model, exp, chunk_size, padding_free=False)
    packed = _log_probs_and_gradient(model, exp, chunk_size, padding_free=True)
    assert torch.allclose(packed[0][mask], padded[0][mask], atol=1e-12, rtol=0)  # float64, see above
    assert torch.allclose(packed[1][mask], padded[1][mask], atol=1e-12, rtol=0)
    assert not packed[0][~mask].any() and not packed[1][~mask].any()  # 0 at padding
    assert packed[2].keys() == padded[2].keys() and len(padded[2]) > 10
    for name, grad in padded[2].items():  # float64 gradients: 1e-11, see above
        assert torch.allclose(packed[2][name], grad, atol=1e-11, rtol=0), name


def test_packed_gradient_under_gradient_checkpointing_equals_the_padded_path(model_dir):
    """The backward recomputes each block after the packed forward's attention switch has ended: it gets
    the switch back (``core.row_attention``) instead of attending across samples (which stopped the
    backward with torch.utils.checkpoint's "different number of tensors" error before)."""
    model = load_actor(model_dir, torch.float64, gradient_checkpointing=True, attn_implementation="sdpa")
    exp = experience()
    padded = _log_probs_and_gradient(model, exp, 3, padding_free=False)
    packed = _log_probs_and_gradient(model, exp, 3, padding_free=True)
    assert packed[2].keys() == padded[2].keys() and len(padded[2]) > 10
    for name, grad in padded[2].items():  # float64 gradients: 1e-11, as above
        assert torch.allclose(packed[2][name], grad, atol=1e-11, rtol=0), name


# sdpa: float64, see above. Eager attention takes its softmax in float32: its sums over ≤ 20 positions
# round to eps32·√20 = 5.3e-7 relative, in each of 4 blocks, on both paths: 2 × 4 × 5.3e-7 × |lp| ≤ 4.9
# ≈ 2e-5 (measured: 4e-8); a sample that saw another would be off by > 1e-3
@pytest.mark.parametrize(("attention", "tolerance"), [("sdpa", 1e-12), ("eager", 2e-5)])
def test_packed_samples_do_not_attend_to_each_other(tiny_model_dir, attention, tolerance):
    """Each sample's log-probs are those of the sample packed alone, whatever precedes it in the row."""
    model = load_actor(tiny_model_dir, dtype=torch.float64, attn_implementation=attention)
    exp = experience((4, 3, 2), width=4)
    together = policy_log_probs(model, exp, 1.0, padding_free=True)[0]
    for i in range(len(exp)):
        alone = policy_log_probs(model, exp.select(torch.tensor([i])), 1.0, padding_free=True)[0]
        assert torch.allclose(together[i], alone[0], atol=tolerance, rtol=0), i
    # the same row read as one sequence (positions 0 … N − 1): later samples see earlier ones, and differ
    packed = pack(exp)
    positions = torch.arange(packed.input_ids.shape[1]).unsqueeze(0)
    logits = model(input_ids=packed.input_ids, position_ids=positions).logits[:, packed.predicting]
    crossing = packed.unpack(token_log_probs(logits, packed.targets))
    assert torch.allclose(crossing[0], together[0], atol=tolerance, rtol=0)
    assert (crossing[1:] - together[1:]).abs().max() > 1e-3


def _attention_calls(monkeypatch) -> list[int]:
    """Record the row length of each per-sample attention call (the registered function, wrapped)."""
    calls = []

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return per_sample_sdpa(module, query, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, PER_SAMPLE_SDPA, counting)
    return calls


def test_per_sample_attention_equals_the_masked_row(model_dir, monkeypatch):
    """One causal SDPA call per sample = transformers' block-diagonal mask over the row: log-probs,
    entropy and gradients, float64, with an empty and a one-token response in the row."""
    model = load_actor(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    exp = experience()
    mask = exp.response_mask.bool()
    calls = _attention_calls(monkeypatch)
    per_sample = _log_probs_and_gradient(model, exp, None, padding_free=True)
    layers = model.config.num_hidden_layers
    assert calls == [int(exp.attention_mask.sum())] * layers  # every layer, the whole row
    assert model.config._attn_implementation == "sdpa"  # switched back after the forward
    monkeypatch.setattr(packed_attention, "PER_SAMPLE_MODEL_TYPES", frozenset())  # the masked row
    masked = _log_probs_and_gradient(model, exp, None, padding_free=True)
    assert len(calls) == layers
    for ours, theirs in zip(per_sample[:2], masked[:2], strict=True):  # float64, see the module's note
        assert torch.allclose(ours[mask], theirs[mask], atol=1e-12, rtol=0)
    for name, grad in masked[2].items():
        assert torch.allclose(per_sample[2][name], grad, atol=1e-11, rtol=0), name


def test_a_sliding_window_shorter_than_a_sample_keeps_the_masked_row(tmp_path, monkeypatch):
    """Mistral with a 4-token window: samples of up to 12 tokens take transformers' windowed mask (and
    equal the padded path); with a window of 12 they attend per sample."""
    model = load_actor(create_tiny_model(tmp_path / "m", seed=0, arch="mistral"), dtype=torch.float64)
    exp = experience()
    calls = _attention_calls(monkeypatch)
    model.config.sliding_window = 4
    packed = policy_log_probs(model, exp, 1.0, padding_free=True)[0]
    padded = policy_log_probs(model, exp, 1.0)[0]
    mask = exp.response_mask.bool()
    assert calls == [] and torch.allclose(packed[mask], padded[mask], atol=1e-12, rtol=0)  # float64
    model.config.sliding_window = 12
    policy_log_probs(model, exp, 1.0, padding_free=True)
    assert len(calls) == model.config.num_hidden_layers


def test_per_sample_attention_outside_a_packed_forward_is_a_clear_error(tiny_model_dir):
    model = load_actor(tiny_model_dir, dtype=torch.float64)
    with attention_within_samples(model, [3, 2]):
        assert model.config._attn_implementation == PER_SAMPLE_SDPA
        with pytest.raises(RuntimeError, match="got 4 tokens and sample lengths \\(3, 2\\)"):
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="only inside attention_within_samples"):
        per_sample_sdpa(model.model.layers[0].self_attn, *[torch.zeros(1, 4, 2, 8)] * 3, None)


def test_packed_critic_values_and_gradient_equal_the_padded_path(model_dir):
    torch.manual_seed(0)  # the new value head
    critic = load_critic(model_dir, dtype=torch.float64, attn_implementation="sdpa")
    exp = experience()
    mask = exp.response_mask.bool()
    results = []
    for padding_free in (False, True):
        critic.zero_grad()
        values = critic_values(critic, exp, padding_free)
        (values * exp.response_mask).square().sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
    (padded, padded_grads), (packed, packed_grads) = results
    # float64, see the module's note: 1e-12 for values, 1e-11 for gradients
    assert torch.allclose(packed[mask], padded[mask], atol=1e-12, rtol=0)
    assert not packed[~mask].any()
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-11, rtol=0), name


def test_frozen_log_probs_put_index_groups_back_in_sample_order(tiny_model_dir):
    model = load_actor(tiny_model_dir, dtype=torch.float64)
    exp = experience()
    whole = frozen_log_probs(model, exp, 1.0, micro_batches=4)
    groups = [torch.tensor([3, 0]), torch.tensor([2]), torch.tensor([1])]
    grouped = frozen_log_probs(model, exp, 1.0, groups, chunk_size=2, padding_free=True)
    mask = exp.response_mask.bool()
    assert torch.allclose(grouped[mask], whole[mask], atol=1e-12, rtol=0)  # float64, see the module's note


# ----------------------------------------------------------------------------- token budget


def test_token_budget_groups_by_hand():
    # first-fit decreasing, budget 10: 9 -> [9]; 7 -> [7]; 5 -> [5]; 3 -> [7, 3]; 2 -> [5, 2]
    groups = by_token_budget(torch.tensor([5, 9, 3, 7, 2]), budget=10)
    assert [g.tolist() for g in groups] == [[1], [2, 3], [0, 4]]
    assert [g.tolist() for g in by_size(5, 2)] == [[0, 1], [2, 3], [4]]
    assert [g.tolist() for g in by_size(3, None)] == [[0, 1, 2]]


def test_a_sample_over_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="update.max_tokens_per_micro_batch=8 is smaller than a sample of 9"):
        by_token_budget(torch.tensor([3, 9]), budget=8)


def test_both_micro_batch_options_is_a_clear_error():
    with pytest.raises(ValueError, match="allowed values: set one of them"):
        UpdateOptions(micro_batch_size=2, max_tokens_per_micro_batch=100)


def test_fewer_groups_than_another_rank_are_split_to_as_many():
    """Under data parallelism a rank with fewer token-budget groups than another splits its widest
    (of two samples or more), so that every rank makes as many backward passes; each group stays
    within the budget and every sample is in one group."""
    lengths = torch.tensor([2, 3, 4, 5, 6, 4])
    groups = by_token_budget(lengths, budget=12)
    assert [g.tolist() for g in groups] == [[3, 4], [1, 2, 5], [0]]  # 11, 11, 2 tokens
    assert [g.tolist() for g in equalized(groups, lengths, target=3)] == [[3, 4], [1, 2, 5], [0]]
    split = [g.tolist() for g in equalized(groups, lengths, target=5)]
    assert split == [[3], [4], [1], [2, 5], [0]]  # [3, 4] halved, then [1, 2, 5]
    pairs = equalized([torch.tensor([0]), torch.tensor([1, 2])], lengths, target=3)
    assert [g.tolist() for g in pairs] == [[0], [1], [2]]


@pytest.fixture(scope="module")
def module64(tiny_model_dir):
    module = OffPolicyModule(
        model_path=tiny_model_dir,
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        loss=LossOptions(entropy_coef=0.01),
        attn_implementation="sdpa",
    )
    return module.double()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_token_budget_micro_batches_accumulate_the_mini_batch_gradient(module64, mode):
    """Σ_micro w·∇loss(micro) over uneven, packed token-budget micro-batches = ∇loss(mini-batch) of the
    padded path, in float64, for every aggregation mode (policy loss, KL loss, entropy bonus)."""
    module64.policy_loss = PPO(loss_agg_mode=mode)
    exp = with_update_inputs(experience((4, 0, 1, 6, 2, 5), seed=1))

    def gradient(padding_free: bool, budget: int | None) -> dict[str, torch.Tensor]:
        module64.zero_grad()
        module64.padding_free = padding_free
        # per-sample rows: the prompts' samples regrouped would change the micro-batches counted below
        module64.update_options = UpdateOptions(max_tokens_per_micro_batch=budget, shared_prefix=False)
        groups = module64.micro_batches(exp)
        assert len(groups) == (1 if budget is None else 5)
        for group in groups:
            micro = exp.select(group)
            actor_loss, _, _ = module64.micro_batch_loss(micro)
            (actor_loss * micro_batch_weight(micro.loss_mask, exp.loss_mask, mode)).backward()
        return {n: p.grad.clone() for n, p in module64.actor.named_parameters()}

    whole = gradient(padding_free=False, budget=None)
    accumulated = gradient(padding_free=True, budget=10)  # lengths 10, 2, 4, 7, 8, 7: [10] [8, 2] [7] [7] [4]
    for name, grad in whole.items():
        assert grad.abs().max() > 0, name
        # float64, see the module's note: the micro-batches regroup the same sums as the layouts do
        assert torch.allclose(accumulated[name], grad, atol=1e-12, rtol=0), name
