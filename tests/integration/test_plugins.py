"""Parts from outside the package, plugged in through a YAML config (docs/architecture.md, "Adding an
engine or a reward"): this module's own engine (by class_path, with init_args) and reward (a plain
function by import path) train 2 steps through the ``lit-offpolicy`` CLI."""

from __future__ import annotations

import sys
from collections.abc import Mapping

import pytest
import yaml
from torch import Tensor

from lit_offpolicy.cli import main
from lit_offpolicy.rollout import EngineContext, EngineSpec, Generation, HFEngineSpec, SamplingParams

BUILT: list[RecordingEngine] = []
REWARD_CALLS: list[int] = []


class RecordingEngine:
    """A RolloutEngine of this module: the HF engine's samples, and a count of the prompts served."""

    def __init__(self, inner, label: str) -> None:
        self.inner, self.label = inner, label
        self.prompts_served = 0
        self.closed = False

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        self.prompts_served += len(prompts)
        return self.inner.generate(prompts, params)

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)

    def sleep(self) -> None:
        """Nothing to free."""

    def wake_up(self) -> None:
        """Nothing to take back."""

    def close(self) -> None:
        self.closed = True


class RecordingEngineSpec(EngineSpec):
    """Builds a ``RecordingEngine``; ``label`` is an engine argument given in the config's init_args."""

    def __init__(self, label: str = "") -> None:
        self.label = label

    def build(self, context: EngineContext) -> RecordingEngine:
        engine = RecordingEngine(HFEngineSpec().build(context), self.label)
        BUILT.append(engine)
        return engine


def length_reward(completions: list[str], **columns) -> list[float]:
    """A plain function as the reward: 1 for an even response length, else 0 (varied, so that the
    untrained model gets a gradient)."""
    REWARD_CALLS.append(len(completions))
    return [float(len(c) % 2 == 0) for c in completions]


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  default_root_dir: ROOT
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  num_sanity_val_steps: 0
  callbacks:
    - class_path: lit_offpolicy.callbacks.Rollout
      init_args:
        engine:
          class_path: THIS_MODULE.RecordingEngineSpec
          init_args: {label: out-of-tree}
        sampling: {n: 4, max_tokens: 5, seed: 0}
        reward: {fn: "THIS_MODULE:length_reward", timeout: null}
        validation: {every_n_steps: 0}
model:
  class_path: lit_offpolicy.OffPolicyModule
  init_args:
    model_path: MODEL
    optim: {lr: 1.0e-3}
data: {batch_size: 4, num_val_samples: 8}
"""


def config_text(model_dir: str, root) -> str:
    """CONFIG with its model and output paths, naming this module's parts by the name it is imported as
    (``tests.integration.test_plugins`` under pytest's importlib import mode)."""
    return CONFIG.replace("MODEL", model_dir).replace("ROOT", str(root)).replace("THIS_MODULE", __name__)


def test_an_out_of_tree_engine_and_reward_train_through_a_yaml_config(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    config = tmp_path / "plugins.yaml"
    config.write_text(config_text(tiny_model_dir, tmp_path))
    BUILT.clear()
    REWARD_CALLS.clear()
    main(["fit", "--config", str(config)])
    (engine,) = BUILT
    assert engine.label == "out-of-tree"
    assert engine.prompts_served == 2 * 4, "2 steps of 4 prompts, sampled by this module's engine"
    assert engine.policy_version == 2, "the weights were pushed after each step"
    assert engine.closed, "teardown closed the engine"
    assert REWARD_CALLS == [16, 16], "this module's function scored 4 prompts × 4 samples per step"


def test_a_bad_import_path_names_the_option(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.delenv("LIT_OFFPOLICY_TRACEBACK", raising=False)
    config = yaml.safe_load(config_text(tiny_model_dir, tmp_path))
    config["trainer"]["callbacks"][0]["init_args"]["reward"]["fn"] = f"{__name__}:no_such_reward"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path)])
    assert exit_info.value.code == 2
    assert f"reward.fn='{__name__}:no_such_reward' cannot be imported" in capsys.readouterr().err
