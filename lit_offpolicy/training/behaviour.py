"""π_old as the policy loss sees it: a stale token's own π_rollout where no rollout correction acts."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.correction import RolloutCorrection


def loss_old_log_probs(old: Tensor, exp: Experience, version: int, correction: RolloutCorrection) -> Tensor:
    """(B, R) log π_old for the policy loss's ratio π_θ / π_old.

    Where the rollout correction reaches the loss (IS weights, rejection, veto, pure IS), ``old``: the
    correction accounts for π_old / π_rollout. Without one, a token sampled by an older weight version
    than the actor's (``version``, asynchronous rollouts) takes its own π_rollout: the recomputed
    π_old is the current policy, not the one that sampled the token, so a ratio against it is 1 and
    leaves the stale token unclipped (PPO) and untapered (TOPR's ratio is π_θ / μ with μ the behaviour
    policy, Le Roux et al. 2025, eq. 8). Tokens of the actor's own version keep ``old``
    (docs/async.md, "π_old of a stale sample").
    """
    if correction.changes_the_loss:
        return old
    stale = exp.response_versions.to(old.device) < version
    return torch.where(stale, exp.rollout_log_probs.to(old.dtype), old)
