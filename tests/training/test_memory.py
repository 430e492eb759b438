"""The memory options of OffPolicyModule: ``gradient_checkpointing`` and ``logprob_chunk_size``.

Real parts: the built-in tiny Llama as actor and as critic backbone, cast to float64 after loading so
that the variants agree to rounding, and the fixed experience of tests/helpers/experiences.py.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers.experiences import fixed_experience

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GAE
from lit_offpolicy.core.memory import process_peak_rss_bytes, step_peak_memory
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.training.options import LossOptions


def _module(model_dir: str, gradient_checkpointing: bool, chunk: int | None) -> OffPolicyModule:
    """PPO + GAE with a critic and an entropy bonus, in float64; the critic's new value head is
    drawn from the seeded global RNG, so every variant starts from the same weights."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=model_dir,
        critic_path=model_dir,
        advantage=GAE(),
        loss=LossOptions(entropy_coef=0.01),
        gradient_checkpointing=gradient_checkpointing,
        logprob_chunk_size=chunk,
    )
    return module.double()


def _one_update(module: OffPolicyModule, model_dir: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare, then the update's loss of the whole batch with π_old read off its forward
    (``OldLogProbs.UPDATE``), its backward; return the loss, π_old and every parameter's gradient."""
    exp = fixed_experience(model_dir)
    module.prepare(exp, OldLogProbs.UPDATE)
    actor_loss, critic_loss, _ = module.micro_batch_loss(exp, old_from_update=True)
    loss = actor_loss + 0.5 * critic_loss
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
    return loss.detach(), exp.old_log_probs, grads


@pytest.fixture(scope="module")
def plain_update(tiny_model_dir):
    return _one_update(_module(tiny_model_dir, False, None), tiny_model_dir)


@pytest.mark.parametrize(("checkpointing", "chunk"), [(True, None), (False, 5), (True, 5)])
def test_checkpointing_and_chunks_give_the_plain_loss_and_gradients(
    tiny_model_dir, plain_update, checkpointing, chunk
):
    """One update step (actor with entropy, critic, π_old from the update's forward): the same loss,
    π_old and gradients of actor and critic as without either option."""
    ours = _one_update(_module(tiny_model_dir, checkpointing, chunk), tiny_model_dir)
    # float64: recomputed activations repeat the same sums; chunks regroup the LM head's and the
    # gradient's sums (≤ 512 terms, 4 blocks, both paths): 2 × 4 × eps64 × √512 × S ≈ 4e-14·S, S the
    # largest loss, log-prob or gradient entry (≲ 100): 1e-10 (the RMSNorms' float32 output rounding
    # flips only for values within ~1e-15 of a float32 boundary, as tests/training/test_packing.py notes)
    for mine, theirs in zip(ours, plain_update, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    assert plain_update[2].abs().max() > 0


def _saved_bytes(module: OffPolicyModule, model_dir: str) -> int:
    """Bytes that autograd keeps for the backward of one training forward of actor and critic."""
    exp = fixed_experience(model_dir)
    module.prepare(exp)
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module.micro_batch_loss(exp)
    return total


def test_checkpointing_keeps_fewer_activations(tiny_model_dir):
    """With checkpointing the forward keeps each block's input only (parameters are counted on both
    sides, so the gap is the blocks' inner activations)."""
    kept = _saved_bytes(_module(tiny_model_dir, True, None), tiny_model_dir)
    plain = _saved_bytes(_module(tiny_model_dir, False, None), tiny_model_dir)
    assert kept < 0.5 * plain


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "64"])
def test_a_bad_chunk_size_is_refused_by_name(tiny_model_dir, chunk):
    with pytest.raises(ValueError, match=r"logprob_chunk_size=.* allowed values: an integer ≥ 1"):
        OffPolicyModule(model_path=tiny_model_dir, logprob_chunk_size=chunk)


def test_step_peak_memory_reports_the_peak_since_the_last_call():
    """``perf/peak_rss`` (GiB) holds a 512 MiB block freed before the reading, and the next reading,
    after the reset, no longer does."""
    cpu = torch.device("cpu")
    step_peak_memory(cpu)
    block = bytearray(b"\x01") * (512 * 2**20)  # written, so resident
    del block
    with_block = step_peak_memory(cpu)
    without_block = step_peak_memory(cpu)
    assert with_block["perf/peak_rss_resets"] == without_block["perf/peak_rss_resets"] == 1.0
    assert with_block["perf/peak_rss"] - without_block["perf/peak_rss"] > 0.45
    # the process's own peak still holds the block: resets never lose it
    assert process_peak_rss_bytes() / 2**30 >= with_block["perf/peak_rss"] > without_block["perf/peak_rss"]
    assert "perf/max_memory_allocated" not in with_block  # CUDA only
