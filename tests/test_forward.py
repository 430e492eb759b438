"""Teacher-forced passes (lit_offpolicy.forward): the LM head only at the response positions.

Real parts: the built-in tiny Llama (float64, so that the two paths agree to rounding) and batches of
prompts of different lengths (left padding) with responses of different lengths (right padding).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_offpolicy.experience import Experience
from lit_offpolicy.forward import policy_log_probs, position_ids, response_logits
from lit_offpolicy.models import load_actor
from lit_offpolicy.rollout.engine import Generation


class WithoutLogitsToKeep(nn.Module):
    """The same model behind a forward that has no ``logits_to_keep``: every position comes back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    return load_actor(tiny_model_dir, dtype=torch.float64).eval()


def _experience(response_lengths: list[int]) -> Experience:
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    generator = torch.Generator().manual_seed(0)
    groups = []
    for i in range(len(prompts)):
        length = response_lengths[i]
        tokens = torch.randint(3, 100, (length,), generator=generator).tolist()
        groups.append([Generation(tokens, [-1.0] * length, "length")])
    return Experience.from_generations(
        prompts, groups, [0.0] * len(prompts), pad_token_id=0, policy_version=0
    )


def _every_position_then_slice(model: nn.Module, exp: Experience) -> torch.Tensor:
    """The reference: logits at every position, then those predicting response tokens P − 1 … P + R − 2."""
    mask = exp.attention_mask
    logits = model(
        input_ids=exp.input_ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False
    ).logits
    prompt_len, response_len = exp.prompt_ids.shape[1], exp.response_ids.shape[1]
    return logits[:, prompt_len - 1 : prompt_len + response_len - 1]


@torch.no_grad()
def test_response_logits_are_those_of_the_full_pass(actor):
    exp = _experience([4, 1, 3])
    kept = response_logits(actor, exp)
    assert kept.shape == (3, 4, 100)
    torch.testing.assert_close(kept, _every_position_then_slice(actor, exp), rtol=0, atol=1e-12)


@torch.no_grad()
def test_a_model_without_logits_to_keep_is_sliced(actor):
    exp = _experience([2, 5, 1])
    wrapped = WithoutLogitsToKeep(actor)
    torch.testing.assert_close(response_logits(wrapped, exp), response_logits(actor, exp), rtol=0, atol=1e-12)


def test_log_probs_entropy_and_gradient_match_the_full_pass(actor):
    """The training path: log-probs, entropy and the gradient of a loss through both."""
    exp = _experience([3, 2, 4])
    losses = []
    for model in (actor, WithoutLogitsToKeep(actor)):
        actor.zero_grad()
        log_probs, entropy = policy_log_probs(model, exp, temperature=0.7, with_entropy=True)
        loss = (log_probs * exp.response_mask).sum() + (entropy * exp.response_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in actor.parameters() if p.grad is not None])
        losses.append((log_probs.detach(), entropy.detach(), grads))
    (lp, ent, grad), (lp_ref, ent_ref, grad_ref) = losses
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-10)
    assert grad.abs().max() > 0
    actor.zero_grad()


@torch.no_grad()
def test_empty_responses_give_no_positions(actor):
    exp = _experience([0, 0, 0])
    assert exp.response_ids.shape == (3, 0)
    assert response_logits(actor, exp).shape == (3, 0, 100)
    assert response_logits(WithoutLogitsToKeep(actor), exp).shape == (3, 0, 100)
