"""configs/dr_grpo.yaml, configs/dapo.yaml and configs/gspo.yaml are what their papers say: the parts
the configs build (as the CLI builds them, from class_path and init_args) are checked on hand values.
"""

import pytest
import torch
import yaml
from helpers import CONFIGS

from lit_offpolicy.advantages import ADVANTAGES, GRPO
from lit_offpolicy.losses import GSPO, POLICY_LOSSES, PPO
from lit_offpolicy.training.options import KLOptions, RewardShaping, UpdateOptions


def init_args(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"]["init_args"]


def rollout_args(name: str) -> dict:
    trainer = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["trainer"]
    if isinstance(trainer, str):  # base/trainer.yaml
        trainer = yaml.safe_load((CONFIGS / trainer).read_text())
    (rollout,) = [c for c in trainer["callbacks"] if c["class_path"] == "lit_offpolicy.callbacks.Rollout"]
    return rollout["init_args"]


def test_dr_grpo_advantages_are_reward_minus_group_mean():
    """Two groups of 4: scores 1, 0, 0, 0 (mean 0.25) → 0.75, −0.25, −0.25, −0.25, and 1, 1, 0, 1 (mean
    0.75) → 0.25, 0.25, −0.75, 0.25. GRPO's std division (unbiased std 0.5 in both) would double them."""
    advantage = ADVANTAGES.resolve(init_args("dr_grpo")["advantage"])
    assert isinstance(advantage, GRPO) and advantage.norm_by_std is False
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0]] * 8)
    rewards = torch.zeros(8, 3)
    rewards[:, 1] = scores  # the score on the last valid token
    advantages, _ = advantage(rewards, mask, group_ids=torch.tensor([0] * 4 + [1] * 4))
    want = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25])
    # float32 default (rtol 1.3e-6, atol 1e-5): dyadic scores, a 4-term mean: exact or an ulp (1.2e-7) off
    torch.testing.assert_close(advantages[:, 0], want)
    torch.testing.assert_close(advantages * mask, want[:, None] * mask)


def test_dr_grpo_loss_divides_by_the_constant_max_tokens_not_each_length():
    """Responses of 1 and 3 tokens, padded to the config's max_tokens T = 5, on-policy (ratio 1, no clip):
    PPO's token loss is −A. With A = 0.75 and 0.25, Dr. GRPO: Σ_i Σ_t −A_i / T = (−0.75·1 − 0.25·3)/5
    = −1.5/5 = −0.3, and every token's gradient is −A_i/T: −0.75/5 = −0.15 and −0.25/5 = −0.05, whatever
    the response's length. GRPO's per-response mean would give −0.75/(2·1) and −0.25/(2·3) instead."""
    loss_fn = POLICY_LOSSES.resolve(init_args("dr_grpo")["policy_loss"])
    assert isinstance(loss_fn, PPO) and loss_fn.loss_agg_mode == "seq-mean-token-sum-norm"
    max_tokens = rollout_args("dr_grpo")["sampling"]["max_tokens"]
    assert max_tokens == 5
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    log_probs = torch.full((2, max_tokens), -1.0, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[0.75] * 5, [0.25] * 5], dtype=torch.float64)
    out = loss_fn(
        log_probs=log_probs, old_log_probs=log_probs.detach(), advantages=advantages, response_mask=mask
    )
    out.loss.backward()
    # float64, sums of 4 dyadic terms and a division by 5: one rounding, 0.3 × eps64 ≪ 1e-12
    assert out.loss.item() == pytest.approx((-0.75 * 1 - 0.25 * 3) / 5, abs=1e-12)  # −0.3
    want = torch.tensor([[-0.15, 0, 0, 0, 0], [-0.05, -0.05, -0.05, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(log_probs.grad, want, atol=1e-12, rtol=0)


def test_dapo_config_is_the_papers_recipe():
    """Clip-higher ε_low 0.2, ε_high 0.28 (§3.1), token-mean (§3.3), no KL (§2.3), the soft overlong
    punishment (§3.4) over the last 3 of max_tokens 8 (L_max − L_cache = 5 ≥ the task's longest
    right answer, 3 digits + eos), dynamic sampling (§3.2), GRPO advantages."""
    args = init_args("dapo")
    loss_fn = POLICY_LOSSES.resolve(args["policy_loss"])
    assert isinstance(loss_fn, PPO)
    assert (loss_fn.pg_clip_low, loss_fn.pg_clip_high, loss_fn.dual_clip_loss) == (0.2, 0.28, False)
    assert loss_fn.loss_agg_mode == "token-mean"
    assert not KLOptions(**args["kl"]).needs_reference
    shaping = RewardShaping(**args["reward_shaping"])
    assert (shaping.overlong_buffer_length, shaping.overlong_penalty_factor) == (3, 1.0)
    assert rollout_args("dapo")["sampling"]["max_tokens"] - shaping.overlong_buffer_length == 5
    advantage = ADVANTAGES.resolve(args["advantage"])
    assert isinstance(advantage, GRPO) and advantage.norm_by_std
    rollout = rollout_args("dapo")
    assert rollout["filter_groups"] is True and rollout["max_sampling_rounds"] > 1
    # several optimizer steps per RL step, or π_θ = π_old at the only update and the clip never acts
    prompts = yaml.safe_load((CONFIGS / "base" / "data.yaml").read_text())["batch_size"]
    assert UpdateOptions(**args["update"]).mini_batch_size * 4 == prompts * rollout["sampling"]["n"]


def test_gspo_config_is_the_papers_recipe():
    """Clip range 3e-4 / 4e-4 (§5.1), seq-mean-token-mean, GRPO advantages, several mini-batches a step."""
    args = init_args("gspo")
    loss_fn = POLICY_LOSSES.resolve(args["policy_loss"])
    assert isinstance(loss_fn, GSPO)
    assert (loss_fn.pg_clip_low, loss_fn.pg_clip_high) == (3e-4, 4e-4)
    assert loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert isinstance(ADVANTAGES.resolve(args["advantage"]), GRPO)
    assert args["update"]["mini_batch_size"] < 128 * rollout_args("gspo")["sampling"]["n"]
