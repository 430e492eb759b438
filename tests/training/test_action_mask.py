"""The action mask of multi-turn episodes, end to end: tokens an environment wrote (observations) are
conditioned on but never trained on, advantaged or corrected.

Hand values in float64 for the tensor code; the real tiny Llama (cast to float64) for the module:
gradients are exactly zero on observation tokens, and a one-turn episode (an action mask of ones)
gives exactly today's single-turn loss and gradients.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.experiences import fixed_experience

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GAE, GRPO, RLOO, Reinforce, ReinforcePlusPlus, token_level_rewards
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.generation import Generation
from lit_offpolicy.core.masked import compaction_order
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import LOSS_AGG_MODES, Vanilla
from lit_offpolicy.models import load_tokenizer
from lit_offpolicy.training.options import AdvantageShaping, KLOptions, LossOptions, UpdateOptions

NAN = float("nan")
F64 = torch.float64


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


# ----------------------------------------------------------------------------- Experience


def test_from_generations_packs_the_action_mask_and_the_policy_mask():
    generations = [
        [Generation([11, 12, 13, 14], [-0.5, 0.0, 0.0, -1.5], "stop", action_mask=[1, 0, 0, 1])],
        [Generation([15], [-0.25], "length")],  # an engine's generation: every token the policy's
    ]
    exp = Experience.from_generations(
        [[5], [6]], generations, [1.0, 0.0], 0, policy_version=0, response_width=5
    )
    assert exp.action_mask.tolist() == [[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert exp.response_mask.tolist() == [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]]
    assert exp.policy_mask.tolist() == [[1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert exp.select(torch.tensor([1])).action_mask.tolist() == [[1, 0, 0, 0, 0]]
    plain = Experience.from_generations(
        [[5]], [[Generation([7], [-1.0], "stop")]], [0.0], 0, policy_version=0
    )
    assert plain.action_mask is None and plain.policy_mask is plain.response_mask


# ----------------------------------------------------------------------------- rewards and advantages

# row 0: p o o p p   row 1: p p . . .   row 2: o o p . .   (p: policy, o: observation, .: padding)
RESPONSE = t([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], torch.long)
ACTION = t([[1, 0, 0, 1, 1], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0]], torch.long)


def test_token_level_rewards_put_the_score_on_the_last_policy_token_and_kl_on_policy_tokens():
    response = t([[1, 1, 1, 1, 0]], torch.long)
    action = t([[1, 1, 0, 0, 0]], torch.long)  # the episode ends on an observation (truncated)
    kl = t([[0.5, 0.25, 9.0, 9.0, NAN]])
    rewards = token_level_rewards(t([2.0]), response, kl=kl, kl_coef=0.1, action_mask=action)
    assert rewards.tolist() == [[-0.05, 2.0 - 0.025, 0.0, 0.0, 0.0]]


def test_gae_skips_observation_tokens_hand_computed():
    """δ_t = r_t + γ V_t' − V_t and A_t = δ_t + γλ A_t' with t' the next policy token; NaN on
    observation tokens proves they are never read."""
    rewards = t([[0.0, NAN, NAN, 0.0, 1.0], [0.0, 2.0, NAN, NAN, NAN], [NAN, NAN, 3.0, NAN, NAN]])
    values = t([[0.5, NAN, NAN, 0.2, 0.1], [1.0, 0.5, NAN, NAN, NAN], [NAN, NAN, 0.25, NAN, NAN]])
    advantages, returns = GAE(gamma=0.9, lambd=0.8)(rewards, RESPONSE, values=values, action_mask=ACTION)
    # row 0 over its policy tokens (r 0 0 1, V .5 .2 .1): A = 0.9; −0.11 + 0.72·0.9; −0.32 + 0.72·0.538
    expected = t([[0.06736, 0.0, 0.0, 0.538, 0.9], [0.53, 1.5, 0.0, 0.0, 0.0], [0.0, 0.0, 2.75, 0.0, 0.0]])
    # float64 hand values (exact decimals): a 3-step recursion on values ≤ 3, ≲ 10 eps64 × 3 ≪ 1e-12
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    expected_returns = t([[0.56736, 0, 0, 0.738, 1.0], [1.53, 2.0, 0, 0, 0], [0, 0, 3.0, 0, 0]])
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-12)


def test_reinforce_discounts_over_policy_tokens_only():
    rewards = t([[0.0, NAN, NAN, 0.0, 1.0], [0.0, 2.0, NAN, NAN, NAN], [NAN, NAN, 3.0, NAN, NAN]])
    advantages, returns = Reinforce(gamma=0.5)(rewards, RESPONSE, action_mask=ACTION)
    expected = t([[0.25, 0, 0, 0.5, 1.0], [1.0, 2.0, 0, 0, 0], [0, 0, 3.0, 0, 0]])
    assert advantages.tolist() == expected.tolist() and returns.tolist() == expected.tolist()


@pytest.mark.parametrize("estimator", [GRPO(), RLOO()], ids=["grpo", "rloo"])
def test_group_estimators_give_every_policy_token_the_episode_advantage_and_observations_zero(estimator):
    rewards = token_level_rewards(t([1.0, 0.0, 0.5]), RESPONSE, action_mask=ACTION)
    advantages, _ = estimator(rewards, RESPONSE, group_ids=[0, 0, 0], action_mask=ACTION)
    scores = torch.tensor([1.0, 0.0, 0.5], dtype=F64)
    deviation = scores - scores.mean()
    per_episode = deviation / (scores.std() + 1e-6) if isinstance(estimator, GRPO) else deviation * 3 / 2
    # float64, a 3-term mean and std in another order: ≲ 10 eps64 × |A| ≤ 2 ≪ 1e-12
    torch.testing.assert_close(advantages, per_episode[:, None] * ACTION.to(F64), rtol=0, atol=1e-12)


ESTIMATORS = [GAE(0.9, 0.8), Reinforce(0.7), GRPO(), RLOO(), ReinforcePlusPlus(0.9)]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_an_action_mask_of_ones_is_todays_path_exactly(estimator):
    generator = torch.Generator().manual_seed(0)
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], torch.long)
    rewards, values = torch.randn(2, 4, 4, generator=generator, dtype=F64)
    kwargs = {"values": values, "group_ids": [0, 0, 1, 1]}
    today = estimator(rewards, mask, **kwargs)
    episodes = estimator(rewards, mask, action_mask=mask.clone(), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(today, episodes, strict=True))


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_an_episode_equals_its_policy_tokens_moved_together(estimator):
    """The estimator on an episode with holes = on the same policy tokens as a right-padded response."""
    generator = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 3, 5, generator=generator, dtype=F64)
    kwargs = {"group_ids": [0, 0, 0]}
    holey = estimator(rewards, RESPONSE, values=values, action_mask=ACTION, **kwargs)
    order = compaction_order(RESPONSE.bool() & ACTION.bool())
    packed_mask = (RESPONSE * ACTION).gather(1, order)
    packed = estimator(rewards.gather(1, order), packed_mask, values=values.gather(1, order), **kwargs)
    for episode, compact in zip(holey, packed, strict=True):
        assert torch.equal(episode.gather(1, order), compact)
        assert (episode[(RESPONSE * (1 - ACTION)).bool()] == 0).all()


def test_holes_are_refused_in_the_response_mask_and_policy_tokens_on_padding():
    rewards = torch.zeros(1, 3, dtype=F64)
    with pytest.raises(ValueError, match="response_mask row 0 has a valid token after padding"):
        Reinforce()(rewards, t([[1, 0, 1]], torch.long), action_mask=t([[1, 0, 1]], torch.long))
    with pytest.raises(ValueError, match="action_mask row 0 marks a padding token as the policy's"):
        Reinforce()(rewards, t([[1, 1, 0]], torch.long), action_mask=t([[1, 0, 1]], torch.long))
    with pytest.raises(ValueError, match="action_mask row 0 marks a padding token"):
        token_level_rewards(t([1.0]), t([[1, 0, 0]], torch.long), action_mask=t([[0, 1, 0]], torch.long))


# ----------------------------------------------------------------------------- losses and correction

POLICY = t([[1, 0, 1, 0], [0, 1, 1, 1]], torch.long)  # holes: observation tokens between turns
LOSSES = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
HAND = {  # the policy tokens hold 1, 3 | 6, 7, 8: 5 tokens, 2 sequences, width 4
    "token-mean": 25 / 5,
    "seq-mean-token-sum": (4 + 21) / 2,
    "seq-mean-token-mean": (4 / 2 + 21 / 3) / 2,
    "seq-mean-token-sum-norm": 25 / 4,
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_aggregation_mode_counts_policy_tokens_only_and_their_gradient_alone(mode):
    """Vanilla's L_t = −A_t log π_t at log π = −1 is A_t: each mode's hand value over the policy tokens;
    observation tokens hold NaN advantages and get exactly zero gradient."""
    log_probs = torch.full((2, 4), -1.0, dtype=F64, requires_grad=True)
    advantages = torch.where(POLICY.bool(), LOSSES, NAN)
    out = Vanilla(loss_agg_mode=mode)(
        log_probs=log_probs, old_log_probs=log_probs.detach(), advantages=advantages, response_mask=POLICY
    )
    assert out.loss.item() == pytest.approx(HAND[mode], abs=1e-12)  # float64, ≤ 7-term sums: ≲ 7 eps64 × 25
    out.loss.backward()
    assert (log_probs.grad[~POLICY.bool()] == 0).all()
    assert (log_probs.grad[POLICY.bool()] != 0).all()


def test_rollout_correction_ratios_run_over_policy_tokens_only():
    """Per-token log ratios 0.1, −0.3, 0.5 on the policy tokens and −10 on an observation token, which
    would veto the row (ρ < 1e-4), reject it by its geometric mean and zero its sequence weight if it
    were counted: sequence ratio exp(0.3), geometric exp(0.1)."""
    response = t([[1, 1, 1, 1, 0]], torch.long)
    policy = t([[1, 0, 1, 1, 0]], torch.long)
    old = t([[-1.0, -10.0, -1.3, -0.5, NAN]])
    rollout = t([[-1.1, 0.0, -1.0, -1.0, NAN]])
    seq = RolloutCorrection.seq_is_rs(is_threshold=2.0, rs_threshold=2.0)
    out = seq.compute(old_log_probs=old, rollout_log_probs=rollout, response_mask=policy)
    weight = math.exp(0.3)
    # float64, exp of a 3-term sum of differences: ≲ 10 eps64 × 1.35 ≪ 1e-12
    torch.testing.assert_close(out.is_weights, t([[weight, 0, weight, weight, 0]]), rtol=0, atol=1e-12)
    assert out.response_mask.tolist() == policy.tolist()
    geometric = RolloutCorrection.geo_rs(rs_threshold=1.2, veto_threshold=1e-4)
    kept = geometric.compute(old_log_probs=old, rollout_log_probs=rollout, response_mask=policy)
    assert kept.response_mask.tolist() == policy.tolist()
    assert kept.metrics["rollout_corr/rollout_is_veto_fraction"] == 0.0
    counted = geometric.compute(old_log_probs=old, rollout_log_probs=rollout, response_mask=response)
    assert counted.response_mask.sum() == 0, "the check above would be vacuous"


# ----------------------------------------------------------------------------- the module, end to end


def _module(model_dir: str, **options) -> OffPolicyModule:
    torch.manual_seed(0)  # a critic's new value head
    return OffPolicyModule(model_path=model_dir, logprob_chunk_size=None, **options).double()


def _episodes(model_dir: str) -> Experience:
    """4 hand-built episodes of one prompt: turn, observation, turn (or one turn), varied scores."""
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer("3+4*5=").input_ids
    eos = tokenizer.eos_token_id
    turn = tokenizer("<c>3+4*5", add_special_tokens=False).input_ids + [eos]
    observation = tokenizer("=23\n", add_special_tokens=False).input_ids
    answer = tokenizer("23", add_special_tokens=False).input_ids + [eos]
    episodes = []
    for k in range(4):
        tokens = turn + observation + answer if k < 3 else answer
        action = [1] * len(turn) + [0] * len(observation) + [1] * len(answer) if k < 3 else [1] * len(answer)
        log_probs = [-1.0 - 0.1 * k if a else 0.0 for a in action]
        episodes.append(Generation(tokens, log_probs, "stop", action_mask=action))
    return Experience.from_generations([prompt], [episodes], [1.0, 0.0, 0.5, 0.25], tokenizer.pad_token_id, 0)


def test_gradients_are_exactly_zero_on_observation_tokens(tiny_model_dir):
    """PPO + GRPO with a KL loss and an entropy bonus: the gradient of the actor's loss with respect
    to the logits that predict observation tokens is exactly 0, and non-zero at every policy token."""
    module = _module(
        tiny_model_dir,
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        loss=LossOptions(entropy_coef=0.01),
        update=UpdateOptions(shared_prefix=False),  # the padded layout: the head's output is (B, R + 1, V)
    )
    exp = _episodes(tiny_model_dir)
    module.prepare(exp, OldLogProbs.RECOMPUTE)
    observations = (exp.response_mask * (1 - exp.action_mask)).bool()
    assert observations.any()
    assert (exp.advantages[observations] == 0).all() and (exp.loss_mask[observations] == 0).all()
    kept = []
    head = module.actor.get_output_embeddings()

    def keep(module, inputs, output) -> None:
        output.retain_grad()
        kept.append(output)

    hook = head.register_forward_hook(keep)
    loss, _, metrics = module.micro_batch_loss(exp)
    hook.remove()
    loss.backward()
    grad = kept[0].grad[:, :-1]  # position i predicts response token i; the last predicts past it
    assert (grad[observations] == 0).all()
    assert (grad[exp.policy_mask.bool()].abs().sum(dim=-1) > 0).all()
    # token-mean PPO at π_θ = π_old (ratio 1): −Σ A over the policy tokens / their number; float64
    # sums of ≤ 30 terms ≤ 2 in another order: ≲ 30 eps64 relative ≪ approx's default rel=1e-6
    policy = exp.policy_mask.bool()
    assert metrics["actor/pg_loss"] == pytest.approx(
        -exp.advantages[policy].sum().item() / policy.sum().item()
    )


@pytest.mark.parametrize(
    "options",
    [
        {"critic_path": None, "advantage": GAE(), "loss": LossOptions(entropy_coef=0.01)},
        {
            "advantage": "grpo",
            "kl": KLOptions(use_in_reward=True, use_loss=True),
            "rollout_correction": "seq_is_rs",
            "advantage_shaping": AdvantageShaping(whiten=True, clip=0.5),
        },
    ],
    ids=["gae-critic-entropy", "grpo-kl-correction-whiten"],
)
def test_a_one_turn_episode_gives_todays_loss_and_gradients_exactly(tiny_model_dir, options):
    if "critic_path" in options:
        options = {**options, "critic_path": tiny_model_dir}
    results = []
    for action in (False, True):
        module = _module(tiny_model_dir, **options)
        exp = fixed_experience(tiny_model_dir)
        if action:  # an episode of one turn: every response token is the policy's
            exp = dataclasses.replace(exp, action_mask=exp.response_mask.clone())
        metrics = module.prepare(exp, OldLogProbs.RECOMPUTE)
        actor_loss, critic_loss, _ = module.micro_batch_loss(exp)
        loss = actor_loss + (0.5 * critic_loss if critic_loss is not None else 0.0)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
        results.append((metrics, exp.advantages, exp.loss_mask, loss.detach(), grads))
    (today, *today_tensors), (episode, *episode_tensors) = results
    assert today == episode
    assert all(torch.equal(a, b) for a, b in zip(today_tensors, episode_tensors, strict=True))
