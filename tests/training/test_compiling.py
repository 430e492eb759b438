"""compile=True (training/compiling.py): the training step's transformer blocks compiled, nothing else.

Real parts: the tiny Llama, a real Trainer fit with the Rollout callback (HF engine), and torch.compile
with its default backend (inductor, which builds C++ kernels on the CPU).
"""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from test_packing import experience
from test_trainer import clone_state, make_data, make_rollout, make_trainer

from lit_offpolicy.losses import PPO
from lit_offpolicy.models import load_actor, load_tokenizer
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.rollout import HFEngine, SamplingParams
from lit_offpolicy.training.compiling import CompiledBlocks, transformer_blocks
from lit_offpolicy.training.forward import policy_log_probs
from lit_offpolicy.training.options import KLOptions, OptimOptions, UpdateOptions


def fit(model_dir: str, compile: bool, steps: int = 2) -> OffPolicyModule:
    """``steps`` RL steps of PPO + KL loss, two mini-batches a step (π_old recomputed, a reference pass)."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=model_dir,
        policy_loss=PPO(),
        advantage="grpo",
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        update=UpdateOptions(mini_batch_size=8, micro_batch_size=4),
        optim=OptimOptions(lr=1e-3),
        compile=compile,
    )
    make_trainer([make_rollout()], max_steps=2 * steps).fit(module, datamodule=make_data(model_dir))
    return module


@pytest.fixture(scope="module")
def eager_and_compiled(tiny_model_dir):
    return fit(tiny_model_dir, compile=False), fit(tiny_model_dir, compile=True)


@pytest.mark.parametrize("padding_free", [False, True])
def test_compiled_blocks_give_the_eager_log_probs_and_gradients(tiny_model_dir, padding_free):
    """Padded, and packed (the per-sample attention runs eagerly between the compiled parts)."""
    model, exp = load_actor(tiny_model_dir), experience(response_lengths=(4, 0, 1, 6, 3, 5))
    compiled = CompiledBlocks(model)
    results = []
    for context in (contextlib.nullcontext(), compiled.active(), compiled.active()):  # compile, then reuse
        model.zero_grad()
        with context:
            log_probs, entropy = policy_log_probs(
                model, exp, 1.0, with_entropy=True, chunk_size=4, padding_free=padding_free
            )
            ((log_probs + 0.1 * entropy) * exp.response_mask).sum().backward()
        results.append((log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (eager_log_probs, eager_grads), *others = results
    for log_probs, grads in others:  # inductor reorders float32 sums: equal to rounding, not to the bit
        torch.testing.assert_close(log_probs, eager_log_probs, rtol=1e-5, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6)


def test_compiled_steps_train_the_same_weights_as_eager(eager_and_compiled, tiny_model_dir):
    eager, compiled = eager_and_compiled
    assert compiled.compiled is not None and eager.compiled is None
    assert compiled.policy_version == eager.policy_version == 2
    start = load_actor(tiny_model_dir).state_dict()
    moved = max((value - start[name]).abs().max().item() for name, value in eager.actor.state_dict().items())
    assert moved > 1e-3  # 4 AdamW steps at lr 1e-3: far beyond the tolerance below
    for name, value in clone_state(eager.actor).items():
        # AdamW turns a rounding difference in a near-zero gradient into up to lr per step
        torch.testing.assert_close(clone_state(compiled.actor)[name], value, rtol=0, atol=2e-4)


def test_generation_after_a_compiled_step_runs_eagerly(eager_and_compiled, tiny_model_dir):
    """Generating with the actor itself (the sync HF engine) outside the step compiles nothing: under
    ``fail_on_recompile`` a compiled block would raise at the decoder's first new shape."""
    _, compiled = eager_and_compiled
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = HFEngine(compiled.actor, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
    reference = load_actor(tiny_model_dir)
    reference.load_state_dict(compiled.actor.state_dict())
    plain = HFEngine(reference, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(n=2, max_tokens=6, temperature=0.0)
    with torch.compiler.set_stance("fail_on_recompile"):
        generated = engine.generate(prompts, params)
    expected = plain.generate(prompts, params)
    assert [[g.token_ids for g in group] for group in generated] == [
        [g.token_ids for g in group] for group in expected
    ]


def test_blocks_are_compiled_only_inside_the_context(tiny_model_dir):
    model = load_actor(tiny_model_dir)
    compiled = CompiledBlocks(model, None)
    assert compiled.blocks == transformer_blocks(model)
    assert len(compiled.blocks) == model.config.num_hidden_layers >= 2
    with compiled.active():
        assert all(block._compiled_call_impl is not None for block in compiled.blocks)
    assert all(block._compiled_call_impl is None for block in compiled.blocks)


def test_a_model_without_transformer_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match=r"compile=True found no transformer block.*: False"):
        CompiledBlocks(torch.nn.Linear(2, 2))


def test_compile_must_be_a_boolean(tiny_model_dir):
    with pytest.raises(ValueError, match="compile"):
        OffPolicyModule(model_path=tiny_model_dir, compile="yes")
