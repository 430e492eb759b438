"""RolloutCorrection: the settings, presets and per-batch computation of rollout correction.

Three policies take part in a step (see docs/rollout_correction.md):

- π_rollout: the inference engine as it sampled (e.g. vLLM in bf16, possibly some versions behind);
- π_old:     the trainer's own recompute of the same tokens at the start of the step;
- π_θ:       the policy being optimized.

In the standard (decoupled) mode the policy loss clips π_θ against π_old and this module corrects
the π_old / π_rollout gap with importance weights, rejection and a veto. Settings and presets are
those of verl's ``RolloutCorrectionConfig`` (volcengine/verl#3984, commit 418f964).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_offpolicy.core.checks import check_choice, check_range, check_same_shape
from lit_offpolicy.core.masked import masked_mean, zero_padding
from lit_offpolicy.core.registry import import_object
from lit_offpolicy.correction.metrics import is_weight_metrics, offpolicy_metrics
from lit_offpolicy.correction.ratios import (
    IS_LEVELS,
    RS_LEVELS,
    level_ratio,
    rejection_keep,
    truncated_is_weights,
    veto_keep,
)

METRIC_PREFIX = "rollout_corr/"

PRESETS = (
    "token_is",
    "token_tis",
    "seq_is",
    "seq_is_rs",
    "seq_mis",
    "geo_rs",
    "geo_mis",
    "ppo_is_bypass",
    "pure_is",
    "disabled",
)
"""Names accepted by :meth:`RolloutCorrection.from_preset` and, as strings, in YAML configs."""


@dataclass(frozen=True)
class RolloutCorrectionOutput:
    """What :meth:`RolloutCorrection.compute` returns for one batch of B samples, T tokens each."""

    is_weights: Tensor | None
    """[B, T], detached: weights to multiply every per-token policy loss by, 0 on padding and on
    rejected tokens; None when ``rollout_is`` is None."""
    response_mask: Tensor
    """[B, T]: the input mask (same dtype) with rejected and vetoed tokens set to 0; the trainer
    aggregates the policy loss over this mask."""
    metrics: dict[str, float]
    """Python floats named ``rollout_corr/...``, computed on the input mask."""


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance weighting, rejection and veto of rollout tokens, plus off-policy metrics.

    With r_t = log π_old(y_t) − log π_rollout(y_t) on valid tokens and ρ = exp(clamp(·, −20, 20)),
    as verl's ``RolloutCorrectionConfig`` (volcengine/verl#3984). ``RolloutCorrection()`` equals the
    ``disabled()`` preset: every correction is opt-in. ``RolloutCorrection.pure_is()`` on the class
    is the preset; ``rc.pure_is`` on an instance is the flag (see :class:`_PresetOnClass`).
    """

    # verl's class defaults rollout_is to "sequence"; here None, so that nothing corrects unless asked
    rollout_is: str | None = None
    """Importance-weight level: "token", w_t = min(ρ_t, C); "sequence", w_t = min(exp(Σ_s r_s), C) for
    every token of the sequence; None: no weights (metrics only)."""
    rollout_is_threshold: float = 2.0
    """C, the truncation threshold of the weights (> 0)."""
    rollout_rs: str | None = None
    """Rejection level: a token is kept where lower ≤ ρ ≤ upper, ρ being exp(r_t) ("token"), exp(Σ r)
    ("sequence") or exp(mean r) ("geometric"; the last two keep or drop whole sequences). None: none."""
    rollout_rs_threshold: float | None = None
    """upper, required with ``rollout_rs`` (> 0)."""
    rollout_rs_threshold_lower: float | None = None
    """lower; None: 1 / upper; 0: no lower bound."""
    rollout_token_veto_threshold: float | None = None
    """In (0, 1): drop a whole sequence holding any valid token with ρ_t < threshold (compared as r_t <
    log threshold, unclamped). None: no veto."""
    bypass_mode: bool = False
    """π_old := π_rollout: the trainer skips the π_old recompute and PPO clips against the rollout
    policy. :meth:`compute` then sees identical policies (weights min(1, C), KL and χ² 0): rejection
    and veto would never fire, so they are refused."""
    pure_is: bool = False
    """Off-policy REINFORCE without clipping (needs ``bypass_mode``): the policy loss becomes
    ``pure_is_policy_loss``, weighted by min(π_θ / π_rollout, C) (``rollout_is``, its threshold C)."""

    def __post_init__(self) -> None:
        check_choice("rollout_is", self.rollout_is, (None, *IS_LEVELS))
        check_choice("rollout_rs", self.rollout_rs, (None, *RS_LEVELS))
        self._check_thresholds()
        self._check_modes()

    def _check_thresholds(self) -> None:
        check_range("rollout_is_threshold", self.rollout_is_threshold, low=0.0, low_inclusive=False)
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError(
                f"rollout_rs_threshold=None is not supported when rollout_rs={self.rollout_rs!r}; "
                "allowed values: a number > 0 (the upper bound of the kept ratios)"
            )
        if self.rollout_rs_threshold_lower is not None:
            check_range("rollout_rs_threshold_lower", self.rollout_rs_threshold_lower, low=0.0)
        if self.rollout_rs_threshold is not None:
            check_range("rollout_rs_threshold", self.rollout_rs_threshold, low=0.0, low_inclusive=False)
            lower, upper = self._rs_bounds()
            if lower >= upper:
                raise ValueError(
                    f"rollout_rs_threshold_lower={self.rollout_rs_threshold_lower!r} (lower bound {lower:g}) "
                    f"must be below rollout_rs_threshold={upper!r}; allowed values: [0, {upper:g})"
                )
        if self.rollout_token_veto_threshold is not None:
            check_range(
                "rollout_token_veto_threshold",
                self.rollout_token_veto_threshold,
                low=0.0,
                high=1.0,
                low_inclusive=False,
                high_inclusive=False,
            )

    def _check_modes(self) -> None:
        check_choice("bypass_mode", self.bypass_mode, (False, True))
        check_choice("pure_is", self.pure_is, (False, True))
        if self.pure_is and not self.bypass_mode:
            raise ValueError(
                "pure_is=True is not supported with bypass_mode=False; allowed values: pure_is=False, "
                "or pure_is=True together with bypass_mode=True"
            )
        if self.bypass_mode:
            for option in ("rollout_rs", "rollout_token_veto_threshold"):
                if getattr(self, option) is not None:
                    raise ValueError(
                        f"{option}={getattr(self, option)!r} is not supported with bypass_mode=True "
                        "(π_old is π_rollout there, so it could never reject anything); allowed values: None"
                    )

    # ----------------------------------------------------------------------------------- queries

    @property
    def changes_the_loss(self) -> bool:
        """Whether π_old / π_rollout reaches the loss (IS weights, rejection, veto, pure IS); without
        any of them the correction only logs its ``rollout_corr/*`` diagnostics."""
        reaching = (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold)
        return self.pure_is or any(option is not None for option in reaching)

    @property
    def requires_old_log_probs(self) -> bool:
        """Whether the trainer must recompute π_old; False in bypass mode (π_old := π_rollout)."""
        return not self.bypass_mode

    def _rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the rejection test, lower defaulting to 1 / upper; needs rollout_rs_threshold."""
        upper = self.rollout_rs_threshold
        lower = 1.0 / upper if self.rollout_rs_threshold_lower is None else self.rollout_rs_threshold_lower
        return lower, upper

    # ------------------------------------------------------------------------------- computation

    def compute(
        self,
        *,
        rollout_log_probs: Tensor,
        response_mask: Tensor,
        old_log_probs: Tensor | None = None,
    ) -> RolloutCorrectionOutput:
        """IS weights, the mask after rejection and veto, and ``rollout_corr/*`` metrics for one batch.

        Tensors are (batch, T); padding may hold anything, NaN included. ``old_log_probs`` is
        required unless ``bypass_mode``, where it defaults to ``rollout_log_probs``. Computation
        runs without gradient in the inputs' promoted dtype, at least float32.
        """
        if old_log_probs is None:
            if self.requires_old_log_probs:
                raise ValueError(
                    "old_log_probs=None is not supported with bypass_mode=False; allowed values: the "
                    "trainer's recomputed log-probs (batch, T), or set bypass_mode=True"
                )
            old_log_probs = rollout_log_probs
        check_same_shape(
            old_log_probs=old_log_probs, rollout_log_probs=rollout_log_probs, response_mask=response_mask
        )
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be (batch, T), got shape {list(response_mask.shape)}")
        dtype = torch.promote_types(
            torch.promote_types(old_log_probs.dtype, rollout_log_probs.dtype), torch.float32
        )
        with torch.no_grad():
            valid = response_mask.bool()
            old = zero_padding(old_log_probs.to(dtype), valid)
            rollout = zero_padding(rollout_log_probs.to(dtype), valid)
            return self._correct(old, rollout, valid, response_mask)

    def _correct(
        self, old: Tensor, rollout: Tensor, valid: Tensor, response_mask: Tensor
    ) -> RolloutCorrectionOutput:
        log_ratio = old - rollout
        metrics = offpolicy_metrics(old, rollout, valid)

        rs_keep = valid
        if self.rollout_rs is not None:
            lower, upper = self._rs_bounds()
            rs_keep = rejection_keep(level_ratio(log_ratio, valid, self.rollout_rs), valid, lower, upper)
        metrics["rollout_rs_masked_fraction"] = masked_mean((~rs_keep).to(old.dtype), valid)

        nonempty = valid.any(dim=-1)
        vetoed = torch.zeros_like(nonempty)
        if self.rollout_token_veto_threshold is not None:
            vetoed = ~veto_keep(log_ratio, valid, self.rollout_token_veto_threshold).squeeze(-1)
        metrics["rollout_is_veto_fraction"] = masked_mean(vetoed.to(old.dtype), nonempty)

        keep = rs_keep & ~vetoed.unsqueeze(-1)
        weights = None
        if self.rollout_is is not None:
            ratio = level_ratio(log_ratio, valid, self.rollout_is)
            truncated = truncated_is_weights(ratio, valid, self.rollout_is_threshold)
            metrics.update(is_weight_metrics(ratio, truncated, valid, self.rollout_is_threshold))
            weights = zero_padding(truncated, keep)

        names = list(metrics)
        values = torch.stack([metrics[name].to(torch.float64) for name in names]).tolist()
        return RolloutCorrectionOutput(
            is_weights=weights,
            response_mask=torch.where(keep, response_mask, torch.zeros_like(response_mask)),
            metrics={METRIC_PREFIX + name: value for name, value in zip(names, values, strict=True)},
        )

    # ---------------------------------------------------------- presets (verl's, same defaults)

    @classmethod
    def token_is(cls, threshold: float = 2.0) -> RolloutCorrection:
        """Token-level truncated IS (Token-TIS): w_t = min(ρ_t, threshold); low variance, biased."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def token_tis(cls, threshold: float = 2.0) -> RolloutCorrection:
        """Same as :meth:`token_is`."""
        return cls.token_is(threshold=threshold)

    @classmethod
    def seq_is(cls, threshold: float = 2.0) -> RolloutCorrection:
        """Sequence-level truncated IS (Seq-TIS): one weight min(Π_t ρ_t, threshold) per sequence."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: float = 2.0, rs_threshold_lower: float | None = None
    ) -> RolloutCorrection:
        """Sequence-level IS plus sequence-level rejection: drop sequences with Π ρ outside the bounds."""
        return cls(
            rollout_is="sequence",
            rollout_is_threshold=is_threshold,
            rollout_rs="sequence",
            rollout_rs_threshold=rs_threshold,
            rollout_rs_threshold_lower=rs_threshold_lower,
        )

    @classmethod
    def seq_mis(cls, threshold: float = 2.0) -> RolloutCorrection:
        """Masked IS (Seq-MIS): :meth:`seq_is_rs` with one threshold and no lower bound (lower = 0)."""
        return cls.seq_is_rs(is_threshold=threshold, rs_threshold=threshold, rs_threshold_lower=0.0)

    @classmethod
    def geo_rs(
        cls,
        rs_threshold: float = 1.001,
        rs_threshold_lower: float | None = None,
        veto_threshold: float | None = 1e-4,
    ) -> RolloutCorrection:
        """Geometric rejection (keep sequences whose per-token mean ratio is within ±0.1%) plus veto."""
        return cls(
            rollout_rs="geometric",
            rollout_rs_threshold=rs_threshold,
            rollout_rs_threshold_lower=rs_threshold_lower,
            rollout_token_veto_threshold=veto_threshold,
        )

    @classmethod
    def geo_mis(
        cls,
        rs_threshold: float = 1.001,
        rs_threshold_lower: float = 0.999,
        veto_threshold: float | None = 1e-4,
    ) -> RolloutCorrection:
        """:meth:`geo_rs` with an explicit lower bound 0.999."""
        return cls.geo_rs(
            rs_threshold=rs_threshold, rs_threshold_lower=rs_threshold_lower, veto_threshold=veto_threshold
        )

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0) -> RolloutCorrection:
        """Bypass mode: no π_old recompute, PPO clips against π_rollout; token IS weights are then 1."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True)

    @classmethod
    def disabled(cls) -> RolloutCorrection:
        """Metrics only: no weights, no rejection, standard mode."""
        return cls()

    @classmethod
    def from_preset(cls, name: str, **overrides: float | None) -> RolloutCorrection:
        """The preset called ``name`` (one of :data:`PRESETS`), with its keyword arguments overridden."""
        check_choice("rollout_correction", name, PRESETS)
        preset = getattr(cls, name)
        allowed = tuple(inspect.signature(preset).parameters)
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise ValueError(
                f"{name}() has no option {unknown[0]!r}; allowed values: {', '.join(allowed) or 'none'}"
            )
        return preset(**overrides)


def _pure_is_preset(cls: type[RolloutCorrection], threshold: float = 2.0) -> RolloutCorrection:
    """Pure IS: off-policy REINFORCE, sequence weight min(π_θ / π_rollout, threshold), no clipping."""
    return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, pure_is=True)


class _PresetOnClass:
    """A preset reached through the class, a field reached through an instance: ``pure_is`` is both a
    constructor flag and a preset (verl renamed the flag ``use_pure_rollout_correction``; here both
    names stay)."""

    # A non-data descriptor: the dataclass __init__ stores the flag in the instance __dict__, which
    # shadows the descriptor, so rc.pure_is is the bool; only RolloutCorrection.pure_is (the class)
    # reaches __get__, which returns the preset bound to the class. It is installed after @dataclass
    # has read the field's default (False), so the field, __init__'s signature, dataclasses.replace
    # and repr are untouched.

    def __init__(self, preset) -> None:
        self._preset = preset
        self.__doc__ = preset.__doc__

    def __get__(self, instance: RolloutCorrection | None, owner: type[RolloutCorrection]):
        return types.MethodType(self._preset, owner)


RolloutCorrection.pure_is = _PresetOnClass(_pure_is_preset)


def resolve_rollout_correction(
    value: RolloutCorrection | str | Mapping[str, Any] | None,
) -> RolloutCorrection | None:
    """A config value as the trainer takes it: an instance, a preset name (see :data:`PRESETS`), a
    checkpoint's ``{"class_path", "init_args"}`` (``component_config``) or None."""
    if value is None or isinstance(value, RolloutCorrection):
        return value
    if isinstance(value, str):
        return RolloutCorrection.from_preset(value)
    if isinstance(value, Mapping) and "class_path" in value:
        cls = import_object(value["class_path"], "rollout_correction")
        if isinstance(cls, type) and issubclass(cls, RolloutCorrection):
            return cls(**value.get("init_args", {}))
    raise ValueError(
        f"rollout_correction={value!r} is not supported; allowed values: None, a RolloutCorrection, "
        f"or a preset name: {', '.join(PRESETS)}"
    )
