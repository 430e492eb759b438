"""LoRA adapters on the actor (``model.init_args.lora``, lit_offpolicy/models/lora.py).

Real parts: the built-in tiny Llama, peft, the HF engine, Lightning Trainers on CPU. The merge is
checked against hand-computed values and against peft's own ``merge_and_unload``; a fit checks that
only the adapters train, that the reference is the base model, that the engine's copy receives the
merged weights at a sync, that the export holds merged weights and the adapter, and that a resumed
run continues with the adapters' state.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import PeftModel
from test_configs import CONFIGS, RL_STEPS, is_finite_number, read_metrics, rl_callbacks, small_fit_args
from test_trainer import clone_state, fixed_experience, make_data, make_trainer, rollout_options

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.callbacks.export import export_hf
from lit_offpolicy.cli import main
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.models import TINY_ARCHS, create_tiny_model, load_actor, load_tokenizer
from lit_offpolicy.models.lora import ADAPTER_DIR, LoraOptions, add_lora, merge_lora, merged_weights
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.options import KLOptions, LossOptions, OptimOptions

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
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-15, msg=name)
    export_hf(lora_model, load_tokenizer(model_dir), tmp_path / "export")
    exported = load_actor(tmp_path / "export", dtype=torch.float64)
    tokens = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (exported(input_ids=tokens).logits - lora_model(input_ids=tokens).logits).abs().max()
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
    torch.testing.assert_close(exp.ref_log_probs, expected, rtol=0, atol=1e-6)
    adapted = frozen_log_probs(module.actor, exp, exp.temperature, len(exp), module.logprob_chunk_size)
    assert (adapted - expected)[exp.response_mask.bool()].abs().max() > 1e-3, "the adapters change the policy"


def test_another_reference_directory_is_loaded_and_no_kl_needs_no_reference(tiny_model_dir, tmp_path):
    other = create_tiny_model(tmp_path / "other", seed=1)
    module = OffPolicyModule(model_path=tiny_model_dir, lora=LORA, reference_path=str(other))
    assert module.reference is not None and not module.reference_is_base
    exp = fixed_experience(tiny_model_dir)
    module.prepare(exp)
    expected = frozen_log_probs(load_actor(other), exp, exp.temperature, len(exp), module.logprob_chunk_size)
    torch.testing.assert_close(exp.ref_log_probs, expected, rtol=0, atol=1e-6)
    without_kl = OffPolicyModule(model_path=tiny_model_dir, lora=LORA)
    assert without_kl.reference is None and not without_kl.reference_is_base
    exp = fixed_experience(tiny_model_dir)
    without_kl.prepare(exp)
    assert exp.ref_log_probs is None


# ----------------------------------------------------------------------------- a fit with LoRA


class RecordSync(L.Callback):
    """After the Rollout callback: the base weights at the start; at the end of step ``at`` (a sync
    step), the engine's weights, the actor's adapters and whether any adapter is merged."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_start(self, trainer, pl_module):
        self.initial = clone_state(pl_module.actor)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.policy_version == self.at:
            engine = next(c for c in trainer.callbacks if isinstance(c, callbacks.Rollout)).worker.engine
            self.engine_type = type(engine.model)
            self.engine = clone_state(engine.model)
            self.actor = clone_state(pl_module.actor)
            self.merged = [m.merged for m in pl_module.actor.modules() if hasattr(m, "merged_adapters")]


def lora_fit(model_dir: str, root, max_steps: int, extra: list = (), ckpt_path: str | None = None, **kwargs):
    """GRPO + KL loss with LoRA; the engine holds its own copy, synced every 2 steps."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=model_dir, lora=LORA, kl=KLOptions(use_loss=True), optim=OptimOptions(lr=1e-2)
    )
    trainer = make_trainer(
        [callbacks.Rollout(**rollout_options(sync_every=2)), *extra],
        max_steps=max_steps,
        default_root_dir=root,
        **kwargs,
    )
    trainer.fit(module, datamodule=make_data(model_dir), ckpt_path=ckpt_path)
    return SimpleNamespace(module=module, trainer=trainer)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    record = RecordSync(at=2)
    run = lora_fit(tiny_model_dir, root, 4, [record, callbacks.HFExport(dirpath=str(root / "actor"))])
    return SimpleNamespace(**vars(run), record=record, export=root / "actor", root=root)


def adapters(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if ".lora_" in name}


def test_only_the_adapters_train_and_reach_the_optimizer(lora_run):
    actor = lora_run.module.actor
    lora_parameters = {id(p) for name, p in actor.named_parameters() if ".lora_" in name}
    assert {id(p) for name, p in actor.named_parameters() if p.requires_grad} == lora_parameters
    optimized = [p for group in lora_run.trainer.optimizers[0].param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == lora_parameters and len(optimized) == len(lora_parameters)
    final = actor.state_dict()
    for name, tensor in lora_run.record.initial.items():
        if ".lora_" not in name:
            assert torch.equal(final[name], tensor), f"base weight {name} changed"
    trained_b = [t for name, t in adapters(final).items() if "lora_B" in name]
    assert all(t.abs().max() > 1e-4 for t in trained_b), "peft starts B at 0: every B has moved"


def test_the_engine_receives_the_merged_weights_and_the_actor_keeps_its_adapters(lora_run, tiny_model_dir):
    """After the sync at step 2 the engine's own copy (a plain Llama) holds W + (α/r) B A, computed
    here in float64 from the actor's adapters at that step; the actor's adapters stay unmerged and
    its base weights untouched."""
    record = lora_run.record
    assert record.engine_type.__name__ == "LlamaForCausalLM"
    assert record.merged and not any(record.merged), "the actor's adapters were merged in place"
    base = load_actor(tiny_model_dir).state_dict()
    assert record.engine.keys() == base.keys()
    prefix = "base_model.model."
    for name, tensor in base.items():
        layer = name.removesuffix(".weight")
        if layer.rsplit(".", 1)[-1] in LORA.target_modules:
            lora_a = record.actor[f"{prefix}{layer}.lora_A.default.weight"].double()
            lora_b = record.actor[f"{prefix}{layer}.lora_B.default.weight"].double()
            expected = tensor.double() + LORA.alpha / LORA.r * lora_b @ lora_a
            assert (expected - tensor.double()).abs().max() > 1e-4, name
            torch.testing.assert_close(record.engine[name].double(), expected, rtol=0, atol=1e-6, msg=name)
            assert torch.equal(record.actor[f"{prefix}{layer}.base_layer.weight"], tensor), name
        else:
            assert torch.equal(record.engine[name], tensor), name


def test_the_export_is_the_merged_model_and_the_adapter(lora_run, tiny_model_dir):
    actor = lora_run.module.actor
    exported = load_actor(lora_run.export)  # a plain Hugging Face directory: no peft involved
    expected = merged_weights(actor, actor.state_dict())
    assert exported.state_dict().keys() == expected.keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (lora_run.export / ADAPTER_DIR).iterdir()
    }
    reloaded = PeftModel.from_pretrained(load_actor(tiny_model_dir), lora_run.export / ADAPTER_DIR)
    ours = adapters(actor.state_dict())
    assert adapters(reloaded.state_dict()).keys() == ours.keys()
    for name, tensor in adapters(reloaded.state_dict()).items():
        assert torch.equal(tensor, ours[name]), name


def test_a_resumed_run_continues_with_the_adapters_state(lora_run, tiny_model_dir):
    """2 steps, a checkpoint, a fresh module and Trainer resuming to step 4: the adapters (and with
    them AdamW's moments and the sampling) continue as the uninterrupted run's."""
    directory = lora_run.root / "checkpoints"
    saving = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1)
    first = lora_fit(tiny_model_dir, lora_run.root, 2, [saving], enable_checkpointing=True)
    resumed = lora_fit(tiny_model_dir, lora_run.root, 4, ckpt_path=str(directory / "last.ckpt"))
    assert resumed.trainer.global_step == 4 and resumed.module.policy_version == 4
    whole = lora_run.module.actor.state_dict()
    ours = resumed.module.actor.state_dict()
    assert ours.keys() == whole.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
    after_two = adapters(first.module.actor.state_dict())
    assert any(not torch.allclose(whole[name], t, atol=1e-4) for name, t in after_two.items())


# ----------------------------------------------------------------------------- through the CLI


@pytest.fixture
def cli_argv(monkeypatch):
    """``main(args)`` runs in-process: pytest's own arguments must not look like CLI arguments."""
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])


def test_grpo_with_the_lora_config_fits_through_the_cli(cli_argv, tiny_model_dir, tmp_path):
    """``fit --config configs/grpo.yaml --config configs/lora.yaml``, 3 steps on the tiny model (the HF
    engine samples from the LoRA actor in place): finite metrics, a gradient, the merged export with
    its adapter, and a checkpoint that ``load_from_checkpoint`` rebuilds with the same adapters."""
    args = small_fit_args("grpo", tiny_model_dir, tmp_path, RL_STEPS, rl_callbacks(tmp_path))
    main([*args, "--config", str(CONFIGS / "lora.yaml")])

    rows = [row for row in read_metrics(tmp_path / "logs") if row.get("actor/pg_loss")]
    assert [float(row["actor/policy_version"]) for row in rows] == [1.0, 2.0, 3.0]
    assert all(is_finite_number(value) for row in rows for value in row.values() if value)
    assert any(float(row["actor/grad_norm"]) > 0 for row in rows)
    assert (tmp_path / "actor" / "model.safetensors").is_file()
    assert (tmp_path / "actor" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    restored = OffPolicyModule.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert restored.lora == LoraOptions(r=16, alpha=32.0, target_modules="all-linear")
    exported = PeftModel.from_pretrained(load_actor(tiny_model_dir), tmp_path / "actor" / ADAPTER_DIR)
    saved = adapters(exported.state_dict())
    for name, tensor in adapters(restored.actor.state_dict()).items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("r", "0", "lora.r=0 is not a rank; allowed values: an integer ≥ 1"),
        ("target_modules", "[q_proj, qproj]", "lora.target_modules=['q_proj', 'qproj'] names qproj, not a"),
    ],
)
def test_a_bad_lora_option_ends_the_cli_with_one_line(
    cli_argv, tiny_model_dir, capsys, option, value, message
):
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(CONFIGS / "lora.yaml")]
    args += ["--model.init_args.model_path", tiny_model_dir, f"--model.init_args.lora.{option}", value]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    (line,) = [line for line in errors if line.startswith("lit-offpolicy: error")]
    assert line.startswith(f"lit-offpolicy: error: {message}")


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
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-10)
    torch.testing.assert_close(ref, plain_ref, rtol=0, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=1e-10, msg=name)
    assert max(grad.abs().max() for grad in plain_grads.values()) > 0
