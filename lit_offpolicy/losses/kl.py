"""KL between the policy and the reference: per-token estimators and the KL coefficient controllers."""

from __future__ import annotations

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_range

KL_KINDS = ("kl", "abs", "mse", "low_var_kl", "full")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
LOW_VAR_KL_CLAMP = 10.0


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "kl") -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman, "Approximating KL", 2020).

    With d = log π_θ(a) − log π_ref(a) on the sampled token a:

    - ``kl`` (k1): d
    - ``abs``: |d|
    - ``mse`` (k2): ½·d²
    - ``low_var_kl`` (k3): exp(−d) + d − 1, clamped to [−10, 10] (as verl and ROLL)
    - ``full``: Σ_v π_θ(v)·(log π_θ(v) − log π_ref(v)), exact, from full log-distributions (…, V);
      the result drops the vocabulary dimension.

    ``k1``, ``k2`` and ``k3`` are accepted as aliases.
    """
    kind = KL_ALIASES.get(kind, kind)
    check_choice("kind", kind, KL_KINDS + tuple(KL_ALIASES))
    diff = log_probs - ref_log_probs
    if kind == "kl":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "mse":
        return 0.5 * diff**2
    if kind == "low_var_kl":
        return (torch.exp(-diff) + diff - 1.0).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return (torch.exp(log_probs) * diff).sum(dim=-1)


class FixedKLController:
    """A constant KL coefficient β."""

    def __init__(self, kl_coef: float = 0.2) -> None:
        self.value = check_range("kl_coef", kl_coef, low=0.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Proportional controller of β towards a target KL (Ziegler et al. 2019, arXiv:1909.08593).

    e = clip(KL / target_kl − 1, −0.2, 0.2);  β ← β·(1 + e·n_steps / kl_horizon).
    """

    def __init__(self, init_kl_coef: float = 0.2, target_kl: float = 0.1, kl_horizon: int = 10000) -> None:
        super().__init__(check_range("init_kl_coef", init_kl_coef, low=0.0))
        self.target_kl = check_range("target_kl", target_kl, low=0.0, low_inclusive=False)
        self.kl_horizon = check_range("kl_horizon", kl_horizon, low=0, low_inclusive=False)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.kl_horizon


def kl_controller(
    init_kl_coef: float = 0.2, target_kl: float | None = None, kl_horizon: int = 10000
) -> FixedKLController:
    """The adaptive controller when ``target_kl`` is set, else a fixed β = ``init_kl_coef`` (as ROLL)."""
    if target_kl is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target_kl, kl_horizon)
