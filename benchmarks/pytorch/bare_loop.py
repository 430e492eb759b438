"""The baseline a user would write by hand: one RL update step in plain PyTorch, no Lightning, no library.

The same math as OffPolicyModule's prepare() + update() with one PPO epoch over the whole batch
(one optimizer step), written out plainly:

- log π(token) = logit[token] − logsumexp(logits), float32;
- π_old: a no-grad forward of the actor on prompt + response (positions skip left padding);
- GRPO: score on the last response token, A = (s − mean_group) / (std_group + 1e-6) on every token;
- PPO: critic values V (no grad), GAE with γ = 1, λ = 0.95 (V = 0 past the last token), returns A + V;
- policy loss: r = exp(clamp(log π_θ − log π_old, ±20)), L = max(−A·r, −A·clip(r, 0.8, 1.2)),
  dual clip min(L, −3A) where A < 0 (Ye et al. 2020), mean over response tokens;
- PPO adds 0.5 · ½ mean((V − R)²) of the critic; global grad-norm clip at 1.0; AdamW (weight decay 0).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lit_offpolicy.core.experience import Experience

CLIP, DUAL_CLIP_C, GAMMA, LAMBDA, VALUE_COEF, MAX_GRAD_NORM = 0.2, 3.0, 1.0, 0.95, 0.5, 1.0


def _response_outputs(model: nn.Module, exp: Experience) -> Tensor:
    """The model's outputs at the positions that predict each response token."""
    input_ids = torch.cat([exp.prompt_ids, exp.response_ids], dim=1)
    attention_mask = torch.cat([exp.prompt_mask, exp.response_mask], dim=1)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    out = out.logits if hasattr(out, "logits") else out
    prompt_len = exp.prompt_ids.shape[1]
    return out[:, prompt_len - 1 : prompt_len - 1 + exp.response_ids.shape[1]]


def log_probs(actor: nn.Module, exp: Experience) -> Tensor:
    logits = _response_outputs(actor, exp).float()
    picked = torch.gather(logits, -1, exp.response_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def grpo_advantages(exp: Experience) -> Tensor:
    groups = exp.group_ids.unique(return_inverse=True)[1]
    count = torch.zeros(groups.max() + 1).index_add_(0, groups, torch.ones(len(groups)))
    mean = torch.zeros_like(count).index_add_(0, groups, exp.scores) / count
    variance = torch.zeros_like(count).index_add_(0, groups, (exp.scores - mean[groups]) ** 2) / (count - 1)
    advantage = (exp.scores - mean[groups]) / (variance.sqrt()[groups] + 1e-6)
    return advantage[:, None] * exp.response_mask


def gae(exp: Experience, values: Tensor) -> tuple[Tensor, Tensor]:
    mask = exp.response_mask.float()
    last = mask.sum(-1).long() - 1
    rewards = torch.zeros_like(mask).scatter_(1, last[:, None], exp.scores[:, None])
    values = values * mask
    advantages = torch.zeros_like(mask)
    next_value = next_advantage = torch.zeros(len(mask))
    for t in reversed(range(mask.shape[1])):
        delta = rewards[:, t] + GAMMA * next_value - values[:, t]
        next_advantage = delta + GAMMA * LAMBDA * next_advantage
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages * mask, (advantages + values) * mask


def ppo_clip_loss(new: Tensor, old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    ratio = torch.exp((new - old).clamp(-20.0, 20.0))
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
    loss = torch.where(advantages < 0, torch.minimum(loss, -DUAL_CLIP_C * advantages), loss)
    return (loss * mask).sum() / mask.sum()


def step(
    actor: nn.Module, optimizer: torch.optim.Optimizer, exp: Experience, critic: nn.Module | None = None
) -> None:
    """One RL update on ``exp``: GRPO without a critic, PPO (GAE + value loss) with one."""
    mask = exp.response_mask.float()
    with torch.no_grad():
        old = log_probs(actor, exp)
        if critic is None:
            advantages = grpo_advantages(exp)
        else:
            old_values = _response_outputs(critic, exp).float()
            advantages, returns = gae(exp, old_values)
    optimizer.zero_grad()
    loss = ppo_clip_loss(log_probs(actor, exp), old * mask, advantages, mask)
    if critic is not None:
        values = _response_outputs(critic, exp).float() * mask
        loss = loss + VALUE_COEF * 0.5 * (((values - returns) ** 2) * mask).sum() / mask.sum()
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    optimizer.step()
