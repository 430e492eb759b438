"""``model.init_args.attn_implementation``, Lightning's ``trainer.precision`` and the per-step memory
metrics (``perf/*``), through the ``lit-offpolicy`` CLI on the CPU with the tiny models.

The fits run configs/grpo.yaml (its KL term loads a reference too) for two steps; a callback given by
class_path records what the step really ran with: each model's attention kernel, the actor's parameter
dtype, and the dtype of an activation inside the training forward (autocast or not).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import CONFIGS
from helpers.cli_runs import class_path, fit_fails_with_one_line, read_metrics, rl_callbacks, small_fit_args
from helpers.experiences import fixed_experience
from helpers.tolerances import reordered_sums

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.cli import main
from lit_offpolicy.models import create_tiny_model, load_actor
from lit_offpolicy.training.forward import policy_log_probs
from lit_offpolicy.training.shared_prefix import shared_row

STEPS = 2


class RecordTraining(L.Callback):
    """Writes to ``path``: the attention kernel of actor and reference, the actor's parameter dtype and
    the output dtype of the actor's first MLP projection in training forwards (grad enabled)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.activation_dtypes: set[str] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        def record(module, inputs, output) -> None:
            if torch.is_grad_enabled():
                self.activation_dtypes.add(str(output.dtype))

        layer = pl_module.actor.model.layers[0]
        layer.mlp.down_proj.register_forward_hook(record)

    def on_train_end(self, trainer, pl_module) -> None:
        models = {"actor": pl_module.actor, "reference": pl_module.reference}
        record = {
            "attention": {name: model.config._attn_implementation for name, model in models.items()},
            "param_dtype": str(next(pl_module.actor.parameters()).dtype),
            "activation_dtypes": sorted(self.activation_dtypes),
        }
        Path(self.path).write_text(json.dumps(record))


@pytest.fixture(autouse=True)
def cli_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])


def fit(model_dir: str, out: Path, *overrides: str) -> tuple[dict, list[dict]]:
    """Two GRPO steps of configs/grpo.yaml with ``overrides``: (the recorded facts, the metric rows)."""
    callbacks = rl_callbacks(out)
    callbacks.append({"class_path": class_path(RecordTraining), "init_args": {"path": str(out / "rec.json")}})
    main([*small_fit_args("grpo", model_dir, out, STEPS, callbacks), *overrides])
    rows = [row for row in read_metrics(out / "logs") if row.get("actor/pg_loss")]
    return json.loads((out / "rec.json").read_text()), rows


@pytest.mark.parametrize(
    ("attention", "precision", "param_dtype", "activation_dtype"),
    [
        ("eager", "32-true", "torch.float32", "torch.float32"),
        ("sdpa", "bf16-mixed", "torch.float32", "torch.bfloat16"),  # float32 weights, bf16 autocast
        ("sdpa", "bf16-true", "torch.bfloat16", "torch.bfloat16"),  # weights (and AdamW state) in bf16
    ],
)
def test_attention_and_precision_train_through_the_cli(
    tiny_model_dir, tmp_path, attention, precision, param_dtype, activation_dtype
):
    recorded, rows = fit(
        tiny_model_dir,
        tmp_path,
        "--model.init_args.attn_implementation",
        attention,
        "--trainer.precision",
        precision,
    )
    assert recorded["attention"] == {"actor": attention, "reference": attention}
    assert recorded["param_dtype"] == param_dtype
    assert recorded["activation_dtypes"] == [activation_dtype]
    assert [int(row["step"]) for row in rows] == list(range(STEPS))
    for row in rows:
        assert torch.isfinite(torch.tensor(float(row["actor/pg_loss"])))
        assert float(row["actor/grad_norm"]) > 0


def test_peak_rss_is_logged_every_step_and_reset(tiny_model_dir, tmp_path):
    """``perf/peak_rss`` (GiB) each step, between the RSS of a Python process with torch and the
    machine's memory; the reset through /proc/self/clear_refs worked (``perf/peak_rss_resets`` 1)."""
    _, rows = fit(tiny_model_dir, tmp_path)
    total_gib = _machine_memory_gib()
    for row in rows:
        assert 0.1 < float(row["perf/peak_rss"]) < total_gib
        assert float(row["perf/peak_rss_resets"]) == 1.0
        assert "perf/max_memory_allocated" not in row or not row["perf/max_memory_allocated"]


def test_each_stage_s_throughput_and_mfu_are_logged_every_step(tiny_model_dir, tmp_path):
    """grpo.yaml's step: generation, the frozen passes (π_old recomputed, the reference) and the update,
    each with ``perf/tokens_per_s/<stage>`` and ``perf/mfu/<stage>`` in (0, 1]: every stage runs
    fewer FLOPs than the measured peak allows in its seconds (formulas: tests/core/test_flops.py)."""
    _, rows = fit(tiny_model_dir, tmp_path)
    for row in rows:
        for stage in ("generate", "frozen", "update"):
            assert float(row[f"perf/tokens_per_s/{stage}"]) > 0
            assert 0 < float(row[f"perf/mfu/{stage}"]) <= 1


def _machine_memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    raise KeyError("MemTotal")


@pytest.mark.parametrize("value", ["bogus", "flash_attention_2"])
def test_bad_attn_implementation_fails_with_one_line(tiny_model_dir, value, capsys):
    if value == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            pytest.skip("flash-attn is installed here")
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", tiny_model_dir]
    line = fit_fails_with_one_line([*args, "--model.init_args.attn_implementation", value], capsys)
    assert f"attn_implementation={value!r}" in line and "'eager', 'sdpa'" in line, line
    if value == "flash_attention_2":
        assert "not installed" in line


def test_shared_prefix_true_with_a_model_that_cannot_run_it_is_one_line(tiny_model_dir, capsys):
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--model.init_args.model_path", tiny_model_dir]
    overrides = [
        "--model.init_args.attn_implementation",
        "eager",
        "--model.init_args.update.shared_prefix",
        "true",
    ]
    line = fit_fails_with_one_line([*args, *overrides], capsys)
    assert "update.shared_prefix=true needs 'sdpa' attention" in line and "has 'eager' attention" in line, (
        line
    )


def test_flex_attention_refuses_to_train_on_cpu(tiny_model_dir, tmp_path):
    module = OffPolicyModule(tiny_model_dir, attn_implementation="flex_attention")
    module._trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' trains on CUDA only"):
        module.setup("fit")


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return str(create_tiny_model(tmp_path_factory.mktemp("qwen3") / "m", seed=0, arch="qwen3"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eager_and_sdpa_give_the_same_log_probs(tiny_model_dir, tiny_qwen3_dir, arch, dtype):
    """Left-padded prompts, responses of different lengths, temperature 0.7: log-probs and entropy of
    the response tokens agree between the eager and the SDPA kernel (chunked and whole-logits path).

    transformers' eager kernel takes its softmax in float32, also for a float64 model: hence a float32
    bound there (the softmax's rounding, 7e-8 measured), and only the samples without left padding, since
    float64's mask value becomes -inf in float32, a padded query row (every key masked) is NaN and the
    NaN reaches the row's later positions through the next layer's zero attention weights (0 × NaN).
    float32 has neither issue.
    """
    model_dir = {"llama": tiny_model_dir, "qwen3": tiny_qwen3_dir}[arch]
    exp = fixed_experience(model_dir)
    padded = (exp.prompt_mask == 0).any(dim=1)
    assert padded.any() and not padded.all(), "the batch needs rows with and without left padding"
    rows = ~padded if dtype == torch.float64 else torch.ones_like(padded)
    results = {}
    for attention in ("eager", "sdpa"):
        model = load_actor(model_dir, dtype=dtype, attn_implementation=attention).eval()
        assert model.config._attn_implementation == attention
        with torch.no_grad():
            results[attention] = [
                policy_log_probs(model, exp, 0.7, with_entropy=True, chunk_size=chunk) for chunk in (None, 5)
            ]
    mask = exp.response_mask.bool() & rows[:, None]
    config = model.config
    # helpers.tolerances: the kernels group the attention's sums otherwise in every block, on both
    # paths. float32: so do the MLP's (K = intermediate size, the longest sums): 2 × layers × eps32 ×
    # √K × the largest value (log-probs ≤ 8 at T = 0.7: ≈ 1.7e-4 for the 4-block Llama). float64:
    # only the eager softmax rounds to float32, its sums over ≤ P positions: 2 × layers × eps32 × √P ×
    # the largest value (≈ 3.4e-5; measured 7e-8). A masking or scaling bug is off by > 0.1.
    terms = config.intermediate_size if dtype == torch.float32 else exp.input_ids.shape[1]
    for (eager_lp, eager_h), (sdpa_lp, sdpa_h) in zip(results["eager"], results["sdpa"], strict=True):
        for ours, theirs in ((sdpa_lp[mask], eager_lp[mask]), (sdpa_h[mask], eager_h[mask])):
            atol = reordered_sums(theirs.float(), terms=terms, stages=config.num_hidden_layers)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
    assert results["sdpa"][0][0][mask].std() > 0.01  # not a constant that would agree trivially


def test_shared_prefix_rows_give_the_first_steps_grad_norm_of_per_sample_rows(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The same fit (seed 0: the same rollouts) with ``update.shared_prefix`` on (the default) and off: the
    first step's loss and grad norm agree within float32 rounding (in float64 the passes agree to 1e-11:
    tests/training/test_shared_prefix.py). A spy on the shared-row packing counts that the fit ran them."""
    import lit_offpolicy.training.forward as forward

    packed = []
    monkeypatch.setattr(
        forward, "shared_row", lambda model, exp: packed.append(len(exp)) or shared_row(model, exp)
    )
    rows = {}
    for shared in ("true", "false"):
        before = len(packed)
        _, rows[shared] = fit(
            tiny_model_dir, tmp_path / shared, "--model.init_args.update.shared_prefix", shared
        )
        assert (len(packed) > before) == (shared == "true")
    shared, per_sample = (float(rows[side][0]["actor/grad_norm"]) for side in ("true", "false"))
    # float32 sums regrouped in the 4 blocks' forward and backward (8 stages) over ≤ 512 terms (the MLP)
    assert shared == pytest.approx(per_sample, rel=0, abs=reordered_sums(torch.tensor(per_sample), 512, 8))
