"""Model FLOPs and MFU (``core.flops``), against counts made by hand for a tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.flops import (
    ModelFlops,
    measured_peak_flops,
    peak_flops,
    rl_stage_metrics,
    sequence_lengths,
    stage_metrics,
)


def tiny_llama() -> LlamaForCausalLM:
    """hidden 8, 2 layers, 2 query heads of 4 and 1 key-value head, MLP 16, vocabulary 10, untied."""
    config = LlamaConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_the_counts_are_the_weights_of_each_matrix_product():
    # per layer: q 8x8, k 4x8, v 4x8, o 8x8, gate 16x8, up 16x8, down 8x16 = 64+32+32+64+128+128+128
    assert ModelFlops.of(tiny_llama()) == ModelFlops(
        body_params=2 * 576, head_params=10 * 8, layers=2, attention_width=8
    )


def test_weights_partitioned_by_zero3_count_their_full_size():
    """ZeRO-3 leaves each rank an empty tensor with the full size in ``ds_numel``."""
    model = tiny_llama()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            full = module.weight.numel()
            module.weight = torch.nn.Parameter(torch.empty(0))
            module.weight.ds_numel = full
    assert ModelFlops.of(model) == ModelFlops.of(tiny_llama())


def test_a_forward_counts_the_body_on_every_token_the_head_on_responses_and_causal_attention():
    flops = ModelFlops.of(tiny_llama())
    # P=3, R=2 (T=5): 2·1152·5 + 2·80·2 + 2·2·8·5·6 = 11520 + 320 + 960
    # P=1, R=0 (T=1): 2·1152·1 + 0 + 2·2·8·1·2 = 2304 + 64
    assert flops.forward([3, 1], [2, 0]) == 12800 + 2368
    assert flops.forward([], []) == 0


def test_a_stage_s_mfu_is_its_model_flops_per_second_over_the_peak():
    model = tiny_llama()
    peak = peak_flops(torch.device("cpu"), torch.float32)
    metrics = stage_metrics("update", [(model, 3), (model, 0)], ([3, 1], [2, 0]), seconds=2.0)
    assert metrics == {
        "perf/tokens_per_s/update": 6 / 2.0,
        "perf/mfu/update": 3 * 15168 / 2.0 / peak,
    }
    assert stage_metrics("frozen", [], ([3], [2]), seconds=1.0) == {}  # no forward ran (bypass mode)


def experience(prompt_mask, response_mask) -> Experience:
    """Samples with these masks (everything else zeros): only their lengths matter here."""
    prompt_mask, response_mask = torch.tensor(prompt_mask), torch.tensor(response_mask)
    samples = len(prompt_mask)
    return Experience(
        prompt_ids=torch.zeros_like(prompt_mask),
        prompt_mask=prompt_mask,
        response_ids=torch.zeros_like(response_mask),
        response_mask=response_mask,
        rollout_log_probs=torch.zeros(response_mask.shape),
        scores=torch.zeros(samples),
        group_ids=torch.arange(samples),
        policy_versions=torch.zeros(samples, dtype=torch.long),
    )


def test_an_rl_step_s_update_is_three_forwards_per_epoch_of_each_trained_model():
    model = tiny_llama()
    exp = experience([[0, 1, 1, 1], [0, 0, 0, 1]], [[1, 1, 0], [0, 0, 0]])  # P = [3, 1], R = [2, 0]
    lengths = ([3, 1], [2, 0])
    metrics = rl_stage_metrics(
        exp, ([(model, 1)], 0.5, None), (model, None), 2, update_seconds=2.0, share=0.5
    )
    assert metrics == (
        {"timing/frozen": 0.5}
        | stage_metrics("frozen", [(model, 1)], lengths, 0.5, share=0.5)
        | stage_metrics("update", [(model, 6)], lengths, 2.0, share=0.5)
    )
    peak = peak_flops(torch.device("cpu"), torch.float32)
    assert metrics["perf/mfu/update"] == 6 * 15168 * 0.5 / 2.0 / peak  # 2 epochs of 3 forwards, critic None


def test_a_prompt_shared_by_two_samples_is_counted_once():
    """Shared-prefix rows: a prompt of 3 tokens with responses of 2 and 1 is one row [P r1 r2] of 6 tokens
    where r_i attends to P and itself: 6 + (2·3 + 3) + (1·3 + 1) = 19 query-key pairs, the LM head on
    the 3 response tokens; the samples' 9 tokens, of which 3 were not computed again."""
    model = tiny_llama()
    counted = ModelFlops.of(model)
    exp = experience([[1, 1, 1], [1, 1, 1]], [[1, 1], [1, 0]])
    metrics = rl_stage_metrics(exp, ([(model, 1)], 1.0, [3]), (None,), 1, update_seconds=1.0)
    peak = peak_flops(torch.device("cpu"), torch.float32)
    pairs = 6 + (2 * 3 + 3) + (1 * 3 + 1)
    flops = (
        2 * counted.body_params * 6
        + 2 * counted.head_params * 3
        + 4 * counted.layers * counted.attention_width * pairs
    )
    assert metrics["perf/mfu/frozen"] == pytest.approx(flops / peak, rel=1e-12)
    assert metrics["perf/tokens_per_s/frozen"] == 9.0  # the samples' tokens, as without sharing
    assert metrics["perf/shared_prefix_saving"] == 3 / 9
    # on, but the model ran per-sample rows: 0; off (None): not logged (the test above)
    nothing_shared = rl_stage_metrics(exp, ([(model, 1)], 1.0, []), (None,), 1, update_seconds=1.0)
    assert nothing_shared["perf/shared_prefix_saving"] == 0.0


def test_lengths_are_read_from_the_masks_of_every_experience():
    first = experience([[0, 1, 1], [1, 1, 1]], [[1, 1, 0], [1, 0, 0]])
    second = experience([[0, 0, 1]], [[0, 0, 0]])
    assert sequence_lengths(first, second) == ([2, 3, 1], [2, 1, 0])


def test_a_cuda_device_s_peak_comes_from_its_data_sheet(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(cuda, torch.bfloat16) == 756.0e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cuda, torch.bfloat16) == 989.4e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(cuda, torch.float32) == 19.5e12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_peak_is_measured_by_a_matrix_product(dtype):
    peak = measured_peak_flops("cpu", dtype, size=128)
    assert math.isfinite(peak) and peak > 1e6  # a core does far more than a megaFLOP per second
