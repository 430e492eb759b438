"""KL estimators, KL controllers, value loss and entropy against hand-computed values."""

import math

import pytest
import torch

from lit_offpolicy.losses import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    kl_controller,
    kl_penalty,
    value_loss,
)

LP = torch.tensor([[-1.0, -0.2], [-3.0, -0.5]], dtype=torch.float64, requires_grad=True)
REF = torch.tensor([[-1.5, -0.2], [-1.0, -0.1]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "value", "grad"),
    [
        ("kl", lambda d: d, lambda d: 1.0),
        ("k1", lambda d: d, lambda d: 1.0),
        ("abs", lambda d: abs(d), lambda d: math.copysign(1.0, d) if d else 0.0),
        ("mse", lambda d: 0.5 * d * d, lambda d: d),
        ("k2", lambda d: 0.5 * d * d, lambda d: d),
        ("low_var_kl", lambda d: math.exp(-d) + d - 1, lambda d: 1 - math.exp(-d)),
        ("k3", lambda d: math.exp(-d) + d - 1, lambda d: 1 - math.exp(-d)),
    ],
)
def test_sampled_token_estimators(kind, value, grad):
    LP.grad = None
    out = kl_penalty(LP, REF, kind)
    out.sum().backward()
    diffs = (LP - REF).detach()
    want = diffs.clone().apply_(value)
    # float64, one exp or product of |d| ≤ 2: a few eps64 (2.2e-16) × e^2 ≈ 1e-14 ≪ 1e-12
    torch.testing.assert_close(out.detach(), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(LP.grad, diffs.clone().apply_(grad), atol=1e-12, rtol=0)


def test_low_var_kl_is_clamped_to_ten():
    out = kl_penalty(torch.tensor([-30.0, 0.0]), torch.tensor([0.0, 30.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]


def test_full_kl_from_distributions():
    p = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    want = sum(pi * math.log(pi / qi) for pi, qi in zip(p[0].tolist(), q[0].tolist(), strict=True))
    out = kl_penalty(p.log(), q.log(), "full")
    assert out.shape == (1,)
    # float64, a 3-term sum of p·log(p/q) ≤ 0.3 in another order: ≲ 10 eps64 ≪ 1e-12
    assert out.item() == pytest.approx(want, abs=1e-12)
    assert kl_penalty(p.log(), p.log(), "full").item() == 0.0


def test_unknown_kind_lists_the_choices():
    with pytest.raises(ValueError, match="kind='k4'.*'kl', 'abs', 'mse', 'low_var_kl', 'full'"):
        kl_penalty(LP, REF, "k4")


def test_adaptive_controller_follows_ziegler():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, kl_horizon=100)
    ctl.update(current_kl=0.15, n_steps=10)  # error = 0.5 → clipped to 0.2
    # python floats, a few products: a few eps64 relative ≪ approx's default rel=1e-6
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=0.09, n_steps=10)  # error = -0.1
    assert ctl.value == pytest.approx(0.2 * 1.02 * (1 - 0.1 * 10 / 100))
    restored = AdaptiveKLController(0.2, 0.1, 100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_fixed_controller_and_factory():
    fixed = kl_controller(init_kl_coef=0.05)
    assert isinstance(fixed, FixedKLController) and not isinstance(fixed, AdaptiveKLController)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.05
    assert isinstance(kl_controller(0.2, target_kl=0.1, kl_horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl=0"):
        kl_controller(0.2, target_kl=0)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        FixedKLController(-1)


def test_value_loss_with_and_without_clip():
    values = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 2.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask)
    # float64, ≤ 2-term means of squares: a few eps64 relative ≪ the defaults (approx rel=1e-6,
    # assert_close's float64 rtol 1e-7, atol 1e-7); the zero gradient is exact
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    # clip 0.2: V_clip = [0.7, 2.3]; errors unclipped [1, 0], clipped [1.69, 0.09] → both clipped larger
    loss, metrics = value_loss(values, old, returns, mask, value_clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert metrics["vf_clipfrac"] == 1.0
    # the clipped branch is constant in V outside the clip range: no gradient flows
    torch.testing.assert_close(values.grad, torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="value_clip=0"):
        value_loss(values, old, returns, mask, value_clip=0)


def test_entropy_of_uniform_and_peaked():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32
    # float32 (the bf16 logits are exact): a 4-term softmax and Σ p·log p of terms ≤ log 4: ≲ 4 eps32
    # (1.2e-7) × 1.4 ≈ 7e-7 < 1e-6
    assert h[0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert h[1].item() == pytest.approx(0.0, abs=1e-6)
