"""Reward and advantage shaping around the estimators.

Normalizing and clipping per-sample scores, placing them on tokens (with an optional KL penalty),
whitening and clipping advantages.

Per-sample scores are (batch,) tensors; token tensors are (batch, response_len) with a right-padded
0/1 ``response_mask``. Padding may hold anything (NaN included) and never reaches a result. An
optional ``action_mask`` (multi-turn episodes) marks the response tokens the policy sampled; it may
have holes (an environment's observations between turns), the response mask may not.
Floating inputs keep their dtype (bfloat16/float16 are computed in float32, float64 stays float64);
integer or bool scores come back as float32.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_range, check_same_shape
from lit_offpolicy.core.masked import masked_whiten, zero_padding

GroupIds = Tensor | Sequence[Hashable]

REWARD_NORMS = (None, "batch", "group", "running")
REWARD_NORM_EPS = 1e-6


def working_dtype(values: Tensor) -> torch.dtype:
    """float64 for float64 input, float32 for everything else."""
    return torch.float64 if values.dtype == torch.float64 else torch.float32


def result_dtype(values: Tensor) -> torch.dtype:
    """The input's dtype when it is floating point, else float32."""
    return values.dtype if values.is_floating_point() else torch.float32


def check_right_padded(mask: Tensor) -> None:
    """Raise unless the valid tokens of every row of the (batch, len) bool ``mask`` form a prefix."""
    if mask.dim() != 2:
        raise ValueError(f"response_mask has shape {list(mask.shape)}; allowed values: (batch, response_len)")
    holes = mask[:, 1:] & ~mask[:, :-1]
    if holes.any():
        row = int(holes.any(dim=1).nonzero()[0])
        raise ValueError(
            f"response_mask row {row} has a valid token after padding; "
            "allowed values: right-padded masks (the valid tokens are a prefix of each row)"
        )


def check_action_mask(action_mask: Tensor, response_mask: Tensor) -> Tensor:
    """The bool policy mask ``response_mask`` ∧ ``action_mask``; raise unless ``action_mask`` has the
    response mask's shape and is 0 on its padding (a policy token after the response would be a bug)."""
    check_same_shape(action_mask=action_mask, response_mask=response_mask)
    action = action_mask.to(response_mask.device).bool()
    outside = action & ~response_mask.bool()
    if outside.any():
        row = int(outside.any(dim=1).nonzero()[0])
        raise ValueError(
            f"action_mask row {row} marks a padding token as the policy's; "
            "allowed values: 1 only on valid response tokens (action_mask ≤ response_mask)"
        )
    return action


def group_index(group_ids: GroupIds, batch_size: int, device: torch.device | None = None) -> Tensor:
    """Dense group number 0..G-1 of each sample, from a 1-D tensor or a sequence of hashable ids."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != batch_size:
            raise ValueError(
                f"group_ids has shape {list(group_ids.shape)}; "
                f"allowed values: one id per sample, ({batch_size},)"
            )
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(
            f"group_ids has {len(ids)} entries; allowed values: one id per sample ({batch_size})"
        )
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in ids], dtype=torch.long, device=device)


def group_deviation(
    scores: Tensor, index: Tensor, counted: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample: (score − mean of its group, unbiased std of its group, size of its group).

    Only samples where ``counted`` is True (default: all) enter the statistics. A group with fewer than
    two counted samples has mean 0 and std 1 (verl's GRPO convention), so its deviation is the score.
    Scores are shifted by their group's largest score before averaging, so a group of equal scores
    gives deviations of exactly 0 and std 0, whatever their value.
    """
    if counted is None:
        counted = torch.ones_like(scores, dtype=torch.bool)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    zeros = scores.new_zeros(num_groups)
    count = zeros.index_add(0, index, counted.to(scores.dtype))
    largest = torch.full_like(zeros, -math.inf).scatter_reduce(
        0, index, torch.where(counted, scores, -math.inf), reduce="amax"
    )
    shifted = scores - torch.where(count > 0, largest, 0.0)[index]
    shifted_mean = zeros.index_add(0, index, torch.where(counted, shifted, 0.0)) / count.clamp(min=1)
    deviation = shifted - shifted_mean[index]
    squares = zeros.index_add(0, index, torch.where(counted, deviation, 0.0) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()[index]
    alone = count[index] < 2
    return torch.where(alone, scores, deviation), torch.where(alone, 1.0, std), count[index]


class RunningMoments:
    """Running mean and std of a scalar stream, merged batch by batch (Chan et al.'s parallel variance
    update, as ROLL's ``RunningMoments``): with n = count, m = mean and M2 = Σ(x − m)² so far,
    merging a batch (n_b, m_b, M2_b) gives n' = n + n_b, m' = m + δ n_b / n', M2' = M2 + M2_b + δ² n n_b / n'
    with δ = m_b − m. ``std`` is the unbiased √(M2 / (n − 1)); it is 1 until two values were seen
    (ROLL starts at 1 too). Statistics are kept as float64 python numbers.
    """

    def __init__(self) -> None:
        self.count = 0
        self._mean = 0.0
        self._sum_squares = 0.0

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def std(self) -> float:
        return math.sqrt(self._sum_squares / (self.count - 1)) if self.count >= 2 else 1.0

    def update(self, values: Tensor) -> tuple[float, float]:
        """Merge ``values`` (any shape) into the stream; return the batch's mean and unbiased std
        (std 0 for a single value)."""
        values = values.detach().reshape(-1).to(torch.float64)
        if values.numel() == 0 or not torch.isfinite(values).all():
            raise ValueError(
                f"RunningMoments.update got {values.numel()} values, some not finite; "
                "allowed values: a non-empty tensor of finite numbers"
            )
        batch_count = values.numel()
        batch_mean = values.mean().item()
        batch_sum_squares = ((values - batch_mean) ** 2).sum().item()
        total = self.count + batch_count
        delta = batch_mean - self._mean
        self._mean += delta * batch_count / total
        self._sum_squares += batch_sum_squares + delta**2 * self.count * batch_count / total
        self.count = total
        batch_std = math.sqrt(batch_sum_squares / (batch_count - 1)) if batch_count >= 2 else 0.0
        return batch_mean, batch_std

    def state_dict(self) -> dict[str, float | int]:
        return {"count": self.count, "mean": self._mean, "sum_squares": self._sum_squares}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        if set(state) != {"count", "mean", "sum_squares"}:
            raise ValueError(
                f"RunningMoments state has keys {sorted(state)}; "
                "allowed values: ['count', 'mean', 'sum_squares']"
            )
        self.count = int(state["count"])
        self._mean = float(state["mean"])
        self._sum_squares = float(state["sum_squares"])


def normalize_rewards(
    scores: Tensor,
    reward_norm: str | None = None,
    group_ids: GroupIds | None = None,
    running: RunningMoments | None = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
) -> Tensor:
    """Normalize per-sample scores (batch,) with ROLL's ``reward_norm`` / ``reward_shift`` / ``reward_scale``.

    ``reward_norm`` says where mean and std come from: None (off: scores are returned as given),
    "batch" (the whole batch), "group" (the samples sharing a ``group_ids`` entry), "running" (``running``,
    first updated with this batch). Then ``reward_shift``: x − mean; ``reward_scale``: x / (std + 1e-6);
    neither: (x − mean) / (std + 1e-6). Stds are unbiased; a batch or group of one sample has mean 0 and
    std 1 (as GRPO), so it keeps its score.

    Differences from ROLL: ROLL honours ``reward_scale`` only for "running" (here every source does),
    its "running" eps is float32's machine epsilon (here 1e-6 everywhere, as ROLL's later
    ``norm_mean_type``/``norm_std_type`` version), groups come from ``group_ids`` instead of consecutive
    blocks of ``num_return_sequences``, and contradictory or ineffective settings raise.
    """
    check_choice("reward_norm", reward_norm, REWARD_NORMS)
    check_choice("reward_shift", reward_shift, (False, True))
    check_choice("reward_scale", reward_scale, (False, True))
    if reward_shift and reward_scale:
        raise ValueError(
            "reward_shift=True with reward_scale=True is contradictory; allowed values: at most one of them "
            "(neither means shift and scale)"
        )
    if reward_norm is None:
        if reward_shift or reward_scale:
            raise ValueError(
                f"reward_shift={reward_shift}, reward_scale={reward_scale} have no effect with "
                "reward_norm=None; allowed values for reward_norm: 'batch', 'group', 'running'"
            )
        return scores
    if scores.dim() != 1:
        raise ValueError(
            f"scores has shape {list(scores.shape)}; allowed values: one score per sample, (batch,)"
        )
    x = scores.to(working_dtype(scores))
    if reward_norm == "running":
        if running is None:
            raise ValueError("reward_norm='running' needs running=RunningMoments(); got running=None")
        running.update(x)
        deviation, std = x - running.mean, running.std
    else:
        if reward_norm == "group" and group_ids is None:
            raise ValueError("reward_norm='group' needs group_ids (one id per sample); got group_ids=None")
        if reward_norm == "group":
            index = group_index(group_ids, len(x), x.device)
        else:
            index = torch.zeros(len(x), dtype=torch.long, device=x.device)
        deviation, std, _ = group_deviation(x, index)
    if reward_shift:
        normalized = deviation
    elif reward_scale:
        normalized = x / (std + REWARD_NORM_EPS)
    else:
        normalized = deviation / (std + REWARD_NORM_EPS)
    return normalized.to(result_dtype(scores))


def clip_rewards(scores: Tensor, reward_clip: float | None) -> Tensor:
    """Scores clamped to [−reward_clip, reward_clip] (ROLL's ``reward_clip``); None leaves them as given."""
    if reward_clip is None:
        return scores
    check_range("reward_clip", reward_clip, low=0.0, low_inclusive=False)
    return scores.to(result_dtype(scores)).clamp(-reward_clip, reward_clip)


def overlong_penalty(
    lengths: Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), per sample.

    With L_max = ``max_length`` (the engine's max tokens) and L_cache = ``buffer_length``:
    0 for |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|) / L_cache for L_max − L_cache < |y| ≤ L_max;
    −1 beyond; times ``penalty_factor`` (verl's ``overlong_penalty_factor``). Added to the score.
    Returns float32 (batch,) for the (batch,) response ``lengths``.
    """
    check_range("max_length", max_length, low=1)
    check_range("overlong_buffer_length", buffer_length, low=1, high=max_length, high_inclusive=False)
    check_range("overlong_penalty_factor", penalty_factor, low=0.0)
    expected = max_length - buffer_length
    excess = (expected - lengths.to(torch.float32)) / buffer_length
    return penalty_factor * excess.clamp(min=-1.0, max=0.0)


def token_level_rewards(
    scores: Tensor,
    response_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    action_mask: Tensor | None = None,
) -> Tensor:
    """(batch, len) rewards: each sample's score on its last valid token (an empty response gets none),
    plus −kl_coef·kl on every valid token when ``kl`` is given (ROLL ``add_token_level_kl`` /
    verl ``use_kl_in_reward``). With an ``action_mask`` (multi-turn episodes) only the policy's tokens
    count as valid: the score goes on the last of them, the KL term on each. The result has the
    scores' dtype."""
    mask = response_mask.to(scores.device).bool()
    check_right_padded(mask)
    if action_mask is not None:
        mask = check_action_mask(action_mask, mask)
    if scores.shape != mask.shape[:1]:
        raise ValueError(
            f"scores has shape {list(scores.shape)}; allowed values: one score per sample, ({mask.shape[0]},)"
        )
    check_range("kl_coef", kl_coef, low=0.0)
    dtype = working_dtype(scores)
    counts = mask.cumsum(dim=1)
    last = mask & (counts == counts[:, -1:])  # the last valid token of each row (none in an empty one)
    rewards = torch.where(last, scores.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=mask.device))
    if kl is not None:
        check_same_shape(kl=kl, response_mask=response_mask)
        rewards = rewards - kl_coef * zero_padding(kl.to(mask.device, dtype), mask)
    return rewards.to(result_dtype(scores))


def whiten_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """(A − mean) / √(var + 1e-8) over the batch's valid tokens (unbiased var, ``masked_whiten``);
    padding is 0. Fewer than two valid tokens: centred only."""
    check_same_shape(advantages=advantages, response_mask=response_mask)
    mask = response_mask.to(advantages.device).bool()
    return masked_whiten(advantages.to(working_dtype(advantages)), mask).to(result_dtype(advantages))


def clip_advantages(
    advantages: Tensor, response_mask: Tensor, advantage_clip: float | None
) -> tuple[Tensor, float]:
    """Advantages clamped to [−advantage_clip, advantage_clip] with padding 0, and the fraction of valid
    tokens that were clipped (ROLL counts padding in the denominator; here only valid tokens count).
    None leaves the advantages as given, with fraction 0."""
    if advantage_clip is None:
        return advantages, 0.0
    check_range("advantage_clip", advantage_clip, low=0.0, low_inclusive=False)
    check_same_shape(advantages=advantages, response_mask=response_mask)
    mask = response_mask.to(advantages.device).bool()
    values = zero_padding(advantages, mask)
    clipped = (values.abs() > advantage_clip) & mask
    fraction = clipped.sum().item() / max(int(mask.sum().item()), 1)
    return values.clamp(-advantage_clip, advantage_clip), fraction
