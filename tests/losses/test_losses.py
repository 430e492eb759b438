"""Policy losses against per-token values and gradients worked out by hand in plain Python.

The batch: three responses of lengths 3, 1 and 2 plus an empty one, right-padded with NaN so that
any leak of padding shows. Ratios are chosen to hit every branch: unclipped, clipped high, clipped
low, dual clip.
"""

import math

import pytest
import torch
from helpers.loss_checks import assert_padding_is_ignored

from lit_offpolicy.losses import CISPO, LOSS_AGG_MODES, PPO, TIS, TOPR, Kimi15, Vanilla, aggregate

NAN = float("nan")
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
LOG_PROBS = [[-1.0, -0.5, -2.0, NAN], [-0.3, NAN, NAN, NAN], [-1.1, -0.7, NAN, NAN], [NAN] * 4]
OLD_LOG_PROBS = [[-1.2, -0.1, -2.0, NAN], [-0.9, NAN, NAN, NAN], [-0.6, -0.7, NAN, NAN], [NAN] * 4]
ADVANTAGES = [[1.5, 1.5, 1.5, NAN], [-2.0, NAN, NAN, NAN], [-0.5, -0.5, NAN, NAN], [NAN] * 4]
SCORES = [1.0, 0.0, -1.0, 0.0]
T = 4


def valid_tokens():
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if m:
                yield i, t


def token_weight(i, mode):
    """d(aggregate)/d(L_it) for a valid token of row i: the aggregation's per-token coefficient."""
    lengths = [sum(row) for row in MASK]
    num_tokens, num_seqs = sum(lengths), sum(1 for n in lengths if n)
    return {
        "token-mean": 1 / num_tokens,
        "seq-mean-token-sum": 1 / num_seqs,
        "seq-mean-token-mean": 1 / (num_seqs * lengths[i]),
        "seq-mean-token-sum-norm": 1 / T,
    }[mode]


def expected(token_fn, mode):
    """Loss and d loss / d log_probs from a per-token function returning (loss, dloss/dlogp)."""
    loss, grad = 0.0, [[0.0] * T for _ in MASK]
    for i, t in valid_tokens():
        lp, old, adv = LOG_PROBS[i][t], OLD_LOG_PROBS[i][t], ADVANTAGES[i][t]
        value, dvalue = token_fn(lp, old, adv, SCORES[i])
        loss += token_weight(i, mode) * value
        grad[i][t] = token_weight(i, mode) * dvalue
    return loss, grad


def run(loss_fn, dtype=torch.float64, **extra):
    log_probs = torch.tensor(LOG_PROBS, dtype=dtype, requires_grad=True)
    out = loss_fn(
        log_probs=log_probs,
        old_log_probs=torch.tensor(OLD_LOG_PROBS, dtype=dtype),
        advantages=torch.tensor(ADVANTAGES, dtype=dtype),
        response_mask=torch.tensor(MASK),
        scores=torch.tensor(SCORES, dtype=dtype),
        **extra,
    )
    out.loss.backward()
    return out, log_probs.grad


def ppo_token(clip_low, clip_high, dual_c):
    def fn(lp, old, adv, score):
        r = math.exp(lp - old)
        unclipped, clipped = -adv * r, -adv * min(max(r, 1 - clip_low), 1 + clip_high)
        value, dvalue = (unclipped, -adv * r) if unclipped >= clipped else (clipped, 0.0)
        if dual_c is not None and adv < 0 and value > -dual_c * adv:
            value, dvalue = -dual_c * adv, 0.0
        return value, dvalue

    return fn


def vanilla_token(lp, old, adv, score):
    return -adv * lp, -adv


def tis_token(lo, hi):
    def fn(lp, old, adv, score):
        w = min(max(math.exp(lp - old), lo), hi)
        return -w * adv * lp, -w * adv

    return fn


def topr_token(w_pos, w_neg):
    def fn(lp, old, adv, score):
        w = w_pos if score > 0 else w_neg * min(max(math.exp(lp - old), 0.0), 1.0)
        return -w * adv * lp, -w * adv

    return fn


def cispo_token(eps_low, eps_high, unified):
    def fn(lp, old, adv, score):
        r = math.exp(lp - old)
        if unified and ((adv > 0 and r > 1 + eps_high) or (adv < 0 and r < 1 - eps_low)):
            return 0.0, 0.0
        w = min(max(r, 1 - eps_low), 1 + eps_high)
        return -w * adv * lp, -w * adv

    return fn


def kimi_token(tau):
    def fn(lp, old, adv, score):
        return -adv * lp + tau / 2 * (lp - old) ** 2, -adv + tau * (lp - old)

    return fn


CASES = [
    ("ppo", lambda m: PPO(loss_agg_mode=m), ppo_token(0.2, 0.2, 1.4)),
    ("ppo-no-dual", lambda m: PPO(dual_clip_loss=False, loss_agg_mode=m), ppo_token(0.2, 0.2, None)),
    ("ppo-asym-verl-c", lambda m: PPO(0.2, 0.1, 0.3, True, 3.0, loss_agg_mode=m), ppo_token(0.1, 0.3, 3.0)),
    ("vanilla", lambda m: Vanilla(loss_agg_mode=m), vanilla_token),
    ("tis", lambda m: TIS(loss_agg_mode=m), tis_token(0.0, 1.0)),
    ("tis-bounds", lambda m: TIS(0.8, 1.1, loss_agg_mode=m), tis_token(0.8, 1.1)),
    ("topr", lambda m: TOPR(loss_agg_mode=m), topr_token(1.0, 1.0)),
    ("topr-weights", lambda m: TOPR(0.5, 2.0, loss_agg_mode=m), topr_token(0.5, 2.0)),
    ("cispo", lambda m: CISPO(loss_agg_mode=m), cispo_token(0.1, 0.1, False)),
    ("cispo-unified", lambda m: CISPO(0.2, 0.15, True, loss_agg_mode=m), cispo_token(0.2, 0.15, True)),
    ("kimi15", lambda m: Kimi15(loss_agg_mode=m), kimi_token(0.1)),
    ("kimi15-tau", lambda m: Kimi15(tau=0.7, loss_agg_mode=m), kimi_token(0.7)),
]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("name", "make", "token_fn"), CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradient_match_hand_computation(name, make, token_fn, mode):
    out, grad = run(make(mode))
    want_loss, want_grad = expected(token_fn, mode)
    # float64 against python floats: one exp and ≤ 6-term sums per value, in another order: ≲ 10 eps64
    # (2.2e-16) × values ≤ 3.6 ≈ 1e-14, so 1e-12 leaves 100×
    assert out.loss.item() == pytest.approx(want_loss, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12, rtol=0)
    assert math.isfinite(out.metrics["pg_loss"])


def test_hand_values_of_the_ppo_example():
    """Literal numbers for the PPO case, token-mean over the 6 valid tokens, c = 1 + 2·0.2 = 1.4.

    row 0 (A=1.5): r = e^0.2 → clipped at 1.2: −1.8; r = e^−0.4 ≈ 0.6703: −1.5·0.6703; r = 1: −1.5
    row 1 (A=−2): r = e^0.6 ≈ 1.8221 → 3.6442, dual clip bounds it at 1.4·2 = 2.8
    row 2 (A=−0.5): r = e^−0.5 ≈ 0.6065 → clipped at 0.8: 0.4; r = 1: 0.5
    """
    out, _ = run(PPO())
    want = (-1.8 - 1.5 * math.exp(-0.4) - 1.5 + 2.8 + 0.4 + 0.5) / 6
    # float64: as above, ≲ 1e-14 (abs=1e-12); the metrics are float64 counts and an exp, within a few
    # eps64 of the literals: approx's default rel=1e-6 is far from binding
    assert out.loss.item() == pytest.approx(want, abs=1e-12)
    assert out.metrics["ppo_ratio_high_clipfrac"] == pytest.approx(2 / 6)  # e^0.2 and e^0.6
    assert out.metrics["ppo_ratio_low_clipfrac"] == pytest.approx(2 / 6)  # e^-0.4 and e^-0.5
    # the clipped term is the larger for e^0.2 (A > 0) and e^-0.5 (A < 0); for A < 0, r = e^0.6 PPO's
    # max keeps the unclipped term, which only the dual clip bounds
    assert out.metrics["pg_clipfrac"] == pytest.approx(2 / 6)
    assert out.metrics["dual_clipfrac"] == pytest.approx(1 / 6)
    assert out.metrics["ratio_max"] == pytest.approx(math.exp(0.6))
    assert out.metrics["ratio_min"] == pytest.approx(math.exp(-0.5))


def test_on_policy_ppo_gradient_equals_vanilla_gradient():
    """At r = 1 no clip is active and ∇(−A·r) = −A·∇log π, the REINFORCE gradient."""
    lp = torch.tensor(LOG_PROBS, dtype=torch.float64)
    args = dict(old_log_probs=lp, advantages=torch.tensor(ADVANTAGES, dtype=torch.float64))
    grads = []
    for loss_fn in (PPO(), Vanilla(), TIS(upper_bound=2.0), CISPO(), Kimi15()):
        x = lp.clone().requires_grad_(True)
        loss_fn(log_probs=x, response_mask=torch.tensor(MASK), **args).loss.backward()
        grads.append(x.grad)
    for grad in grads[1:]:  # float64, at r = 1 each is −A·weight: a few eps64 × |A| ≤ 2 ≪ 1e-12
        torch.testing.assert_close(grad, grads[0], atol=1e-12, rtol=0)


def test_is_weights_multiply_the_per_token_loss():
    weights = torch.tensor([[0.5, 2.0, 1.0, NAN], [0.25, NAN, NAN, NAN], [1.0, 3.0, NAN, NAN], [NAN] * 4])
    out, grad = run(Vanilla(), is_weights=weights.double())
    loss = 0.0
    for i, t in valid_tokens():
        loss += weights[i, t].item() * -ADVANTAGES[i][t] * LOG_PROBS[i][t] / 6
    # float64, a 6-term sum of products ≤ 3 in another order: ≲ 10 eps64 × 3 ≪ 1e-12 (and ≪ approx's
    # default rel=1e-6 for the dyadic gradient)
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    assert grad[0, 1].item() == pytest.approx(-2.0 * 1.5 / 6)


def test_padding_content_never_changes_loss_or_gradient():
    assert_padding_is_ignored(PPO(), LOG_PROBS, OLD_LOG_PROBS, ADVANTAGES, MASK)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_empty_batch_gives_zero_loss_and_zero_gradient(mode):
    x = torch.randn(2, 3, requires_grad=True)
    out = PPO(loss_agg_mode=mode)(
        log_probs=x,
        old_log_probs=torch.randn(2, 3),
        advantages=torch.randn(2, 3),
        response_mask=torch.zeros(2, 3),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros(2, 3))
    assert "ratio_max" not in out.metrics


def test_single_token_responses():
    x = torch.tensor([[-0.2], [-1.0]], requires_grad=True)
    out = Vanilla(loss_agg_mode="seq-mean-token-mean")(
        log_probs=x,
        old_log_probs=x.detach(),
        advantages=torch.tensor([[1.0], [-1.0]]),
        response_mask=torch.ones(2, 1),
    )
    out.loss.backward()
    # float32, the defaults (approx rel 1e-6; assert_close rtol 1.3e-6, atol 1e-5): −0.2 rounded once
    # (6e-8 relative), a 2-term mean: ≤ 2 eps32 (1.2e-7) relative; the gradient ±1/2 is exact
    assert out.loss.item() == pytest.approx((0.2 - 1.0) / 2)
    torch.testing.assert_close(x.grad, torch.tensor([[-0.5], [0.5]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "make", "token_fn"), CASES, ids=[c[0] for c in CASES])
def test_low_precision_close_to_float64(name, make, token_fn, dtype):
    out, grad = run(make("token-mean"), dtype=dtype)
    want_loss, want_grad = expected(token_fn, "token-mean")
    # Each token's value (|v| ≤ 3.6) passes ~8 roundings of u = eps/2: its inputs, lp − old, exp, the
    # clip, × A, the 6-token mean. float32 (u = 6e-8): ≤ 8u × 3.6 = 1.7e-6 even when all add up; 1e-5
    # leaves 6×. bfloat16 (eps 7.8e-3): one eps of the largest value, 7.8e-3 × 3.6 = 2.8e-2 → 3e-2: the
    # per-token errors, of either sign, average out in the mean (measured: 3e-3); each op is computed
    # in float32 and rounded once, so another CPU changes a result by at most a rounding flip.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.loss.dtype == dtype
    assert out.loss.item() == pytest.approx(want_loss, abs=tol)
    torch.testing.assert_close(grad.double(), torch.tensor(want_grad, dtype=torch.float64), atol=tol, rtol=0)


def test_aggregate_modes_by_hand():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # float32 sums of ≤ 4 small integers are exact; the quotients round once: rel ≤ 6e-8 ≪ approx's 1e-6
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / 3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PPO(loss_agg_mode="mean"), "loss_agg_mode='mean'.*token-mean"),
        (lambda: PPO(pg_clip=-0.1), "pg_clip=-0.1"),
        (lambda: PPO(pg_clip_low=1.5), "pg_clip_low=1.5"),
        (lambda: PPO(pg_clip_high=-1.0), "pg_clip_high=-1.0"),
        (lambda: PPO(dual_clip_c=0.9), "dual_clip_c=0.9"),
        (lambda: TIS(lower_bound=-1.0), "lower_bound=-1.0"),
        (lambda: TIS(lower_bound=0.5, upper_bound=0.5), "upper_bound=0.5"),
        (lambda: TOPR(negative_weight=-1.0), "negative_weight=-1.0"),
        (lambda: CISPO(epsilon_low=1.0), "epsilon_low=1.0"),
        (lambda: Kimi15(tau=float("nan")), "tau=nan"),
    ],
)
def test_bad_settings_name_the_option(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_topr_without_scores_is_a_clear_error():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="TOPR needs scores"):
        TOPR()(log_probs=x, old_log_probs=x, advantages=x, response_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"scores must have shape \(2,\)"):
        TOPR()(
            log_probs=x, old_log_probs=x, advantages=x, response_mask=torch.ones(2, 3), scores=torch.ones(3)
        )


def test_mismatched_shapes_are_a_clear_error():
    with pytest.raises(ValueError, match="shapes must match"):
        Vanilla()(
            log_probs=torch.zeros(2, 3),
            old_log_probs=torch.zeros(2, 3),
            advantages=torch.zeros(2, 4),
            response_mask=torch.ones(2, 3),
        )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_weights_reproduce_the_mini_batch_aggregate(mode):
    from lit_offpolicy.losses import micro_batch_weight

    loss_mat = torch.arange(20, dtype=torch.float64).reshape(5, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    whole = aggregate(loss_mat, mask, mode)
    parts = [(loss_mat[:2], mask[:2]), (loss_mat[2:3], mask[2:3]), (loss_mat[3:], mask[3:])]
    accumulated = sum(micro_batch_weight(m, mask, mode) * aggregate(x, m, mode) for x, m in parts)
    # float64, ≤ 20-term sums of integers ≤ 19 regrouped: ≲ 20 eps64 × 19 ≈ 1e-13
    assert accumulated.item() == pytest.approx(whole.item(), abs=1e-12)
