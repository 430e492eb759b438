"""Checks every policy loss must pass, shared by the loss test modules."""

from __future__ import annotations

import torch

NAN = float("nan")


def assert_padding_is_ignored(loss, log_probs, old_log_probs, advantages, mask) -> None:
    """``loss`` gives the same value, gradient and metrics whatever the padded positions (mask 0) hold:
    0, a huge number, infinity or NaN (float64 inputs built from the nested lists given)."""
    pad = ~torch.tensor(mask).bool()
    results = []
    for fill in (0.0, 1e6, float("inf"), NAN):
        filler = torch.full(pad.shape, fill, dtype=torch.float64)
        lp, old, adv = (
            torch.where(pad, filler, torch.tensor(v, dtype=torch.float64))
            for v in (log_probs, old_log_probs, advantages)
        )
        lp.requires_grad_(True)
        out = loss(log_probs=lp, old_log_probs=old, advantages=adv, response_mask=torch.tensor(mask))
        out.loss.backward()
        results.append((out.loss.item(), lp.grad, out.metrics))
    for value, grad, metrics in results[1:]:
        # exact: padding is masked out before any arithmetic, so nothing of it may reach a result
        assert value == results[0][0]
        torch.testing.assert_close(grad, results[0][1], atol=0, rtol=0)
        assert metrics == results[0][2]
