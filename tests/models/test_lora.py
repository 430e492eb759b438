"""LoRA adapters on the actor (``model.init_args.lora``, lit_offpolicy/models/lora.py).

Real parts: the built-in tiny Llama and peft. The merge is checked against hand-computed values and
against peft's own ``merge_and_unload``; the options refuse bad values by name; the reference is the
base model; gradient checkpointing and log-prob chunks leave the LoRA update as it is. The fits (the
adapters train, the engine receives the merged weights, export, resume, the CLI) are in
tests/integration/test_lora_fit.py.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from helpers.experiences import fixed_experience
from helpers.tolerances import reordered_sums

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.callbacks.export import export_hf
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.models import TINY_ARCHS, create_tiny_model, load_actor, load_tokenizer
from lit_offpolicy.models.lora import LoraOptions, add_lora, merge_lora, merged_weights
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.options import KLOptions, LossOptions

LORA = LoraOptions(r=2, alpha=6.0, target_modules=["q_proj", "v_proj", "down_proj"])  # α / r = 3


# ----------------------------------------------------------------------------- the merge


def test_merge_is_the_base_weight_plus_scaled_b_times_a():
    """W' = W + (α/r) B A on a 2 × 3 layer of rank 1, by hand; bias and other tensors pass through,
    peft's prefixes and the adapter entries are gone."""
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    lora_a = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64)  # r × in
    lora_b = torch.tensor([[2.0], [0.5]], dtype=torch.float64)  # out × r
    bias, norm = torch.tensor([0.1, 0.2], dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    layer = "base_model.model.model.layers.0.mlp.down_proj"
    state = {
        f"{layer}.base_layer.weight": weight,
        f"{layer}.base_layer.bias": bias,
        f"{layer}.lora_A.default.weight": lora_a,
        f"{layer}.lora_B.default.weight": lora_b,
        "base_model.model.model.norm.weight": norm,
    }
    merged = merge_lora(state, scaling=1.5)
    # B A = [[2, 0, -2], [0.5, 0, -0.5]]; × 1.5 = [[3, 0, -3], [0.75, 0, -0.75]]
    expected = torch.tensor([[4.0, 2.0, 0.0], [4.75, 5.0, 5.25]], dtype=torch.float64)
    assert merged.keys() == {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.bias"} | {
        "model.norm.weight"
    }
    assert torch.equal(merged["model.layers.0.mlp.down_proj.weight"], expected)
    assert merged["model.layers.0.mlp.down_proj.bias"] is bias and merged["model.norm.weight"] is norm
    assert torch.equal(weight, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64))


def with_random_adapters(model, seed: int = 0, scale: float = 0.1):
    """LoRA on ``model`` with every B drawn too (peft starts B at 0, which would make every merge a no-op)."""
    lora_model = add_lora(model, LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in lora_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))
    return lora_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_merged_weights_are_peft_merge_and_unload_in_every_family(arch, tmp_path):
    """Llama, Qwen2 (q/k/v biases, tied embeddings), Qwen3 (q/k norms, tied), Mistral, in float64: the
    merged state dict is peft's ``merge_and_unload`` and has the base model's names; the export of
    the adapted model loads as a plain model with the adapted model's logits."""
    model_dir = create_tiny_model(tmp_path / arch, arch=arch)
    lora_model = with_random_adapters(load_actor(model_dir).double())
    theirs = copy.deepcopy(lora_model).merge_and_unload().state_dict()
    ours = merged_weights(lora_model, lora_model.state_dict())
    assert ours.keys() == theirs.keys() == load_actor(model_dir).state_dict().keys()
    for name, tensor in theirs.items():  # float64 W + (α/r)·B·A, r = 2: ≤ 4 roundings of values ≤ 1, 9e-16
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-15, msg=name)
    export_hf(lora_model, load_tokenizer(model_dir), tmp_path / "export")
    exported = load_actor(tmp_path / "export", dtype=torch.float64)
    tokens = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (exported(input_ids=tokens).logits - lora_model(input_ids=tokens).logits).abs().max()
    # float64, W·x against W₀·x + (α/r)·B·(A·x): sums of ≤ 512 terms grouped otherwise in each block:
    # 2 × 4 × eps64 × √512 × |logits| ≤ 2 ≈ 8e-14 ≪ 1e-10, which also leaves room for the RMSNorms'
    # float32 output rounding to flip (tests/training/test_packing.py's note)
    assert gap < 1e-10, gap


# ----------------------------------------------------------------------------- bad options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"r": 0}, r"lora.r=0 is not a rank; allowed values: an integer ≥ 1"),
        ({"r": -4}, r"lora.r=-4 is not a rank"),
        ({"r": 2.5}, r"lora.r=2.5 is not a rank"),
        ({"alpha": 0.0}, r"lora.alpha=0.0 is out of range; allowed values: \(0.0, inf\]"),
        ({"dropout": 1.0}, r"lora.dropout=1.0 is out of range; allowed values: \[0.0, 1.0\)"),
        ({"target_modules": "q_proj"}, r"lora.target_modules='q_proj' is not supported; allowed"),
        ({"target_modules": []}, r"lora.target_modules=\[\] is not supported"),
    ],
)
def test_bad_options_name_the_option_and_what_is_allowed(options, message):
    with pytest.raises(ValueError, match=message):
        LoraOptions(**options)


@pytest.mark.parametrize("name", ["qproj", "lm_head"])
def test_a_layer_that_is_not_an_adaptable_linear_is_refused_with_the_choices(tiny_model_dir, name):
    with pytest.raises(ValueError) as error:
        add_lora(load_actor(tiny_model_dir), LoraOptions(target_modules=["q_proj", name]))
    assert str(error.value) == (
        f"lora.target_modules=['q_proj', '{name}'] names {name}, not a linear layer of LlamaForCausalLM "
        "(the LM head excluded); allowed values: 'all-linear' or names among down_proj, gate_proj, "
        "k_proj, o_proj, q_proj, up_proj, v_proj"
    )


def test_all_linear_adapts_every_linear_layer_but_the_head(tiny_model_dir):
    lora_model = add_lora(load_actor(tiny_model_dir), LoraOptions())
    adapted = {name.split(".")[-4] for name, p in lora_model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not lora_model.get_output_embeddings().weight.requires_grad


# ----------------------------------------------------------------------------- the reference


def test_reference_is_the_base_model_and_no_second_copy(tiny_model_dir):
    """With a KL term the reference log-probs are the base model's, from the actor with its adapters
    disabled; the module holds one set of base weights (actor only, no reference module)."""
    module = OffPolicyModule(model_path=tiny_model_dir, lora=LORA, kl=KLOptions(use_loss=True))
    with torch.no_grad():
        for name, parameter in module.actor.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    assert module.reference is None and module.reference_is_base
    base = load_actor(tiny_model_dir)
    assert sum(p.numel() for p in module.parameters() if not p.requires_grad) == sum(
        p.numel() for p in base.parameters()
    )
    exp = fixed_experience(tiny_model_dir)
    module.prepare(exp)
    expected = frozen_log_probs(base, exp, exp.temperature, len(exp), module.logprob_chunk_size)
    # float32, the same passes on the same base weights (peft's disabled adapters add nothing): equal
    # but for BLAS blocking, ≤ 2 × 4 × eps32 × √512 × max|lp| (≈ 1e-4 here, against the adapters' > 1e-3)
    atol, mask = reordered_sums(expected, terms=512, stages=4), exp.response_mask.bool()
    torch.testing.assert_close(exp.ref_log_probs[mask], expected[mask], rtol=0, atol=atol)  # 0 at padding
    adapted = frozen_log_probs(module.actor, exp, exp.temperature, len(exp), module.logprob_chunk_size)
    assert (adapted - expected)[exp.response_mask.bool()].abs().max() > 1e-3, "the adapters change the policy"


def test_another_reference_directory_is_loaded_and_no_kl_needs_no_reference(tiny_model_dir, tmp_path):
    other = create_tiny_model(tmp_path / "other", seed=1)
    module = OffPolicyModule(model_path=tiny_model_dir, lora=LORA, reference_path=str(other))
    assert module.reference is not None and not module.reference_is_base
    exp = fixed_experience(tiny_model_dir)
    module.prepare(exp)
    expected = frozen_log_probs(load_actor(other), exp, exp.temperature, len(exp), module.logprob_chunk_size)
    # float32, the same passes on the same weights: as in the test above
    atol, mask = reordered_sums(expected, terms=512, stages=4), exp.response_mask.bool()
    torch.testing.assert_close(exp.ref_log_probs[mask], expected[mask], rtol=0, atol=atol)
    without_kl = OffPolicyModule(model_path=tiny_model_dir, lora=LORA)
    assert without_kl.reference is None and not without_kl.reference_is_base
    exp = fixed_experience(tiny_model_dir)
    without_kl.prepare(exp)
    assert exp.ref_log_probs is None


# ----------------------------------------------------------------------------- with the memory options


def _lora_update(model_dir: str, gradient_checkpointing: bool, chunk: int | None) -> tuple:
    """One update's loss (KL to the adapter-disabled reference, entropy bonus) and the adapters'
    gradients, in float64, with every B drawn so that the adapters' forward is not a no-op."""
    L.seed_everything(0, verbose=False)  # peft draws A from the global RNG
    module = OffPolicyModule(
        model_path=model_dir,
        lora=LORA,
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        loss=LossOptions(entropy_coef=0.01),
        gradient_checkpointing=gradient_checkpointing,
        logprob_chunk_size=chunk,
    ).double()
    with torch.no_grad():
        for name, parameter in module.actor.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    exp = fixed_experience(model_dir)
    module.prepare(exp, OldLogProbs.UPDATE)
    loss, _, _ = module.micro_batch_loss(exp, old_from_update=True)
    loss.backward()
    grads = {name: p.grad for name, p in module.actor.named_parameters() if p.grad is not None}
    return loss.detach(), exp.ref_log_probs, grads


def test_checkpointing_and_chunks_give_the_plain_lora_loss_and_gradients(tiny_model_dir):
    plain_loss, plain_ref, plain_grads = _lora_update(tiny_model_dir, False, None)
    loss, ref, grads = _lora_update(tiny_model_dir, True, 5)
    assert grads.keys() == plain_grads.keys() == {n for n in grads if ".lora_" in n} and grads
    # float64, as tests/training/test_memory.py: ≲ 4e-14 × the largest value (≲ 100) ≪ 1e-10
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-10)
    torch.testing.assert_close(ref, plain_ref, rtol=0, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=1e-10, msg=name)
    assert max(grad.abs().max() for grad in plain_grads.values()) > 0
