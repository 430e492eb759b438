"""Passes with a gradient run without cuDNN's attention (lit_offpolicy.core.attention)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from benchmarks.common import fit_on_fixed_experience, fixed_experience
from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GRPO
from lit_offpolicy.core.attention import without_cudnn_attention
from lit_offpolicy.losses import PPO
from lit_offpolicy.models import load_tokenizer


@pytest.fixture
def cudnn_attention_on():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_is_off_inside_and_back_after_also_on_an_exception(cudnn_attention_on):
    with without_cudnn_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ValueError), without_cudnn_attention():
        raise ValueError
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    with without_cudnn_attention():
        pass
    assert not torch.backends.cuda.cudnn_sdp_enabled(), "a setting that was off stays off"


def test_the_update_s_gradient_passes_run_without_cudnn_attention(tiny_model_dir, cudnn_attention_on):
    """The actor's forwards with a gradient (the update) see cuDNN's attention off; the setting is back
    after the step."""
    module = OffPolicyModule(tiny_model_dir, policy_loss=PPO(pg_clip=0.2), advantage=GRPO())
    seen: list[tuple[bool, bool]] = []
    module.actor.register_forward_pre_hook(
        lambda *_: seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
    )
    exp = fixed_experience(load_tokenizer(tiny_model_dir), num_prompts=2, group_size=2, response_length=6)
    with tempfile.TemporaryDirectory() as root:
        fit_on_fixed_experience(module, exp, 1, [], root)
    assert {cudnn for grad, cudnn in seen if grad} == {False}
    assert torch.backends.cuda.cudnn_sdp_enabled()
