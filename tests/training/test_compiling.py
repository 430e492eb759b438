"""compile=True (training/compiling.py): the training step's transformer blocks compiled, nothing else.

Real parts: the tiny Llama and torch.compile with its default backend (inductor, which builds C++
kernels on the CPU). The fits with compile=True are in tests/integration/test_compiling_fit.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.experiences import experience
from helpers.tolerances import reordered_sums

from lit_offpolicy.models import load_actor
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.training.compiling import CompiledBlocks, transformer_blocks
from lit_offpolicy.training.forward import policy_log_probs


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
    # Inductor fuses the blocks and reorders their float32 sums: equal to rounding, not to the bit.
    # helpers.tolerances: the longest sums are the MLP's K = 512 (hidden 128, vocab 100 and ≤ 16
    # positions are shorter), in each of the 4 blocks in series, on both paths: 2 × 4 × eps32 × √512 =
    # 2.2e-5 of a tensor's largest magnitude (measured: ≤ 1.2e-6). Per tensor, not per element: an entry
    # that cancels to ~0 (an embedding row's gradient) keeps an error of its terms' size, which an
    # elementwise rtol misses (1 entry of 12,800 was 2.6e-6 off against the former atol 1e-6).
    for log_probs, grads in others:
        atol = reordered_sums(eager_log_probs, terms=512, stages=4)
        torch.testing.assert_close(log_probs, eager_log_probs, rtol=0, atol=atol)
        for name, grad in grads.items():
            atol = reordered_sums(eager_grads[name], terms=512, stages=4)
            torch.testing.assert_close(grad, eager_grads[name], rtol=0, atol=atol, msg=name)


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
