"""LoRA adapters through a fit (``model.init_args.lora``, lit_offpolicy/models/lora.py): only the adapters
train, the engine's copy receives the merged weights at a sync, the export holds merged weights and the
adapter, a resumed run continues with the adapters' state, and the LoRA config fits through the CLI.

Real parts: the built-in tiny Llama, peft, the HF engine, Lightning Trainers on CPU. The merge itself
is tested in tests/models/test_lora.py.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers import CONFIGS
from helpers.cli_runs import RL_STEPS, is_finite_number, read_metrics, rl_callbacks, small_fit_args
from helpers.fits import clone_state, make_data, make_trainer, rollout_options
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import PeftModel

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.cli import main
from lit_offpolicy.models import load_actor
from lit_offpolicy.models.lora import ADAPTER_DIR, LoraOptions, merged_weights
from lit_offpolicy.training.options import KLOptions, OptimOptions

LORA = LoraOptions(r=2, alpha=6.0, target_modules=["q_proj", "v_proj", "down_proj"])  # α / r = 3


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
            # the engine's float32 merge W + (α/r)·B·A (r = 2): ≤ 4 roundings of values ≤ 1, ≤ 2.4e-7
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
    # the resumed run repeats the uninterrupted run's float32 operations on the same inputs (weights,
    # AdamW's moments and the RNG restored exactly): equal to the bit; 1e-6 (≈ 10 ulps of weights ≤ 1)
    # absorbs last bits only. Two more AdamW steps at lr 1e-2 move the adapters by ~1e-2 (> 1e-4).
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
