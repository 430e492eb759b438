"""GSPO (Zheng et al. 2025) against values and gradients worked out by hand, and against the paper's
sequence-level objective differentiated by autograd.

The batch: responses of lengths 3, 1 and 2 plus an empty one, right-padded with NaN so that any leak of
padding shows; one advantage per response, as GRPO gives.
"""

import math

import pytest
import torch
from helpers.loss_checks import assert_padding_is_ignored

from lit_offpolicy.losses import GSPO, LOSS_AGG_MODES, POLICY_LOSSES, PPO, aggregate

NAN = float("nan")
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
LOG_PROBS = [[-1.0, -0.5, -2.0, NAN], [-0.3, NAN, NAN, NAN], [-1.1, -0.7, NAN, NAN], [NAN] * 4]
OLD_LOG_PROBS = [[-1.2, -0.1, -2.0, NAN], [-0.9, NAN, NAN, NAN], [-0.6, -0.7, NAN, NAN], [NAN] * 4]
SEQ_ADVANTAGES = [1.5, -2.0, -0.5, 0.0]
ADVANTAGES = [[a if m else NAN for m in row] for a, row in zip(SEQ_ADVANTAGES, MASK, strict=True)]


def tensors(dtype=torch.float64):
    log_probs = torch.tensor(LOG_PROBS, dtype=dtype, requires_grad=True)
    kwargs = dict(
        old_log_probs=torch.tensor(OLD_LOG_PROBS, dtype=dtype),
        advantages=torch.tensor(ADVANTAGES, dtype=dtype),
        response_mask=torch.tensor(MASK),
    )
    return log_probs, kwargs


def run(loss_fn, dtype=torch.float64, **extra):
    log_probs, kwargs = tensors(dtype)
    out = loss_fn(log_probs=log_probs, **kwargs, **extra)
    out.loss.backward()
    return out, log_probs.grad


def sequence_objective(eps_low, eps_high, mode):
    """The paper's eq. 5 as a loss, on s_i = exp(mean_t(log π_θ − log π_old)) computed with its gradient
    (no stop-gradient trick): max(−A_i·s_i, −A_i·clip(s_i)) for every token of response i, aggregated."""
    log_probs, kwargs = tensors()
    mask = kwargs["response_mask"].bool()
    diff = torch.where(mask, log_probs - kwargs["old_log_probs"], torch.zeros_like(log_probs))
    lengths = mask.sum(-1).clamp(min=1)
    s = torch.exp(diff.sum(-1) / lengths)
    adv = torch.tensor(SEQ_ADVANTAGES, dtype=torch.float64)
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high))
    loss_mat = torch.where(mask, per_seq[:, None].expand_as(diff), torch.zeros_like(diff))
    loss = aggregate(loss_mat, mask, mode)
    loss.backward()
    return loss, log_probs.grad


def test_hand_values_seq_mean_token_mean():
    """pg_clip 0.2, the default seq-mean-token-mean: 3 non-empty responses, token weight 1/(3·|y_i|).

    row 0 (A=1.5):  log-ratios 0.2, −0.4, 0 → s0 = e^(−0.2/3) ≈ 0.935507, inside [0.8, 1.2]:
                    every token −1.5·s0; row mean −1.5·s0 ≈ −1.403261;
                    grad per token −1.5·s0/(3·3) ≈ −0.155918
    row 1 (A=−2):   s1 = e^0.6 ≈ 1.822119 > 1.2; PPO's max keeps the unclipped 2·s1 ≈ 3.644238 (> 2·1.2);
                    grad 2·s1/(3·1) ≈ 1.214746
    row 2 (A=−0.5): log-ratios −0.5, 0 → s2 = e^(−0.25) ≈ 0.778801 < 0.8; max(0.5·s2, 0.5·0.8) = 0.4,
                    the clipped term: grad 0
    row 3: empty, not counted.   loss = (−1.403261 + 3.644238 + 0.4) / 3 ≈ 0.880326
    """
    out, grad = run(GSPO(pg_clip=0.2))
    s0, s1 = math.exp(-0.2 / 3), math.exp(0.6)
    # float64 against python floats: an exp of a ≤ 3-term mean and ≤ 3-term sums per value, in another
    # order: ≲ 10 eps64 (2.2e-16) × values ≤ 3.7 ≈ 1e-14, so 1e-12 leaves 100×; the docstring's literal
    # has 6 decimals (±5e-7: abs=1e-6); the metrics are float64 fractions and exps, a few eps64 off the
    # literals, far inside approx's default rel=1e-6
    assert out.loss.item() == pytest.approx((-1.5 * s0 + 2 * s1 + 0.4) / 3, abs=1e-12)
    assert out.loss.item() == pytest.approx(0.880326, abs=1e-6)
    want = [[-1.5 * s0 / 9] * 3 + [0.0], [2 * s1 / 3, 0.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    torch.testing.assert_close(grad, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    assert out.metrics["pg_clipfrac"] == pytest.approx(2 / 6)  # row 2's two tokens
    assert out.metrics["gspo_seq_ratio_mean"] == pytest.approx((s0 + s1 + math.exp(-0.25)) / 3)
    assert out.metrics["gspo_seq_ratio_high_clipfrac"] == pytest.approx(1 / 3)  # row 1
    assert out.metrics["gspo_seq_ratio_low_clipfrac"] == pytest.approx(1 / 3)  # row 2


def test_paper_clip_range_clips_positive_advantage_above_one_plus_4e_4():
    """Defaults 3e-4 / 4e-4: row 0's s0 ≈ 0.9355 < 1 − 3e-4 with A > 0: max(−1.5·s0, −1.5·0.9997) = −1.5·s0,
    unclipped (PPO clips A > 0 only above); row 1's s1 = e^0.6 with A < 0: unclipped 2·s1; row 2's
    s2 ≈ 0.7788 with A < 0: clipped at 0.9997, loss 0.5·0.9997, no gradient. A response whose ratio
    is e^0.001 > 1.0004 with A = 1 is clipped: loss −1.0004, no gradient."""
    loss_fn = GSPO()
    assert (loss_fn.pg_clip_low, loss_fn.pg_clip_high) == (3e-4, 4e-4)
    out, grad = run(loss_fn)
    s0, s1 = math.exp(-0.2 / 3), math.exp(0.6)
    # float64 hand values: ≲ 10 eps64 × values ≤ 3.7 ≈ 1e-14 ≪ 1e-12 (here and below)
    assert out.loss.item() == pytest.approx((-1.5 * s0 + 2 * s1 + 0.5 * 0.9997) / 3, abs=1e-12)
    assert grad[2].abs().sum().item() == 0.0

    x = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.001, -2.001]], dtype=torch.float64)
    out = GSPO()(log_probs=x, old_log_probs=old, advantages=torch.ones(1, 2), response_mask=torch.ones(1, 2))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0004, abs=1e-12)
    assert torch.equal(x.grad, torch.zeros(1, 2))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.1, 0.3), (3e-4, 4e-4), (0.5, 1.0)])
def test_gradient_is_the_sequence_level_objective_gradient(low, high, mode):
    """With one advantage per response, GSPO-token's loss and gradient equal those of the sequence-level
    objective (paper, eq. 10 vs eq. 7), in every aggregation mode."""
    out, grad = run(GSPO(pg_clip_low=low, pg_clip_high=high, loss_agg_mode=mode))
    want_loss, want_grad = sequence_objective(low, high, mode)
    # float64, the same function computed two ways: ≲ 10 eps64 × values ≤ 3.7 ≈ 1e-14 ≪ 1e-12
    assert out.loss.item() == pytest.approx(want_loss.item(), abs=1e-12)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradcheck_float64(mode):
    """Finite differences of the forward value agree with autograd (away from the clip's kinks): the
    value depends on log π_θ through s_i, whose derivative the stop-gradient construction reproduces."""
    mask = torch.tensor(MASK)
    old = torch.tensor(OLD_LOG_PROBS, dtype=torch.float64)
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)
    loss_fn = GSPO(pg_clip=0.2, loss_agg_mode=mode)

    def loss(log_probs):
        return loss_fn(log_probs=log_probs, old_log_probs=old, advantages=adv, response_mask=mask).loss

    x = torch.tensor(LOG_PROBS, dtype=torch.float64).nan_to_num(0.0).requires_grad_(True)
    # float64 central differences with h = 1e-6: rounding eps64 × |loss| (≤ 4) / h ≈ 1e-9, truncation
    # h² × |f'''| ≈ 1e-11; atol 1e-8 leaves 10× (gradcheck's rtol default 1e-3 adds to it)
    assert torch.autograd.gradcheck(loss, (x,), eps=1e-6, atol=1e-8)


def test_single_token_responses_are_ppo_without_dual_clip():
    """|y_i| = 1: s_i is the token ratio, so GSPO is PPO's clipped surrogate (without dual clip)."""
    lp = [[-0.2], [-1.0], [-0.5]]
    old = torch.tensor([[-0.5], [-0.8], [-0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [2.0]], dtype=torch.float64)
    results = []
    for loss_fn in (
        GSPO(pg_clip=0.2),
        PPO(pg_clip=0.2, dual_clip_loss=False, loss_agg_mode="seq-mean-token-mean"),
    ):
        x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
        out = loss_fn(log_probs=x, old_log_probs=old, advantages=adv, response_mask=torch.ones(3, 1))
        out.loss.backward()
        results.append((out.loss, x.grad))
    # by hand: r = e^0.3 ≈ 1.3499 (A=1, clipped at 1.2: −1.2, grad 0); r = e^−0.2 ≈ 0.8187 (A=−1: 0.8187,
    # grad 0.8187/3); r = 1 (A=2: −2, grad −2/3)
    want = (-1.2 + math.exp(-0.2) - 2.0) / 3
    # float64: a few eps64 × values ≤ 2 ≪ 1e-12 (assert_close's float64 default: rtol 1e-7, atol 1e-7)
    assert results[0][0].item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(
        results[0][1], torch.tensor([[0.0], [math.exp(-0.2) / 3], [-2 / 3]], dtype=torch.float64)
    )
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-12, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-12, rtol=0)


def test_padding_content_never_changes_loss_or_gradient():
    assert_padding_is_ignored(GSPO(pg_clip=0.2), LOG_PROBS, OLD_LOG_PROBS, ADVANTAGES, MASK)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_responses_give_zero_loss_and_gradient(mode):
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = GSPO(loss_agg_mode=mode)(
        log_probs=x,
        old_log_probs=torch.randn(2, 3, dtype=torch.float64),
        advantages=torch.randn(2, 3, dtype=torch.float64),
        response_mask=torch.zeros(2, 3),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros(2, 3, dtype=torch.float64))
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_is_weights_multiply_the_per_token_loss():
    """Rollout-correction weights scale each token's loss (and its gradient) before aggregation: row 0's
    tokens get 0.5, 2, 1 → row mean −1.5·s0·(0.5 + 2 + 1)/3; row 1 gets 0.25; row 2 (clipped) 1, 3."""
    weights = torch.tensor([[0.5, 2.0, 1.0, NAN], [0.25, NAN, NAN, NAN], [1.0, 3.0, NAN, NAN], [NAN] * 4])
    out, grad = run(GSPO(pg_clip=0.2), is_weights=weights.double())
    s0, s1 = math.exp(-0.2 / 3), math.exp(0.6)
    row0 = -1.5 * s0 * (0.5 + 2.0 + 1.0) / 3
    row1 = 2 * s1 * 0.25
    row2 = 0.4 * (1.0 + 3.0) / 2
    # float64 hand values: ≲ 10 eps64 × values ≤ 3.7 ≈ 1e-14 ≪ 1e-12
    assert out.loss.item() == pytest.approx((row0 + row1 + row2) / 3, abs=1e-12)
    assert grad[0, 1].item() == pytest.approx(-1.5 * s0 * 2.0 / 9, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_close_to_float64(dtype):
    want_out, want_grad = run(GSPO(pg_clip=0.2))
    out, grad = run(GSPO(pg_clip=0.2), dtype=dtype)
    # as tests/losses/test_losses.py's test_low_precision_close_to_float64: ~8 roundings of u = eps/2
    # on values ≤ 3.7; float32: 8 × 6e-8 × 3.7 = 1.8e-6 at worst, 1e-5 leaves 5×; bfloat16: one eps of
    # the largest value, 7.8e-3 × 3.7 ≈ 3e-2 (the sequences' errors average out in the mean)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.loss.dtype == dtype
    assert out.loss.item() == pytest.approx(want_out.loss.item(), abs=tol)
    torch.testing.assert_close(grad.double(), want_grad, atol=tol, rtol=0)


def test_short_name_defaults_and_clip_fallbacks():
    loss_fn = POLICY_LOSSES.resolve("gspo")
    assert isinstance(loss_fn, GSPO)
    assert loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert (loss_fn.pg_clip_low, loss_fn.pg_clip_high) == (3e-4, 4e-4)
    assert (GSPO(pg_clip=0.1).pg_clip_low, GSPO(pg_clip=0.1).pg_clip_high) == (0.1, 0.1)
    assert (
        GSPO(pg_clip=0.1, pg_clip_high=0.2).pg_clip_low,
        GSPO(pg_clip=0.1, pg_clip_high=0.2).pg_clip_high,
    ) == (
        0.1,
        0.2,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pg_clip": -0.1}, "pg_clip=-0.1"),
        ({"pg_clip_low": 1.0}, "pg_clip_low=1.0"),
        ({"pg_clip_high": -1e-4}, "pg_clip_high=-0.0001"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode='mean'.*seq-mean-token-mean"),
    ],
)
def test_bad_settings_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GSPO(**kwargs)
