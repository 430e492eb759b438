"""compile=True (training/compiling.py) through real Trainer fits: compiled steps train the eager run's
weights, and generating with the actor afterwards (the sync HF engine) runs eagerly.

Real parts: the tiny Llama, a real Trainer fit with the Rollout callback (HF engine), and torch.compile
with its default backend (inductor, which builds C++ kernels on the CPU).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.fits import clone_state, make_data, make_rollout, make_trainer

from lit_offpolicy.losses import PPO
from lit_offpolicy.models import load_actor, load_tokenizer
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.rollout import HFEngine, SamplingParams
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


def test_compiled_steps_train_the_same_weights_as_eager(eager_and_compiled, tiny_model_dir):
    eager, compiled = eager_and_compiled
    assert compiled.compiled is not None and eager.compiled is None
    assert compiled.policy_version == eager.policy_version == 2
    start = load_actor(tiny_model_dir).state_dict()
    eager_state, compiled_state = clone_state(eager.actor), clone_state(compiled.actor)
    moved = max((value - start[name]).abs().max().item() for name, value in eager_state.items())
    assert moved > 1e-3  # 4 AdamW steps at lr 1e-3
    gaps = torch.cat([(compiled_state[name] - value).abs().flatten() for name, value in eager_state.items()])
    # The gradients agree to float32 rounding (tests/training/test_compiling.py), but AdamW divides
    # each by its own running size: an element whose gradient is within rounding of 0 can move by up
    # to Adam's largest step, lr·(1 − β1)/√(1 − β2) = 3.16·lr (Kingma & Ba, §2.1), in either direction,
    # in each of the 4 steps: no gap beyond 2 × 4 × 3.16 × lr = 2.5e-2. Elsewhere an update moves by
    # ≈ lr·δ/|g| for a gradient difference δ ≲ 2.2e-5·S (S: the tensor's largest gradient), so a gap of
    # lr/10 = 1e-4 over 4 steps needs |g| ≲ 40δ ≈ 1e-3·S at some step: about 1e-3 of the weights if
    # gradients spread evenly near 0 (measured: none above 4.3e-5 of 1,075,328), while a broken
    # compiled step moves most weights by ~lr. Adam's scale invariance makes a fit blind to small
    # gradient errors: the unit test checks those.
    assert gaps.max().item() <= 2 * 4 * 3.16 * 1e-3
    assert (gaps > 1e-4).float().mean().item() < 1e-3, int((gaps > 1e-4).sum())


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
