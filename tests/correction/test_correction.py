"""Tests of lit_offpolicy.correction: expected numbers are computed here with plain python and math."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import pickle

import pytest
import torch

from lit_offpolicy.correction import (
    PRESETS,
    RolloutCorrection,
    pure_is_policy_loss,
    resolve_rollout_correction,
)

NAN = float("nan")
T = 4

# Hand example: rollout log-probs and log ratios r = old − rollout of the valid tokens of four
# sequences; the last sequence is empty. Padding is filled in by `hand_batch`.
ROLLOUT = [[-1.0, -0.5, -2.0], [-0.3, -1.2], [-0.7, -0.1, -1.5, -0.9], []]
R = [[0.1, -0.2, 0.5], [0.9, -0.1], [-1.0, 0.0, 0.2, -0.3], []]
OLD = [[lp + r for lp, r in zip(lps, rs, strict=True)] for lps, rs in zip(ROLLOUT, R, strict=True)]
TOKENS = [r for rs in R for r in rs]
NONEMPTY = [i for i, rs in enumerate(R) if rs]

OFFPOLICY_KEYS = {
    "kl",
    "k3_kl",
    "training_ppl",
    "rollout_ppl",
    "log_ppl_diff",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
}
MASK_KEYS = {"rollout_rs_masked_fraction", "rollout_is_veto_fraction"}
IS_KEYS = {
    "rollout_is_mean",
    "rollout_is_std",
    "rollout_is_min",
    "rollout_is_max",
    "rollout_is_eff_sample_size",
    "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low",
}


def mean(values):
    return sum(values) / len(values)


def padded(rows, pad):
    return [row + [pad] * (T - len(row)) for row in rows]


def hand_batch(old_pad=NAN, rollout_pad=NAN, dtype=torch.float64, mask_dtype=torch.long):
    return {
        "old_log_probs": torch.tensor(padded(OLD, old_pad), dtype=dtype),
        "rollout_log_probs": torch.tensor(padded(ROLLOUT, rollout_pad), dtype=dtype),
        "response_mask": torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in R], dtype=mask_dtype),
    }


def per_token(per_sequence):
    """Spread one value per sequence over its valid tokens, then pad with 0 (as the weights are)."""
    return padded([[v] * len(rs) for v, rs in zip(per_sequence, R, strict=True)], 0.0)


def metric(out, name):
    return out.metrics[f"rollout_corr/{name}"]


def expected_offpolicy():
    old_means = [mean(OLD[i]) for i in NONEMPTY]
    rollout_means = [mean(ROLLOUT[i]) for i in NONEMPTY]
    return {
        "kl": mean([-r for r in TOKENS]),
        "k3_kl": mean([math.exp(r) - r - 1 for r in TOKENS]),
        "training_ppl": mean([math.exp(-m) for m in old_means]),
        "rollout_ppl": mean([math.exp(-m) for m in rollout_means]),
        "log_ppl_diff": mean([m_r - m_o for m_r, m_o in zip(rollout_means, old_means, strict=True)]),
        "ppl_ratio": mean([math.exp(m_r - m_o) for m_r, m_o in zip(rollout_means, old_means, strict=True)]),
        "chi2_token": mean([math.exp(2 * r) for r in TOKENS]) - 1,
        "chi2_seq": mean([math.exp(2 * sum(R[i])) for i in NONEMPTY]) - 1,
    }


def expected_weight_stats(ratios, threshold):
    """`ratios`: one untruncated ratio per valid token."""
    weights = [min(rho, threshold) for rho in ratios]
    n = len(weights)
    m = mean(weights)
    return {
        "rollout_is_mean": m,
        "rollout_is_std": math.sqrt(mean([(w - m) ** 2 for w in weights])),
        "rollout_is_min": min(weights),
        "rollout_is_max": max(weights),
        "rollout_is_eff_sample_size": sum(weights) ** 2 / (n * sum(w * w for w in weights)),
        "rollout_is_ratio_fraction_high": sum(rho > threshold for rho in ratios) / n,
        "rollout_is_ratio_fraction_low": sum(rho < 1 / threshold for rho in ratios) / n,
    }


def assert_metrics(out, expected, rel=1e-12, abs_=1e-12):
    """Default: float64 against python floats, the same exps, logs and ≤ 9-term means in another order:
    ≲ 20 eps64 (2.2e-16) relative, ≈ 4e-15; rel 1e-12 leaves 200× (abs 1e-12 for values near 0)."""
    for name, value in expected.items():
        assert metric(out, name) == pytest.approx(value, rel=rel, abs=abs_), name


# ------------------------------------------------------------------------------- hand example


def test_token_is_weights_and_every_metric_on_the_hand_example():
    out = RolloutCorrection.token_is(threshold=2.0).compute(**hand_batch())
    expected_weights = padded([[min(math.exp(r), 2.0) for r in rs] for rs in R], 0.0)
    # float64, one exp of an input difference per weight: a few eps64 ≪ assert_close's float64 default
    # (rtol 1e-7, atol 1e-7), as for the other weights and approx's default rel=1e-6 below
    torch.testing.assert_close(out.is_weights, torch.tensor(expected_weights, dtype=torch.float64))
    assert out.is_weights[1, 0] == 2.0  # exp(0.9) ≈ 2.46 truncated
    assert torch.equal(out.response_mask, hand_batch()["response_mask"])
    assert set(out.metrics) == {f"rollout_corr/{k}" for k in OFFPOLICY_KEYS | MASK_KEYS | IS_KEYS}
    assert all(type(v) is float for v in out.metrics.values())
    assert_metrics(out, expected_offpolicy())
    assert_metrics(out, expected_weight_stats([math.exp(r) for r in TOKENS], 2.0))
    assert_metrics(out, {"rollout_rs_masked_fraction": 0.0, "rollout_is_veto_fraction": 0.0})
    # two spot checks written out by hand: one of nine ratios is above 2 (r=0.9), one below 1/2 (r=-1)
    assert metric(out, "rollout_is_ratio_fraction_high") == pytest.approx(1 / 9)
    assert metric(out, "rollout_is_ratio_fraction_low") == pytest.approx(1 / 9)
    assert metric(out, "kl") == pytest.approx(-0.1 / 9)


def test_sequence_is_weights_on_the_hand_example():
    out = RolloutCorrection.seq_is(threshold=2.0).compute(**hand_batch())
    seq_ratio = [math.exp(sum(rs)) for rs in R]  # exp(0.4), exp(0.8) ≈ 2.23, exp(-1.1), 1 (empty)
    expected = per_token([min(rho, 2.0) for rho in seq_ratio])
    # float64, an exp of a ≤ 4-term sum: ≲ 10 eps64 relative ≪ the defaults (assert_close, approx)
    torch.testing.assert_close(out.is_weights, torch.tensor(expected, dtype=torch.float64))
    token_ratios = [rho for rho, rs in zip(seq_ratio, R, strict=True) for _ in rs]
    assert_metrics(out, expected_weight_stats(token_ratios, 2.0))
    assert metric(out, "rollout_is_ratio_fraction_high") == pytest.approx(2 / 9)  # sequence 1's two tokens
    assert metric(out, "rollout_is_ratio_fraction_low") == pytest.approx(4 / 9)  # sequence 2's four tokens


def test_token_rejection_on_the_hand_example():
    rc = RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0)
    out = rc.compute(**hand_batch())
    # kept: 0.5 ≤ exp(r) ≤ 2, i.e. every token but r=0.9 and r=-1.0
    expected_mask = [[1, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]]
    assert out.response_mask.tolist() == expected_mask
    assert out.is_weights is None
    # a float64 count over 9: one rounding, ≪ approx's default rel=1e-6 (as for every fraction here)
    assert metric(out, "rollout_rs_masked_fraction") == pytest.approx(2 / 9)
    assert set(out.metrics) == {f"rollout_corr/{k}" for k in OFFPOLICY_KEYS | MASK_KEYS}
    assert_metrics(out, expected_offpolicy())  # metrics use the mask before rejection


def test_sequence_rejection_drops_whole_sequences_and_zeroes_their_weights():
    out = RolloutCorrection.seq_is_rs(is_threshold=2.0, rs_threshold=2.0).compute(**hand_batch())
    # exp(Σr) = 1.49 (kept), 2.23 (> 2), 0.33 (< 1/2)
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [0] * 4, [0] * 4, [0] * 4]
    expected = per_token([math.exp(0.4), 0.0, 0.0, 0.0])
    torch.testing.assert_close(out.is_weights, torch.tensor(expected, dtype=torch.float64))
    assert metric(out, "rollout_rs_masked_fraction") == pytest.approx(6 / 9)
    # IS statistics describe the weights of every originally valid token, before rejection
    token_ratios = [math.exp(sum(rs)) for rs in R for _ in rs]
    assert_metrics(out, expected_weight_stats(token_ratios, 2.0))


def test_seq_mis_has_no_lower_bound():
    out = RolloutCorrection.seq_mis(threshold=2.0).compute(**hand_batch())
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [0] * 4, [1, 1, 1, 1], [0] * 4]
    assert metric(out, "rollout_rs_masked_fraction") == pytest.approx(2 / 9)


@pytest.mark.parametrize("upper", [1.2, 1.5])
def test_geometric_rejection_uses_the_mean_log_ratio(upper):
    rc = RolloutCorrection(rollout_rs="geometric", rollout_rs_threshold=upper)
    out = rc.compute(**hand_batch())
    kept = [bool(rs) and 1 / upper <= math.exp(mean(rs)) <= upper for rs in R]
    expected = [[int(k)] * len(rs) + [0] * (T - len(rs)) for k, rs in zip(kept, R, strict=True)]
    assert out.response_mask.tolist() == expected
    rejected_tokens = sum(len(rs) for k, rs in zip(kept, R, strict=True) if not k and rs)
    assert metric(out, "rollout_rs_masked_fraction") == pytest.approx(rejected_tokens / 9)  # a count / 9


def test_geometric_and_sequence_rejection_differ_on_a_long_sequence():
    rollout = torch.full((1, 4), -1.0)
    batch = {"old_log_probs": rollout + 0.3, "rollout_log_probs": rollout, "response_mask": torch.ones(1, 4)}
    # Σr = 1.2 → exp ≈ 3.32 > 2; mean r = 0.3 → exp ≈ 1.35 ≤ 2
    geometric = RolloutCorrection(rollout_rs="geometric", rollout_rs_threshold=2.0).compute(**batch)
    sequence = RolloutCorrection(rollout_rs="sequence", rollout_rs_threshold=2.0).compute(**batch)
    assert geometric.response_mask.tolist() == [[1.0] * 4]
    assert sequence.response_mask.tolist() == [[0.0] * 4]


def test_veto_removes_whole_sequences():
    rc = RolloutCorrection(rollout_is="token", rollout_token_veto_threshold=0.5)
    out = rc.compute(**hand_batch())
    # log 0.5 ≈ -0.69: only sequence 2 holds a token below it (r = -1.0)
    assert out.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]
    assert out.is_weights[2].tolist() == [0.0] * 4
    assert metric(out, "rollout_is_veto_fraction") == pytest.approx(1 / 3)  # of the non-empty sequences
    assert metric(out, "rollout_rs_masked_fraction") == 0.0
    lenient = RolloutCorrection(rollout_token_veto_threshold=0.3).compute(**hand_batch())
    assert metric(lenient, "rollout_is_veto_fraction") == 0.0


def test_veto_compares_unclamped_log_ratios():
    rollout = torch.zeros(2, 2)
    old = torch.tensor([[-30.0, 0.0], [-22.0, 0.0]])  # ratios e^-30 and e^-22, both below e^-20
    out = RolloutCorrection(rollout_token_veto_threshold=math.exp(-25)).compute(
        old_log_probs=old, rollout_log_probs=rollout, response_mask=torch.ones(2, 2)
    )
    assert out.response_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]]


@pytest.mark.parametrize(("lower", "upper"), [(0.5, 1.0), (1.0, 2.0)])
def test_rejection_bounds_are_inclusive(lower, upper):
    batch = hand_batch()
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()  # ρ = 1 exactly
    rc = RolloutCorrection(rollout_rs="token", rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
    assert torch.equal(rc.compute(**batch).response_mask, batch["response_mask"])


def test_geo_rs_preset_on_the_hand_example():
    out = RolloutCorrection.geo_rs().compute(**hand_batch())
    assert out.response_mask.sum() == 0  # no per-token mean ratio is within ±0.1 % of 1
    assert metric(out, "rollout_rs_masked_fraction") == 1.0
    assert metric(out, "rollout_is_veto_fraction") == 0.0  # smallest ratio exp(-1) > 1e-4


# ------------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("name", [p for p in PRESETS if p not in ("ppo_is_bypass", "pure_is")])
def test_identical_policies_are_left_alone(name):
    batch = hand_batch()
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()
    out = RolloutCorrection.from_preset(name).compute(**batch)
    assert torch.equal(out.response_mask, batch["response_mask"])
    if out.is_weights is not None:
        assert torch.equal(out.is_weights, batch["response_mask"].to(torch.float64))
        assert metric(out, "rollout_is_eff_sample_size") == pytest.approx(1.0)  # (Σ1)²/(n·Σ1²): exact
    # every log-ratio is 0 exactly, so these are exact zeros and exact ratios of equal float64 means:
    # abs=1e-15 (≈ 5 eps64) and approx's default rel=1e-6 only allow a last-bit difference
    for name_, value in {"kl": 0, "k3_kl": 0, "chi2_token": 0, "chi2_seq": 0, "log_ppl_diff": 0}.items():
        assert metric(out, name_) == pytest.approx(value, abs=1e-15)
    assert metric(out, "ppl_ratio") == pytest.approx(1.0)
    assert metric(out, "training_ppl") == pytest.approx(metric(out, "rollout_ppl"))
    assert metric(out, "rollout_rs_masked_fraction") == 0.0
    assert metric(out, "rollout_is_veto_fraction") == 0.0


def test_sequence_weight_is_the_product_of_token_ratios():
    generator = torch.Generator().manual_seed(0)
    rollout = -torch.rand(5, 7, generator=generator, dtype=torch.float64)
    log_ratio = 0.3 * torch.randn(5, 7, generator=generator, dtype=torch.float64)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    out = RolloutCorrection.seq_is(threshold=1e6).compute(
        old_log_probs=rollout + log_ratio, rollout_log_probs=rollout, response_mask=mask
    )
    for i, n in enumerate(lengths):
        product = math.prod(math.exp(r) for r in log_ratio[i, :n].tolist())
        # float64, exp of a ≤ 7-term sum against a product of ≤ 7 exps: ≲ 15 eps64 ≈ 3e-15 relative
        assert out.is_weights[i, :n].tolist() == pytest.approx([product] * n, rel=1e-12)
        assert out.is_weights[i, n:].tolist() == [0.0] * (7 - n)


def test_log_ratios_are_clamped_before_exp():
    old = torch.tensor([[50.0, 0.0]])  # r = 50
    out = RolloutCorrection(rollout_is="token", rollout_is_threshold=1e12).compute(
        old_log_probs=old, rollout_log_probs=torch.zeros(1, 2), response_mask=torch.ones(1, 2)
    )
    # float32: exp of the exact clamp 20.0, ≤ 2 ulps (2.4e-7 relative) whatever the CPU's exp: rel 1e-6;
    # chi2 adds a squaring or exp(2r) and a 2-term mean, ≤ 4 roundings, 5e-7: rel 1e-5 leaves 20×
    assert out.is_weights[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert metric(out, "chi2_token") == pytest.approx((math.exp(40.0) + 1) / 2 - 1, rel=1e-5)


GARBAGE = [(0.0, 0.0), (NAN, NAN), (math.inf, -math.inf), (1e30, -1e30), (-7.0, NAN)]


@pytest.mark.parametrize("name", PRESETS)
def test_padding_garbage_changes_nothing(name):
    rc = RolloutCorrection.from_preset(name)
    reference = rc.compute(**hand_batch(0.0, 0.0))
    for old_pad, rollout_pad in GARBAGE[1:]:
        out = rc.compute(**hand_batch(old_pad, rollout_pad))
        assert torch.equal(out.response_mask, reference.response_mask)
        assert out.metrics == reference.metrics
        if reference.is_weights is None:
            assert out.is_weights is None
        else:
            assert torch.equal(out.is_weights, reference.is_weights)


def test_every_metric_is_zero_on_an_all_empty_batch():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    batch = {"old_log_probs": torch.full((2, 3), NAN), "rollout_log_probs": torch.full((2, 3), NAN)}
    rc = RolloutCorrection(rollout_is="sequence", rollout_rs="token", rollout_rs_threshold=2.0)
    out = rc.compute(**batch, response_mask=mask)
    assert out.is_weights.tolist() == [[0.0] * 3] * 2
    assert not out.response_mask.any()
    assert set(out.metrics.values()) == {0.0}


def test_empty_rows_do_not_count_in_sequence_means():
    out = RolloutCorrection.disabled().compute(**hand_batch())
    # hand example holds one empty row; expected_offpolicy averages over the three others
    assert_metrics(out, expected_offpolicy())


# float64: as assert_metrics' default. float32: the inputs round to u = 6e-8 relative, so each log-ratio
# r = old − rollout is off by ≤ u·(|old| + |rollout| + |r|) ≤ 6e-8 × 5 = 3e-7 absolute, and a sequence's
# Σr (≤ 4 tokens) by ≤ 1.2e-6. Means of r (kl, log_ppl_diff, about 0.01 here) are then off by ~3e-7
# absolute: abs 1e-6 (relative to kl = −0.011 that is up to 3e-5, beyond any rel of float32's order);
# means of exp(r), exp(2r), exp(2Σr) relatively by ≤ 2 × 1.2e-6 plus a few roundings: rel 1e-5.
@pytest.mark.parametrize(
    ("dtype", "rel", "abs_"),
    [(torch.float64, 1e-12, 1e-12), (torch.float32, 1e-5, 1e-6), (torch.bfloat16, None, None)],
)
def test_dtypes(dtype, rel, abs_):
    out = RolloutCorrection.token_is().compute(**hand_batch(0.0, 0.0, dtype=dtype))
    assert out.is_weights.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    if rel is not None:
        assert_metrics(out, expected_offpolicy(), rel=rel, abs_=abs_)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.float32])
def test_returned_mask_keeps_the_input_dtype(mask_dtype):
    rc = RolloutCorrection(rollout_rs="token", rollout_rs_threshold=2.0)
    out = rc.compute(**hand_batch(mask_dtype=mask_dtype))
    assert out.response_mask.dtype == mask_dtype
    assert out.response_mask.to(torch.long).sum() == 7


def test_weights_are_detached():
    batch = hand_batch(0.0, 0.0)
    batch["old_log_probs"].requires_grad_(True)
    out = RolloutCorrection.seq_is().compute(**batch)
    assert not out.is_weights.requires_grad


# ----------------------------------------------------------------------------------- bypass mode


@pytest.mark.parametrize("name", ["ppo_is_bypass", "pure_is"])
def test_bypass_mode_takes_rollout_as_old_and_gives_weights_one(name):
    rc = RolloutCorrection.from_preset(name)
    assert not rc.requires_old_log_probs
    batch = hand_batch()
    del batch["old_log_probs"]
    out = rc.compute(**batch)
    assert torch.equal(out.is_weights, batch["response_mask"].to(torch.float64))
    assert torch.equal(out.response_mask, batch["response_mask"])
    assert metric(out, "kl") == 0.0
    assert metric(out, "chi2_seq") == 0.0
    assert metric(out, "training_ppl") == metric(out, "rollout_ppl")
    passing_rollout = rc.compute(old_log_probs=batch["rollout_log_probs"], **batch)
    assert passing_rollout.metrics == out.metrics


def test_standard_mode_needs_old_log_probs():
    assert RolloutCorrection.token_is().requires_old_log_probs
    batch = hand_batch()
    del batch["old_log_probs"]
    with pytest.raises(ValueError, match="old_log_probs=None"):
        RolloutCorrection.token_is().compute(**batch)


# -------------------------------------------------------------------------------------- pure IS


def pure_is_batch():
    log_probs = torch.tensor([[-0.5, -1.0, NAN], [-2.0, -0.2, -0.1]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.5, -0.9, 3.0], [-1.0, -0.3, -0.1]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, NAN], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return {
        "log_probs": log_probs,
        "rollout_log_probs": rollout,
        "advantages": advantages,
        "response_mask": mask,
    }


LP = [[-0.5, -1.0], [-2.0, -0.2, -0.1]]
ADV = [[1.0, 1.0], [-2.0, -2.0, -2.0]]
PURE_R = [[1.0, -0.1], [-1.0, 0.1, 0.0]]  # log π_θ − log π_rollout


def pure_expected(weights, loss_agg_mode):
    token_losses = [
        [-a * w * lp for a, w, lp in zip(*row, strict=True)] for row in zip(ADV, weights, LP, strict=True)
    ]
    token_grads = [[-a * w for a, w in zip(*row, strict=True)] for row in zip(ADV, weights, strict=True)]
    if loss_agg_mode == "token-mean":
        loss = sum(map(sum, token_losses)) / 5
        grads = [[g / 5 for g in row] for row in token_grads]
    else:  # seq-mean-token-sum
        loss = mean([sum(row) for row in token_losses])
        grads = [[g / 2 for g in row] for row in token_grads]
    return loss, [row + [0.0] * (3 - len(row)) for row in grads]


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("rollout_is", ["token", "sequence", None])
def test_pure_is_loss_value_and_gradient(rollout_is, loss_agg_mode):
    if rollout_is == "token":
        weights = [[min(math.exp(r), 2.0) for r in row] for row in PURE_R]  # exp(1) truncated to 2
    elif rollout_is == "sequence":
        weights = [[min(math.exp(sum(row)), 2.0)] * len(row) for row in PURE_R]  # exp(0.9) → 2, exp(-0.9)
    else:
        weights = [[1.0] * len(row) for row in PURE_R]
    batch = pure_is_batch()
    out = pure_is_policy_loss(**batch, rollout_is=rollout_is, threshold=2.0, loss_agg_mode=loss_agg_mode)
    expected_loss, expected_grad = pure_expected(weights, loss_agg_mode)
    # float64 against python floats, an exp and ≤ 5-term sums per value: ≲ 10 eps64 relative ≪ rel
    # 1e-12 and the defaults (assert_close rtol/atol 1e-7, approx rel 1e-6) used for the rest
    assert out.loss.item() == pytest.approx(expected_loss, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(batch["log_probs"].grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert out.metrics["pg_loss"] == pytest.approx(expected_loss, rel=1e-12)
    assert out.metrics["is_weight_mean"] == pytest.approx(mean([w for row in weights for w in row]))
    truncated = {"token": 1 / 5, "sequence": 2 / 5, None: 0.0}[rollout_is]
    assert out.metrics["is_truncated_fraction"] == pytest.approx(truncated)
    assert out.metrics["policy_kl"] == pytest.approx(mean([-r for row in PURE_R for r in row]))


def test_pure_is_loss_uses_the_rejection_mask():
    batch = pure_is_batch()
    batch["response_mask"] = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = pure_is_policy_loss(**batch, rollout_is="token", threshold=2.0)
    out.loss.backward()
    # float64 hand value: a few eps64 relative ≪ approx's default rel=1e-6
    assert out.loss.item() == pytest.approx(-(2.0 * -0.5 + math.exp(-0.1) * -1.0) / 2)
    assert batch["log_probs"].grad[1].tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------ presets & config


PRESET_FIELDS = {
    "token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "token_tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "seq_is_rs": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 2.0,
    },
    "seq_mis": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 2.0,
        "rollout_rs_threshold_lower": 0.0,
    },
    "geo_rs": {
        "rollout_rs": "geometric",
        "rollout_rs_threshold": 1.001,
        "rollout_token_veto_threshold": 1e-4,
    },
    "geo_mis": {
        "rollout_rs": "geometric",
        "rollout_rs_threshold": 1.001,
        "rollout_rs_threshold_lower": 0.999,
        "rollout_token_veto_threshold": 1e-4,
    },
    "ppo_is_bypass": {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True},
    "pure_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "bypass_mode": True, "pure_is": True},
    "disabled": {},
}


def test_presets_tuple_lists_every_preset():
    assert set(PRESETS) == set(PRESET_FIELDS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_fields(name):
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutCorrection)}
    expected = {**defaults, **PRESET_FIELDS[name]}
    preset = getattr(RolloutCorrection, name)()
    assert dataclasses.asdict(preset) == expected
    assert RolloutCorrection.from_preset(name) == preset
    assert resolve_rollout_correction(name) == preset
    assert preset.requires_old_log_probs == (not expected["bypass_mode"])


def test_preset_overrides():
    assert RolloutCorrection.token_is(threshold=3.0).rollout_is_threshold == 3.0
    assert RolloutCorrection.pure_is(threshold=5.0).rollout_is_threshold == 5.0
    seq = RolloutCorrection.from_preset(
        "seq_is_rs", is_threshold=3.0, rs_threshold=4.0, rs_threshold_lower=0.5
    )
    assert seq == RolloutCorrection(
        rollout_is="sequence",
        rollout_is_threshold=3.0,
        rollout_rs="sequence",
        rollout_rs_threshold=4.0,
        rollout_rs_threshold_lower=0.5,
    )
    geo = RolloutCorrection.geo_rs(rs_threshold=1.0002, veto_threshold=None)
    assert (geo.rollout_rs_threshold, geo.rollout_token_veto_threshold) == (1.0002, None)
    assert RolloutCorrection.seq_mis(threshold=3.0).rollout_rs_threshold == 3.0


def test_pure_is_is_a_preset_on_the_class_and_a_flag_on_instances():
    preset = RolloutCorrection.pure_is()
    assert preset.pure_is is True
    assert RolloutCorrection().pure_is is False
    assert RolloutCorrection.ppo_is_bypass().pure_is is False
    parameter = inspect.signature(RolloutCorrection).parameters["pure_is"]
    assert parameter.default is False
    assert dataclasses.replace(preset, rollout_is_threshold=3.0).pure_is is True
    assert pickle.loads(pickle.dumps(preset)) == preset
    assert copy.deepcopy(preset).pure_is is True
    assert "pure_is=True" in repr(preset)
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.pure_is = False


def test_resolve_rollout_correction():
    rc = RolloutCorrection.seq_is()
    assert resolve_rollout_correction(rc) is rc
    assert resolve_rollout_correction(None) is None
    with pytest.raises(ValueError, match="seq_is_rs"):
        resolve_rollout_correction("seq_isrs")
    with pytest.raises(ValueError, match="rollout_correction=42"):
        resolve_rollout_correction(42)


def test_jsonargparse_reads_the_constructor():
    import jsonargparse

    def trainer(rollout_correction: RolloutCorrection | str | None = None):
        return rollout_correction

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(trainer, "trainer")
    config = "trainer:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 3.0\n"
    built = parser.instantiate(parser.parse_string(config)).trainer.rollout_correction
    assert built == RolloutCorrection(rollout_is="token", rollout_is_threshold=3.0)
    named = parser.parse_string("trainer:\n  rollout_correction: geo_rs\n").trainer.rollout_correction
    assert resolve_rollout_correction(named) == RolloutCorrection.geo_rs()


# --------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_is": "seq"}, r"rollout_is='seq' .*allowed values: None, 'token', 'sequence'"),
        ({"rollout_rs": "geo", "rollout_rs_threshold": 2.0}, r"rollout_rs='geo' .*'geometric'"),
        ({"rollout_rs": "token"}, r"rollout_rs_threshold=None .*rollout_rs='token'"),
        ({"rollout_is_threshold": 0.0}, r"rollout_is_threshold=0.0 .*allowed values: \(0.0, inf\]"),
        ({"rollout_is_threshold": -1.0}, r"rollout_is_threshold=-1.0"),
        ({"rollout_is_threshold": NAN}, r"rollout_is_threshold=nan"),
        ({"rollout_rs": "token", "rollout_rs_threshold": 0.0}, r"rollout_rs_threshold=0.0"),
        ({"rollout_rs": "token", "rollout_rs_threshold": -2.0}, r"rollout_rs_threshold=-2.0"),
        (
            {"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 2.0},
            r"rollout_rs_threshold_lower=2.0 .*allowed values: \[0, 2\)",
        ),
        (
            {"rollout_rs": "token", "rollout_rs_threshold": 0.8},
            r"rollout_rs_threshold_lower=None \(lower bound 1.25\)",
        ),
        (
            {"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": -0.5},
            r"rollout_rs_threshold_lower=-0.5",
        ),
        ({"rollout_token_veto_threshold": 0.0}, r"rollout_token_veto_threshold=0.0 .*\(0.0, 1.0\)"),
        ({"rollout_token_veto_threshold": 1.0}, r"rollout_token_veto_threshold=1.0"),
        ({"rollout_token_veto_threshold": 2.0}, r"rollout_token_veto_threshold=2.0"),
        ({"pure_is": True}, r"pure_is=True .*bypass_mode=False"),
        ({"bypass_mode": "yes"}, r"bypass_mode='yes'"),
        (
            {"bypass_mode": True, "rollout_rs": "token", "rollout_rs_threshold": 2.0},
            r"rollout_rs='token' .*bypass",
        ),
        ({"bypass_mode": True, "rollout_token_veto_threshold": 1e-4}, r"rollout_token_veto_threshold=0.0001"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**kwargs)


def test_bad_preset_calls_raise():
    with pytest.raises(ValueError, match=r"rollout_correction='tis' .*'token_is', 'token_tis'"):
        RolloutCorrection.from_preset("tis")
    with pytest.raises(
        ValueError, match=r"seq_is\(\) has no option 'rs_threshold'; allowed values: threshold"
    ):
        RolloutCorrection.from_preset("seq_is", rs_threshold=2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold=-1"):
        RolloutCorrection.token_is(threshold=-1.0)


def test_bad_tensors_raise():
    rc = RolloutCorrection.token_is()
    batch = hand_batch()
    with pytest.raises(ValueError, match="shapes must match"):
        rc.compute(**{**batch, "response_mask": batch["response_mask"][:, :2]})
    with pytest.raises(ValueError, match=r"\(batch, T\)"):
        rc.compute(**{name: tensor[0] for name, tensor in batch.items()})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_is": "geometric"}, r"rollout_is='geometric'"),
        ({"threshold": 0.0}, r"threshold=0.0"),
        ({"loss_agg_mode": "mean"}, r"loss_agg_mode='mean'"),
    ],
)
def test_bad_pure_is_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pure_is_policy_loss(**pure_is_batch(), **kwargs)
