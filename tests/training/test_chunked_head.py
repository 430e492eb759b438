"""``chunked_head``: the LM head's log-probs and entropy by chunks, with its own backward.

Checked against autograd through the whole logits (float64, so the two agree to rounding), against
finite differences (``gradcheck``), at chunk sizes that divide N, do not, and exceed it, for N = 0 and 1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_offpolicy.training import chunked_head

F64 = torch.float64
N, H, V = 7, 5, 11


def _inputs(n: int = N, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(H, V, bias=bias, dtype=F64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=F64))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g, dtype=F64))
    hidden = torch.randn(n, H, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, V, (n,), generator=g)
    return head, hidden, tokens


def _reference(head, hidden, tokens, scale, with_entropy):
    """The whole (N, V) logits through autograd: log_softmax(z)[y] and −Σ softmax(z) log_softmax(z)."""
    log_softmax = torch.log_softmax(head(hidden) / scale, dim=-1)
    log_probs = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return log_probs
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.stack((log_probs, entropy), dim=-1)


def _values_and_gradients(fn, head, hidden, upstream):
    head.zero_grad()
    hidden.grad = None
    out = fn()
    (out * upstream).sum().backward()
    grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if head.bias is not None else [])
    return out.detach(), [g.clone() for g in grads]


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [N, 1])
def test_values_and_gradients_equal_autograd_through_the_whole_logits(with_entropy, chunk_size, bias, n):
    """Temperature 0.7, random upstream gradients for log π and H: the same values and the same
    gradients w.r.t. hidden states, weight and bias. float64 over V = 11 terms: rounding ≈ 1e-15."""
    head, hidden, tokens = _inputs(n, bias)
    upstream = torch.randn(
        (n, 2) if with_entropy else (n,), generator=torch.Generator().manual_seed(1), dtype=F64
    )

    def ours():
        return chunked_head.head_statistics(head, hidden, tokens, 0.7, chunk_size, with_entropy)

    def theirs():
        return _reference(head, hidden, tokens, 0.7, with_entropy)

    got, got_grads = _values_and_gradients(ours, head, hidden, upstream)
    want, want_grads = _values_and_gradients(theirs, head, hidden, upstream)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for ours_grad, their_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(ours_grad, their_grad, rtol=0, atol=1e-12)
        assert their_grad.abs().max() > 0


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradients_match_finite_differences(with_entropy):
    """``torch.autograd.gradcheck`` (central differences, float64) w.r.t. hidden, weight and bias."""
    head, hidden, tokens = _inputs()
    weight = head.weight.detach().clone().requires_grad_(True)
    bias = head.bias.detach().clone().requires_grad_(True)

    def fn(hidden, weight, bias):
        return chunked_head._HeadStatistics.apply(hidden, weight, bias, tokens, 1.3, 3, with_entropy)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_no_positions_give_an_empty_result_and_zero_gradients():
    head, hidden, tokens = _inputs(0)
    out = chunked_head.head_statistics(head, hidden, tokens, 1.0, 4, True)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert head.weight.grad.abs().max() == 0 and hidden.grad.shape == (0, H)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    """LoRA leaves the head frozen: no weight gradient is formed, the hidden states' is autograd's."""
    head, hidden, tokens = _inputs()
    head.requires_grad_(False)
    chunked_head.head_statistics(head, hidden, tokens, 1.0, 3, False).sum().backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    _reference(head, hidden, tokens, 1.0, False).sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(ours, hidden.grad, rtol=0, atol=1e-12)


def test_applies_to_a_plain_linear_head_outside_autocast_only():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    assert chunked_head.applies(nn.Linear(2, 3))
    assert not chunked_head.applies(Scaled(2, 3))
    assert not chunked_head.applies(nn.Sequential(nn.Linear(2, 3)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not chunked_head.applies(nn.Linear(2, 3))
