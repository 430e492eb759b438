"""A tiny random Llama (transformers' own class, 2 layers, a 32-token vocabulary) for engine tests, and
the independent reference its generations are checked against: one unpadded teacher-forced pass."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

EOS = 31
PAD = 0
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6], [9]]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def teacher_forced_log_probs(model, prompt: list[int], response: list[int], temperature: float):
    """Independent reference: one unpadded forward pass over prompt + response."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits.float() / scale, dim=-1)
    return log_probs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def perturbed(model_dir, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A model directory's weights plus seeded noise: stands in for an actor after some training."""
    from lit_offpolicy.models import load_actor

    generator = torch.Generator().manual_seed(seed)
    state = load_actor(model_dir).state_dict()
    return {
        name: t + scale * t.std() * torch.randn(t.shape, generator=generator) for name, t in state.items()
    }


def lora_actor(model_dir, seed: int):
    """The directory's actor with LoRA adapters (r 4, α 8) whose B is seeded noise (peft starts B at 0:
    a merge would change nothing)."""
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.models.lora import LoraOptions, add_lora

    actor = add_lora(load_actor(model_dir), LoraOptions(r=4, alpha=8.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    return actor


def hf_model_with(model_dir, state_dict):
    """The directory's model, frozen, holding ``state_dict``."""
    from lit_offpolicy.models import load_actor

    model = load_actor(model_dir).eval().requires_grad_(False)
    model.load_state_dict(state_dict, strict=True)
    return model
