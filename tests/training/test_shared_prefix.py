"""Shared-prefix rows (training/shared_prefix.py, packed_attention.shared_prefix_sdpa) against the
per-sample passes, and the micro-batches that keep a prompt's samples together (training/micro_batches.py).

Real parts: tiny Llama, Qwen2, Qwen3 and Mistral in float64; batches of 3 prompts (left-padded, of 6, 2
and 1 tokens) with 4, 1 (a group of one) and 2 samples, not adjacent, responses of 0, 1 and up to 6 tokens.

Tolerances. transformers' RMSNorm rounds its input to float32 even in a float64 model. A shared row sums
the gradients that a prompt position receives from its responses before that rounding, the per-sample
rows after it: the gradients then differ by eps32 relative (≈ 1e-6 here), whatever the layout's
correctness. ``exact_norms`` makes each RMSNorm compute in its input's dtype, and both layouts are then
float64 throughout: they group the same sums differently, as the packed and the padded layouts do
(tests/training/test_packing.py): 1e-12 for log-probs, entropies and values, 1e-11 for gradients. A
response that saw another response, or a prompt position counted once instead of n times, is off by
more than 1e-3. The float32 fit at the end compares the whole step within a derived float32 bound.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.experiences import experience, with_update_inputs

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.losses import PPO, micro_batch_weight
from lit_offpolicy.models import create_tiny_model, load_actor, load_critic
from lit_offpolicy.models.lora import LoraOptions, add_lora
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.training.forward import critic_values, policy_log_probs
from lit_offpolicy.training.micro_batches import by_prompt, by_token_budget
from lit_offpolicy.training.options import KLOptions, LossOptions, UpdateOptions
from lit_offpolicy.training.packed_attention import shared_prefix_sdpa
from lit_offpolicy.training.shared_prefix import (
    check_option,
    pack_shared,
    prompt_groups,
    shared_prompts,
    shared_row,
)
from lit_offpolicy.training.update import micro_batch_groups

VALUES, GRADIENTS = 1e-12, 1e-11  # float64, see the module's note


def exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Every RMSNorm of ``model`` computed in its input's dtype (transformers' rounds to float32)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):

            def forward(x, norm=module):
                return norm.weight * (
                    x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                )

            module.forward = forward
    return model


def groups_experience(seed: int = 0) -> Experience:
    """Samples 0..6: prompt A (6 tokens) for 0, 2, 3, 6; B (2 tokens) for 1; C (1 token) for 4, 5;
    responses of 4, 3, 0, 1, 1, 5, 6 tokens, right-padded to 7."""
    a, b, c = [5, 6, 7, 8, 9, 10], [11, 12], [16]
    prompts = [a, b, a, a, c, c, a]
    generator = torch.Generator().manual_seed(seed)
    generations = [
        [Generation(torch.randint(3, 90, (length,), generator=generator).tolist(), [-1.0] * length, "stop")]
        for length in (4, 3, 0, 1, 1, 5, 6)
    ]
    return Experience.from_generations(
        prompts, generations, [0.0] * 7, pad_token_id=0, policy_version=0, response_width=7
    )


def test_a_shared_row_lays_each_prompt_once_then_its_responses_by_hand():
    exp = Experience.from_generations(
        [[5, 6, 7], [8], [5, 6, 7]],
        [
            [Generation([20, 21], [0.0] * 2, "stop")],
            [Generation([22], [0.0], "stop")],
            [Generation([23], [0.0], "stop")],
        ],
        [0.0] * 3,
        pad_token_id=0,
        policy_version=0,
        response_width=3,
    )
    assert prompt_groups(exp) == [[0, 2], [1]]
    row = pack_shared(exp)
    assert row.input_ids.tolist() == [[5, 6, 7, 20, 21, 23, 8, 22]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    # 7 predicts 20 and 23 (both responses' first tokens), 20 predicts 21, 8 predicts 22
    assert row.predicting.tolist() == [2, 3, 2, 6]
    assert row.targets.tolist() == [[20, 21, 23, 22]]
    assert row.lengths == (3, 2, 1, 1, 1) and row.fan_out == (2, 1)
    unpacked = row.unpack(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert unpacked.tolist() == [[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [3.0, 0.0, 0.0]]


def _passes(model, exp, chunk_size, shared_prefix):
    """log-probs and entropy at T = 0.7 and the gradient of a loss weighting both."""
    model.zero_grad()
    log_probs, entropy = policy_log_probs(model, exp, 0.7, True, chunk_size, shared_prefix=shared_prefix)
    weights = torch.linspace(-1.0, 2.0, log_probs.numel(), dtype=log_probs.dtype).reshape(log_probs.shape)
    ((weights * log_probs + 0.3 * entropy) * exp.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), entropy.detach(), grads


def _assert_same_passes(shared, per_sample, mask) -> None:
    assert torch.allclose(shared[0][mask], per_sample[0][mask], atol=VALUES, rtol=0)
    assert torch.allclose(shared[1][mask], per_sample[1][mask], atol=VALUES, rtol=0)
    assert not shared[0][~mask].any() and not shared[1][~mask].any()  # 0 at padding
    assert shared[2].keys() == per_sample[2].keys() and len(per_sample[2]) > 10
    for name, grad in per_sample[2].items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(shared[2][name], grad, atol=GRADIENTS, rtol=0), name


@pytest.mark.parametrize(("chunk_size", "checkpointing"), [(None, False), (3, False), (3, True)])
def test_log_probs_entropy_and_every_gradient_equal_the_per_sample_passes(
    model_dir, chunk_size, checkpointing
):
    """The chunked head reads the prompt's last position once per response; gradient checkpointing
    recomputes each block of the shared row in the backward (``core.row_attention``)."""
    model = load_actor(
        model_dir, torch.float64, gradient_checkpointing=checkpointing, attn_implementation="sdpa"
    )
    exact_norms(model)
    exp = groups_experience()
    assert shared_row(model, exp) is not None
    per_sample = _passes(model, exp, chunk_size, shared_prefix=False)
    shared = _passes(model, exp, chunk_size, shared_prefix=True)
    _assert_same_passes(shared, per_sample, exp.response_mask.bool())


def test_values_and_the_critics_gradients_equal_the_per_sample_passes(model_dir):
    torch.manual_seed(0)  # the value head
    critic = exact_norms(load_critic(model_dir, torch.float64, attn_implementation="sdpa"))
    exp = groups_experience(seed=1)
    mask = exp.response_mask.bool()
    results = []
    for shared_prefix in (False, True):
        critic.zero_grad()
        values = critic_values(critic, exp, shared_prefix=shared_prefix)
        (values * mask).pow(2).sum().backward()
        results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
    (per_sample, per_sample_grads), (shared, shared_grads) = results
    assert torch.allclose(shared[mask], per_sample[mask], atol=VALUES, rtol=0)
    for name, grad in per_sample_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=GRADIENTS, rtol=0), name


def test_lora_adapters_gradients_equal_the_per_sample_passes(tiny_model_dir):
    torch.manual_seed(0)  # peft draws A
    model = add_lora(load_actor(tiny_model_dir, torch.float64, attn_implementation="sdpa"), LoraOptions(r=2))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # B = 0 would make the adapters a no-op
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    exact_norms(model)
    exp = groups_experience(seed=2)
    per_sample = _passes(model, exp, 3, shared_prefix=False)
    shared = _passes(model, exp, 3, shared_prefix=True)
    assert all("lora_" in name for name in per_sample[2])
    _assert_same_passes(shared, per_sample, exp.response_mask.bool())


def test_a_model_that_cannot_run_it_takes_the_per_sample_rows_and_true_refuses_it(tiny_model_dir, caplog):
    """Eager attention reads the row's sample boundaries off restarting positions, which a shared row
    does not have: no shared row for it, the passes run per sample (null says so at start-up, in one
    line naming the model), and ``shared_prefix: true`` stops at start-up in one line."""
    model = load_actor(tiny_model_dir, attn_implementation="eager")
    exp = groups_experience()
    assert shared_row(model, exp) is None
    shared = policy_log_probs(model, exp, 1.0, shared_prefix=True)[0]
    assert torch.equal(shared, policy_log_probs(model, exp, 1.0)[0])  # the same padded pass
    sdpa = load_actor(tiny_model_dir, attn_implementation="sdpa")
    with caplog.at_level(logging.INFO):
        check_option(UpdateOptions(), sdpa, None, model, None)
        check_option(UpdateOptions(shared_prefix=False), sdpa, None, model, None)
    said = [record.getMessage() for record in caplog.records if "shared_prefix" in record.getMessage()]
    assert said == [
        "lit-offpolicy: update.shared_prefix: the reference has 'eager' attention on 'llama': its passes run "
        "per sample"
    ]
    with pytest.raises(ValueError) as error:
        check_option(UpdateOptions(shared_prefix=True), sdpa, None, model, None)
    assert str(error.value) == (
        "update.shared_prefix=true needs 'sdpa' attention on a llama, mistral, qwen2 or qwen3 model; the "
        "reference has 'eager' attention on 'llama'; allowed values: update.shared_prefix null (the default, "
        "left out: wherever a model runs it) or false, or attn_implementation 'sdpa' on one of those families"
    )


def test_a_sliding_window_shorter_than_a_sample_runs_per_sample(tmp_path):
    model = load_actor(create_tiny_model(tmp_path / "m", seed=0, arch="mistral"), attn_implementation="sdpa")
    exp = groups_experience()  # its longest sample: 6 + 6 tokens
    model.config.sliding_window = 12
    assert shared_row(model, exp) is not None
    model.config.sliding_window = 11
    assert shared_row(model, exp) is None


def test_the_attention_runs_only_inside_a_shared_row():
    states = torch.zeros(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="only inside attention_within_samples"):
        shared_prefix_sdpa(None, states, states, states, None)


def test_micro_batches_keep_a_prompts_samples_together():
    exp = groups_experience()  # prompts A B A A C C A
    options = UpdateOptions(micro_batch_size=3)
    assert [g.tolist() for g in micro_batch_groups(exp, options, torch.device("cpu"))] == [
        [0, 2, 3],
        [1, 4, 6],  # A's last, B, C's first: cut every 3 samples, prompt by prompt
        [5],
    ]
    off = UpdateOptions(micro_batch_size=3, shared_prefix=False)
    assert [g.tolist() for g in micro_batch_groups(exp, off, torch.device("cpu"))] == [
        [0, 1, 2],
        [3, 4, 5],
        [6],
    ]
    assert [g.tolist() for g in by_prompt([[0, 2], [1]], None)] == [[0, 1, 2]]  # one micro-batch: as it is


def test_the_prompts_computed_once_are_listed_for_the_flops(tiny_model_dir):
    """A prompt's P once per sample beyond the first of each micro-batch holding it (``core.flops``)."""
    exp = groups_experience()  # A (6 tokens): 0, 2, 3, 6; B: 1; C (1 token): 4, 5
    model = load_actor(tiny_model_dir, attn_implementation="sdpa")
    whole = [torch.arange(7)]
    assert shared_prompts(model, exp, whole) == [6, 6, 6, 1]
    assert shared_prompts(model, exp, [torch.tensor(g) for g in ([0, 2, 3], [1, 4, 6], [5])]) == [6, 6]
    assert shared_prompts(load_actor(tiny_model_dir, attn_implementation="eager"), exp, whole) == []


def test_the_token_budget_counts_each_prompt_once_and_cuts_a_prompt_that_does_not_fit():
    """Prompt A (6 tokens): responses 4, 0, 1, 6 -> 6 + 11 = 17 tokens in one row, 29 per sample; B: 2 + 3;
    C: 1 + 1 + 5. A budget of 13 cuts A, in sample order, into [0, 2, 3] (6 + 5) and [6] (6 + 6)."""
    exp = groups_experience()
    lengths = exp.prompt_mask.sum(1) + exp.response_mask.sum(1)
    prompts, prompt_lengths = prompt_groups(exp), exp.prompt_mask.sum(1)
    assert prompts == [[0, 2, 3, 6], [1], [4, 5]]
    assert [g.tolist() for g in by_token_budget(lengths, 17, prompts, prompt_lengths)] == [
        [0, 2, 3, 6],
        [1, 4, 5],
    ]
    assert [g.tolist() for g in by_token_budget(lengths, 13, prompts, prompt_lengths)] == [
        [6],
        [0, 2, 3],
        [1, 4, 5],
    ]
    with pytest.raises(
        ValueError, match="update.max_tokens_per_micro_batch=11 is smaller than a sample of 12"
    ):
        by_token_budget(lengths, 11, prompts, prompt_lengths)


def test_the_option_refuses_sequence_parallelism_and_says_where_it_is_on():
    assert UpdateOptions().shares_prefixes and UpdateOptions(shared_prefix=True).shares_prefixes
    assert not UpdateOptions(shared_prefix=False).shares_prefixes
    assert not UpdateOptions(sequence_parallel=2).shares_prefixes  # None: off under sequence parallelism
    with pytest.raises(ValueError) as error:
        UpdateOptions(shared_prefix=True, sequence_parallel=2)
    assert str(error.value) == (
        "update.shared_prefix=true does not run with update.sequence_parallel=2 (a shared-prefix row is "
        "not split across ranks); allowed values: update.shared_prefix null (the default, left "
        "out: off under sequence parallelism) or false"
    )
    with pytest.raises(ValueError, match="update.shared_prefix"):
        UpdateOptions(shared_prefix="yes")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_shared_micro_batches_accumulate_the_per_sample_mini_batch_gradient(tiny_model_dir, mode):
    """Σ_micro w·∇loss(micro) over micro-batches of 3 samples in shared rows (a prompt's samples together)
    = ∇loss(mini-batch) in per-sample rows: policy loss, KL loss and entropy bonus, float64."""
    module = OffPolicyModule(
        model_path=tiny_model_dir,
        policy_loss=PPO(loss_agg_mode=mode),
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        loss=LossOptions(entropy_coef=0.01),
        attn_implementation="sdpa",
    ).double()
    exact_norms(module.actor)
    exp = with_update_inputs(groups_experience(seed=3))

    def gradient(update: UpdateOptions) -> dict[str, torch.Tensor]:
        module.zero_grad()
        module.update_options = update
        for group in module.micro_batches(exp):
            micro = exp.select(group)
            actor_loss, _, _ = module.micro_batch_loss(micro)
            (actor_loss * micro_batch_weight(micro.loss_mask, exp.loss_mask, mode)).backward()
        return {n: p.grad.clone() for n, p in module.actor.named_parameters()}

    whole = gradient(UpdateOptions(shared_prefix=False))
    accumulated = gradient(UpdateOptions(micro_batch_size=3))
    for name, grad in whole.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(accumulated[name], grad, atol=GRADIENTS, rtol=0), name


def test_an_experience_without_shared_prompts_packs_as_per_sample_rows():
    exp = experience((4, 0, 1, 6), width=7)  # 4 different prompts
    row = pack_shared(exp)
    assert row.fan_out == (1, 1, 1, 1)
    assert row.lengths == (6, 4, 2, 0, 3, 1, 1, 6)
