"""Reliability: atomic checkpoint writes, safe loading, the NaN/Inf guard, bad data, bad configuration
and reward functions that raise or hang. Each test names the fault in docs/reliability.md.

Real parts: files on disk, the tiny Llama, Lightning Trainers on CPU, a real child process killed
with SIGKILL during a checkpoint write, the CLI entry point, worker processes for rewards.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import REPO
from helpers.cli_runs import fit_fails_with_one_line
from helpers.experiences import fixed_experience
from helpers.fits import MemoryLogger, make_data, make_trainer, on_policy, rollout_options
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.callbacks.export import export_hf
from lit_offpolicy.cli import main
from lit_offpolicy.cli.parser_errors import condense
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.files import FILE_MODE
from lit_offpolicy.data import PromptDataModule, read_file
from lit_offpolicy.models import build_tokenizer, create_tiny_model, load_actor
from lit_offpolicy.rewards import (
    ExactAnswer,
    IsolatedReward,
    RewardConfig,
    RewardInputs,
    RewardOutput,
    WeightedRewards,
)
from lit_offpolicy.rollout import Generation
from lit_offpolicy.training.checkpointing import (
    AtomicCheckpointIO,
    CheckpointUnreadable,
    PreemptionCheckpoint,
    atomic_torch_save,
    install_fault_tolerance,
)
from lit_offpolicy.training.numerics import NonFiniteGuard, all_finite, batch_statistics
from lit_offpolicy.training.options import OptimOptions

# ----------------------------------------------------------------------------- checkpoint writes


def test_a_failing_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, target)

    def write_half_then_fail(obj, file):
        file.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"global_step": 2}, target)
    monkeypatch.undo()
    assert io.load_checkpoint(target) == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


WRITE_UNDER_A_FILE_SIZE_LIMIT = (
    "import resource, sys, torch\nfrom pathlib import Path\n"
    "from lit_offpolicy.training.checkpointing import CheckpointDiskFull, atomic_torch_save\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))\n"
    "try:\n"
    "    atomic_torch_save({'global_step': 2, 'blob': torch.ones(2**19)}, Path(sys.argv[1]))\n"
    "except CheckpointDiskFull as error:\n"
    "    print(error)\n"
)


def test_a_write_past_the_file_size_limit_is_one_line_with_the_bytes_needed(tmp_path):
    """``RLIMIT_FSIZE`` (1 MiB) under a 2 MiB checkpoint: the write fails with EFBIG inside torch's zip
    writer (Python ignores SIGXFSZ); the previous file stays and the message names the size."""
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, target)
    result = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_A_FILE_SIZE_LIMIT, str(target)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"checkpoint {target} was not written (File too large): it needs about ")
    assert "2,097,152 bytes (2.0 MiB)" in result.stdout
    assert "the previous last.ckpt is intact" in result.stdout
    assert AtomicCheckpointIO().load_checkpoint(target) == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


WRITE_A_BIG_CHECKPOINT = (
    "import sys, torch\nfrom pathlib import Path\n"
    "from lit_offpolicy.training.checkpointing import atomic_torch_save\n"
    "atomic_torch_save({'global_step': 2, 'blob': torch.ones(50_000_000)}, Path(sys.argv[1]))\n"
)


def test_a_write_killed_midway_never_becomes_the_last_checkpoint(tmp_path):
    """SIGKILL to a process while it writes a 200 MB checkpoint: last.ckpt is still the previous
    one, and Lightning's ``ckpt_path="last"`` lookup sees only it. (A fresh interpreter, not a fork:
    a fork of the test process, with its many threads, can deadlock before it writes a byte.)"""
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, target)
    writer = subprocess.Popen([sys.executable, "-c", WRITE_A_BIG_CHECKPOINT, str(target)])
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 0 for p in tmp_path.glob(".last.ckpt.*.tmp")):
            assert writer.poll() is None, "the writer ended before writing"
            assert time.monotonic() < deadline, "the writer wrote nothing in 120 s"
            time.sleep(0.001)
    finally:  # never leave the child behind, whatever failed
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".last.ckpt.*.tmp")), "killed mid-write: the temporary file is left behind"
    assert AtomicCheckpointIO().load_checkpoint(target) == {"global_step": 1}
    trainer = L.Trainer(logger=False, enable_progress_bar=False)
    found = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer)
    assert found == {str(target)}


def test_checkpoints_load_with_weights_only(tmp_path):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Path("/etc")}, path)  # a pickled object, not just tensors
    with pytest.raises(
        CheckpointUnreadable, match=r"holds objects other than tensors \(e.g. pathlib.PosixPath\)"
    ):
        AtomicCheckpointIO().load_checkpoint(path)
    assert AtomicCheckpointIO().load_checkpoint(path, weights_only=False)["payload"] == Path("/etc")


def test_cli_trainers_get_the_atomic_writer_and_the_preemption_checkpoint(tmp_path):
    trainer = L.Trainer(logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    install_fault_tolerance(trainer)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    assert sum(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks) == 1
    install_fault_tolerance(trainer)  # idempotent
    assert sum(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks) == 1
    assert [c.save for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)] == [True]
    # checkpointing off (the SFT warm-up): a signal still stops the run at the step's end, saving nothing
    without = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    install_fault_tolerance(without)
    assert [c.save for c in without.callbacks if isinstance(c, PreemptionCheckpoint)] == [False]


# ----------------------------------------------------------------------------- safe model loading


EVIL_MARKER = "EVIL_RAN"


class Evil:
    """Unpickling it runs code (writes a marker file): what a hostile pytorch_model.bin can do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, EVIL_MARKER))


def test_models_load_from_safetensors_without_remote_code(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "marker"
    torch.save({"x": Evil(marker)}, model_dir / "pytorch_model.bin")  # never unpickled
    (model_dir / "evil_modeling.py").write_text(f"open({str(marker)!r}, 'w').write({EVIL_MARKER!r})\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil_modeling.EvilModel"}  # never imported
    (model_dir / "config.json").write_text(json.dumps(config))
    actor = load_actor(model_dir)
    assert type(actor).__name__ == "LlamaForCausalLM"
    assert not marker.exists()


# ----------------------------------------------------------------------------- NaN / Inf guard


def test_guard_passes_finite_steps_and_counts_nonfinite_ones():
    guard = NonFiniteGuard(max_in_a_row=2)
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.tensor([0.1, 0.2, 0.3])
    exp = small_experience()
    assert guard.is_finite(torch.tensor(1.0), [parameter], exp)
    parameter.grad = torch.tensor([0.1, math.inf, 0.3])
    assert not guard.is_finite(torch.tensor(1.0), [parameter], exp)
    parameter.grad = torch.tensor([0.1, 0.2, 0.3])
    assert guard.is_finite(torch.tensor(1.0), [parameter], exp), "a finite step resets the count"
    assert not guard.is_finite(torch.tensor(math.nan), [parameter], exp)
    with pytest.raises(RuntimeError, match=r"2 optimizer steps in a row .*max_consecutive_nonfinite=2"):
        guard.is_finite(torch.tensor(math.nan), [parameter], exp)
    assert guard.state_dict() == {"in_a_row": 2, "total_skipped": 3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_finds_nan_and_both_infinities_anywhere(dtype):
    values = torch.linspace(-3e4, 3e4, 101, dtype=dtype).reshape(1, 101)
    assert all_finite(values) and all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.full((4,), torch.finfo(dtype).max, dtype=dtype))  # huge is finite
    for bad in (math.nan, math.inf, -math.inf):
        for index in (0, 50, 100):
            broken = values.clone()
            broken[0, index] = bad
            assert not all_finite(broken), (bad, index)


def small_experience() -> Experience:
    """One prompt, two responses (2 and 1 tokens), scores 1 and 0."""
    generations = [[Generation([5, 6], [-1.0, -2.0], "length"), Generation([7], [-0.5], "length")]]
    prompt = build_tokenizer()("1+1=").input_ids
    return Experience.from_generations([prompt], generations, [1.0, 0.0], pad_token_id=0, policy_version=0)


def test_batch_statistics_report_ranges_and_nonfinite_counts():
    exp = small_experience()
    exp.rollout_log_probs[0, 1] = math.nan
    stats = batch_statistics(exp)
    assert stats["reward_mean"] == 0.5 and stats["reward_max"] == 1.0 and stats["reward_nonfinite"] == 0
    assert stats["rollout_log_probs_nonfinite"] == 1
    assert stats["rollout_log_probs_min"] == -1.0 and stats["rollout_log_probs_max"] == -0.5


class ExperienceSequence(L.Callback):
    """Feeds ``experiences[i]`` to step i, on-policy; records after each step whether any actor
    gradient is set."""

    def __init__(self, experiences: list[Experience]) -> None:
        self.experiences = experiences
        self.grads_left: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["experience"] = on_policy(self.experiences[batch_idx], pl_module.policy_version)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.grads_left.append(any(p.grad is not None for p in pl_module.actor.parameters()))


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_logged_and_stop_the_run(tiny_model_dir):
    """A NaN reward makes the advantages, the loss and every gradient NaN. Steps: NaN, finite, NaN,
    NaN with max_consecutive_nonfinite=2: the first is skipped (weights and optimizer untouched,
    gradients zeroed), the second trains, the last two in a row stop the run."""
    finite = fixed_experience(tiny_model_dir)
    poisoned = copy.deepcopy(finite)
    poisoned.scores[0] = math.nan
    feed = ExperienceSequence([poisoned, finite, poisoned, poisoned])
    module = OffPolicyModule(
        model_path=tiny_model_dir, max_consecutive_nonfinite=2, optim=OptimOptions(lr=1e-3)
    )
    before = {name: tensor.clone() for name, tensor in module.actor.state_dict().items()}
    logger = MemoryLogger()
    trainer = make_trainer([feed], max_steps=10, logger=logger)
    with pytest.raises(
        RuntimeError, match="2 optimizer steps in a row .*max_consecutive_nonfinite=2.*reward_nonfinite=1"
    ):
        trainer.fit(module, datamodule=make_data(tiny_model_dir))
    # the fourth step raised before logging
    assert logger.values("actor/nonfinite_skipped") == [1.0, 0.0, 1.0]
    assert trainer.global_step == 1, "one optimizer step, the finite one"
    assert module.nonfinite_guard.state_dict() == {"in_a_row": 2, "total_skipped": 3}
    assert feed.grads_left[0] is False, "the skipped step's NaN gradients were zeroed"
    # the weights after the run are those of one finite step from the initial weights
    reference = OffPolicyModule(model_path=tiny_model_dir, optim=OptimOptions(lr=1e-3))
    make_trainer([ExperienceSequence([finite])], max_steps=1).fit(
        reference, datamodule=make_data(tiny_model_dir)
    )
    changed = 0
    for name, tensor in module.actor.state_dict().items():
        assert torch.equal(tensor, reference.actor.state_dict()[name]), name
        changed += not torch.equal(tensor, before[name])
    assert changed


def test_max_consecutive_nonfinite_is_validated(tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"max_consecutive_nonfinite=0 is out of range; allowed values: \[1, inf\]"
    ):
        OffPolicyModule(model_path=tiny_model_dir, max_consecutive_nonfinite=0)


# ----------------------------------------------------------------------------- bad data

BAD_ROWS = (
    b'{"prompt": "1+1=", "answer": "2"}\n'
    b'{"prompt": "2+2=", "answer": 4\n'  # line 2: not JSON
    b'{"prompt": "3+3="}\n'  # line 3: no answer
    b'{"prompt": "\xff", "answer": "2"}\n'  # line 4: not UTF-8
    b'{"prompt": "  ", "answer": "2"}\n'  # line 5: empty prompt
    b"\n"
    b'{"prompt": "4+4=", "answer": 8}\n'
)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (2, "not valid JSON"),
        (3, "missing field 'answer'"),
        (4, "not valid UTF-8"),
        (5, "field 'prompt' is empty"),
    ],
)
def test_bad_rows_raise_naming_file_and_line(tmp_path, line, message):
    lines = BAD_ROWS.split(b"\n")
    content = lines[0] + b"\n" * (line - 1) + lines[line - 1] + b"\n"  # the bad row alone, at its line
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}, line {line}: {message}"):
        read_file(path, on_bad_data="error")


def test_bad_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD_ROWS)
    problems, bad = read_file(path, on_bad_data="skip")
    assert [(p["prompt"], p["answer"]) for p in problems] == [("1+1=", "2"), ("4+4=", "8")]
    assert [message.split(": ", 1)[0] for message in bad] == [f"{path}, line {n}" for n in (2, 3, 4, 5)]


def test_datamodule_skips_bad_rows_and_logs_the_counts(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD_ROWS)
    long_row = json.dumps({"prompt": "1+" * 40 + "1=", "answer": "41"}).encode() + b"\n"
    (tmp_path / "train.jsonl").write_bytes(BAD_ROWS + long_row)
    datamodule = PromptDataModule(
        train_files=[str(tmp_path / "train.jsonl")], val_files=[str(path)], batch_size=2, on_bad_data="skip"
    )
    datamodule.set_tokenizer(build_tokenizer())
    logger = MemoryLogger()
    datamodule.trainer = L.Trainer(logger=logger, enable_progress_bar=False, enable_checkpointing=False)
    with pytest.warns(
        UserWarning, match=r"skipped 4 bad train rows \(on_bad_data='skip'\); the first: .*line 2"
    ):
        datamodule.setup("fit")
    assert len(datamodule.train_problems) == 2 and len(datamodule.val_problems) == 2
    assert datamodule.num_skipped == {"train": 4, "val": 4}
    assert datamodule.num_filtered == {"train": 1, "val": 0}
    assert logger.rows[-1] == (
        0,
        {
            "data/skipped_train": 4.0,
            "data/skipped_val": 4.0,
            "data/filtered_long_train": 1.0,
            "data/filtered_long_val": 0.0,
        },
    )


def test_datamodule_on_bad_data_error_stops_setup(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(BAD_ROWS)
    datamodule = PromptDataModule(train_files=[str(path)], batch_size=1)
    datamodule.set_tokenizer(build_tokenizer())
    with pytest.raises(ValueError, match=f"{path}, line 2: not valid JSON"):
        datamodule.setup("fit")
    with pytest.raises(
        ValueError, match="on_bad_data='warn' is not supported; allowed values: 'error', 'skip'"
    ):
        PromptDataModule(on_bad_data="warn")


# ----------------------------------------------------------------------------- bad configuration


@pytest.fixture
def cli_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.delenv("LIT_OFFPOLICY_TRACEBACK", raising=False)


def grpo_fit(model_path) -> list[str]:
    """``fit`` with configs/grpo.yaml on the model at ``model_path``: the command the error tests vary."""
    config = str(REPO / "configs" / "grpo.yaml")
    return ["fit", "--config", config, "--model.init_args.model_path", str(model_path)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--model.init_args.policy_loss", "nope"],
            "policy_loss='nope' is not supported; "
            "allowed values: 'ppo', 'vanilla', 'tis', 'topr', 'cispo', 'kimi15', 'gspo'",
        ),
        (["--model.init_args.advantage", "gae"], "advantage=GAE needs a critic: set critic_path"),
        (
            ["--model.init_args.optim.lr", "-0.001"],
            "optim.lr=-0.001 is out of range; allowed values: (0.0, inf]",
        ),
        (
            [
                "--model.init_args.rollout_correction",
                json.dumps({"bypass_mode": True, "rollout_rs": "token", "rollout_rs_threshold": 2.0}),
            ],
            "rollout_rs='token' is not supported with bypass_mode=True",
        ),
        (
            ["--model.init_args.max_consecutive_nonfinite", "0"],
            "max_consecutive_nonfinite=0 is out of range; allowed values: [1, inf]",
        ),
        (
            ["--data.on_bad_data", "ignore"],
            "on_bad_data='ignore' is not supported; allowed values: 'error', 'skip'",
        ),
        (["--model.init_args.kl.loss_type", "kl9"], "kl.loss_type='kl9' is not supported; allowed values:"),
        (
            ["--model.init_args.reward_shaping.shift", "true"],
            "reward_shaping.shift=True, reward_shaping.scale=False have no effect with "
            "reward_shaping.norm=None",
        ),
    ],
)
def test_bad_options_end_with_one_line_and_exit_2(options, message, tiny_model_dir, cli_argv, capsys):
    assert message in fit_fails_with_one_line([*grpo_fit(tiny_model_dir), *options], capsys)


def test_data_options_are_checked_before_the_model_loads(tmp_path, cli_argv, capsys):
    args = ["fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--data.on_bad_data", "ignore"]
    with pytest.raises(SystemExit):
        main([*args, "--model.init_args.model_path", str(tmp_path / "no-model-here")])
    assert "on_bad_data='ignore' is not supported" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sampling, message",
    [
        ({"n": 0}, "sampling.n=0 is out of range; allowed values: [1, inf]"),
        ({"max_tokens": 0}, "sampling.max_tokens=0 is out of range; allowed values: [1, inf]"),
    ],
)
def test_bad_sampling_options_are_named_as_the_config_writes_them(
    sampling, message, tiny_model_dir, cli_argv, capsys
):
    rollout = {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": {"sampling": sampling}}
    options = ["--trainer.callbacks", json.dumps([rollout])]
    test_bad_options_end_with_one_line_and_exit_2(options, message, tiny_model_dir, cli_argv, capsys)


def test_bad_callback_option_ends_with_one_line_and_exit_2(tiny_model_dir, cli_argv, capsys):
    rollout = {"class_path": "lit_offpolicy.callbacks.Rollout", "init_args": {"reward": {"timeout": 0}}}
    message = "reward.timeout=0.0 is out of range; allowed values: (0.0, inf]"
    options = ["--trainer.callbacks", json.dumps([rollout])]
    test_bad_options_end_with_one_line_and_exit_2(options, message, tiny_model_dir, cli_argv, capsys)


# ----------------------------------------------------------------------------- reward functions that fail


class FlakyReward:
    """Scores 1.0, except: "raise" raises, "hang" sleeps for an hour, "nan" returns NaN."""

    def __call__(self, completions: list[str], **columns) -> list[float]:
        scores = []
        for completion in completions:
            if completion == "raise":
                raise KeyError("no such answer")
            if completion == "hang":
                time.sleep(3600)
            scores.append(math.nan if completion == "nan" else 1.0)
        return scores


def reward_inputs(completions: list[str], answers: list[str]) -> RewardInputs:
    """One completion per problem ``{"prompt": "p", "answer": a}``."""
    problems = [{"prompt": "p", "answer": answer} for answer in answers]
    return RewardInputs.of(problems, completions, [[0]] * len(completions))


def isolated(fn, **options) -> IsolatedReward:
    return IsolatedReward(WeightedRewards({"fn": fn}), **options)


def test_isolated_reward_scores_failures_zero_and_counts_them():
    reward = isolated(FlakyReward(), timeout=3.0, num_workers=2)
    try:
        started = time.monotonic()
        out = reward(reward_inputs(["ok", "raise", "hang", "nan", "ok"], ["1"] * 5))
        elapsed = time.monotonic() - started
        assert out.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert out.by_function == {"fn": [1.0, None, None, None, 1.0]}
        assert (out.num_errors, out.num_timeouts) == (2, 1)
        assert 3.0 <= elapsed < 10.0, "waited for the deadline, not for the hung call"
        # the hung worker was killed; a fresh pool scores the next batch
        assert reward(reward_inputs(["ok", "ok"], ["1", "1"])) == RewardOutput(
            [1.0, 1.0], 0, num_errors=0, num_timeouts=0, by_function={"fn": [1.0, 1.0]}
        )
    finally:
        reward.close()


def test_isolated_reward_sends_chunks_and_a_hang_costs_only_its_chunk():
    """32 samples, 2 workers: 16 chunks of 2. An error costs its sample; the hang at 10 costs its
    chunk (10 and 11), while the other worker scores every other chunk."""
    reward = isolated(FlakyReward(), timeout=3.0, num_workers=2)
    completions = ["ok"] * 32
    completions[1], completions[10] = "raise", "hang"
    try:
        out = reward(reward_inputs(completions, ["1"] * 32))
        assert out.scores == [0.0 if i in (1, 10, 11) else 1.0 for i in range(32)]
        assert (out.num_errors, out.num_timeouts) == (1, 2)
    finally:
        reward.close()


def test_reward_workers_can_start_as_fresh_interpreters():
    """``reward.start_method="forkserver"``: workers that share nothing with the trainer's threads
    (about 10 s here: each worker imports the package afresh)."""
    rollout = callbacks.Rollout(reward=RewardConfig(timeout=30.0, workers=2, start_method="forkserver"))
    reward = rollout.worker.reward_fn
    assert isinstance(reward, IsolatedReward) and reward.start_method == "forkserver"
    try:
        assert reward(reward_inputs(["42", "7", "x"], ["42", "8", "1"])).scores == [1.0, 0.0, 0.0]
    finally:
        reward.close()
    asynchronous = callbacks.AsyncRollout(reward=RewardConfig(timeout=5.0, workers=3, start_method="spawn"))
    wired = asynchronous.worker.reward_fn
    assert (wired.timeout, wired.num_workers, wired.start_method) == (5.0, 3, "spawn")
    with pytest.raises(ValueError, match="reward.start_method='thread' is not supported; allowed values"):
        RewardConfig(start_method="thread")


def test_a_hung_worker_is_killed_even_if_the_trainer_ignores_sigterm():
    """Workers are forked from a trainer whose SIGTERM handler (Lightning's) only records the signal;
    they must not inherit it, or terminating the hung one would wait forever."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    reward = isolated(FlakyReward(), timeout=1.0)
    try:
        assert reward(reward_inputs(["hang"], ["1"])).num_timeouts == 1  # returns: the hung worker was killed
        (hung,) = reward._workers
        assert hung.process.exitcode == -signal.SIGKILL
    finally:
        reward.close()
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_rollout_logs_reward_error_and_timeout_fractions(tiny_model_dir):
    """The Rollout callback's isolated reward: a reward that always raises scores every sample 0 and
    the run goes on, logging reward/error_fraction = 1."""
    wired = callbacks.Rollout(reward=RewardConfig(fn="exact", timeout=5.0, workers=2)).worker.reward_fn
    assert isinstance(wired, IsolatedReward) and isinstance(wired.rewards.functions["exact"], ExactAnswer)
    assert (wired.timeout, wired.num_workers) == (5.0, 2)
    in_process = callbacks.Rollout(reward=RewardConfig(timeout=None)).worker.reward_fn
    assert isinstance(in_process, WeightedRewards) and isinstance(in_process.functions["exact"], ExactAnswer)
    rollout = callbacks.Rollout(
        **{**rollout_options(), "reward": RewardConfig(fn=AlwaysRaises(), timeout=20.0)}
    )
    logger = MemoryLogger()
    trainer = make_trainer([rollout], max_steps=2, logger=logger)
    trainer.fit(OffPolicyModule(model_path=tiny_model_dir), datamodule=make_data(tiny_model_dir))
    assert trainer.global_step == 2
    assert logger.values("reward/error_fraction") == [1.0, 1.0]
    assert logger.values("reward/timeout_fraction") == [0.0, 0.0]
    assert logger.values("reward/mean") == [0.0, 0.0]
    assert rollout.worker.reward_fn._workers == [], "teardown stopped the workers"


class AlwaysRaises:
    def __call__(self, completions: list[str], **columns) -> list[float]:
        raise RuntimeError("verifier crashed")


def test_resume_from_nothing_ends_with_one_line_and_exit_2(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """``--ckpt_path last`` where nothing was saved yet (the config's ``outputs/checkpoints``, here
    under an empty directory): Lightning would warn and train from scratch."""
    monkeypatch.chdir(tmp_path)
    error = fit_fails_with_one_line([*grpo_fit(tiny_model_dir), "--ckpt_path", "last"], capsys)
    assert "--ckpt_path last: no last checkpoint to resume from" in error
    assert "outputs/checkpoints" in error


def _checkpoints(root: Path) -> Path:
    """The config's checkpoint directory (configs/grpo.yaml: outputs/checkpoints) under ``root``."""
    directory = root / "outputs" / "checkpoints"
    directory.mkdir(parents=True)
    return directory


def test_a_truncated_last_checkpoint_ends_with_one_line_naming_it_and_the_others(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A ``last.ckpt`` cut short by a crash in someone else's code (the atomic writer never leaves one):
    ``--ckpt_path last`` names the file and the checkpoints to resume from instead (it was a 55-line
    traceback from the zip reader)."""
    monkeypatch.chdir(tmp_path)
    directory = _checkpoints(tmp_path)
    torch.save({"global_step": 1, "state_dict": {"w": torch.zeros(64, 64)}}, directory / "step=1.ckpt")
    whole = (directory / "step=1.ckpt").read_bytes()
    (directory / "last.ckpt").write_bytes(whole[: len(whole) // 2])
    error = fit_fails_with_one_line([*grpo_fit(tiny_model_dir), "--ckpt_path", "last"], capsys)
    assert f"checkpoint {directory / 'last.ckpt'} is truncated or corrupt (" in error
    assert f"resume from another with --ckpt_path, newest first: {directory / 'step=1.ckpt'}" in error


def test_a_checkpoint_with_objects_other_than_tensors_is_refused_in_one_line(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """``weights_only=True`` refuses pickled objects (it would run their code); the refusal names the
    file, the object, and how to load a file the user trusts (it was a 53-line traceback)."""
    monkeypatch.chdir(tmp_path)
    last = _checkpoints(tmp_path) / "last.ckpt"
    torch.save({"global_step": 1, "state_dict": {}, "hparams": argparse.Namespace(lr=1.0)}, last)
    error = fit_fails_with_one_line([*grpo_fit(tiny_model_dir), "--ckpt_path", "last"], capsys)
    assert f"checkpoint {last} holds objects other than tensors (e.g. argparse.Namespace)" in error
    assert "for a file you trust, run with LIT_OFFPOLICY_TRUST_CHECKPOINT=1" in error


def test_create_tiny_model_refuses_a_file_and_a_model_it_would_overwrite(tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    existing = tmp_path / "model"
    main(["create-tiny-model", str(existing)])
    written = (existing / "model.safetensors").stat().st_mtime_ns
    for path, message in (
        (tmp_path / "a-file", "is a file, not a directory"),
        (existing, "exists and is not empty; pass --overwrite to replace its model"),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["create-tiny-model", str(path)])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip()
        assert error == f"lit-offpolicy: error: create-tiny-model: {path} {message}"
    assert (tmp_path / "a-file").read_text() == "mine"
    assert (existing / "model.safetensors").stat().st_mtime_ns == written
    main(["create-tiny-model", str(existing), "--overwrite", "--seed", "1"])
    assert (existing / "model.safetensors").stat().st_mtime_ns != written


def test_the_cli_help_lists_create_tiny_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.startswith("usage: lit-offpolicy ") and "create-tiny-model DIRECTORY" in printed


@pytest.mark.parametrize("option", ["checkpoints", "logs"])
def test_an_output_directory_under_a_file_ends_with_one_line_before_the_model_loads(
    option, tmp_path, cli_argv, capsys
):
    """Found at start-up, not at the first save (the trained steps lost with an 85-line traceback), and
    before the model loads (minutes for a large one): the model directory here does not even exist."""
    never_loaded = tmp_path / "no-model-here"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    under = blocker / "below"
    where = {
        "checkpoints": [
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={under}",
        ],
        "logs": [f"--trainer.logger.init_args.save_dir={under}"],
    }[option]
    error = fit_fails_with_one_line([*grpo_fit(never_loaded), *where], capsys)
    assert f"={under} cannot be written: {blocker} is a file" in error


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model.init_args.optim.lr", "abc"], "model.init_args.optim.lr: expected float, got abc"),
        (["--data.batch_size", "x"], "data.batch_size: expected int, got x"),
        (["--model.init_args.optim.lrr", "1"], "model.init_args: unrecognized arguments: --optim.lrr=1"),
        (["--trainer.max_stepz", "3"], "(did you mean '--trainer.max_steps'?)"),
        (
            ["--model.init_args.policy_loss.class_path", "lit_offpolicy.losses.TOPRR"],
            "model.init_args.policy_loss: class_path 'lit_offpolicy.losses.TOPRR': module "
            "'lit_offpolicy.losses' has no attribute 'TOPRR' (did you mean 'lit_offpolicy.losses.TOPR'?)",
        ),
        (
            ["--model.init_args.policy_loss.class_path", "TOPRLoss"],
            "model.init_args.policy_loss: Expected a dot import path string: TOPRLoss "
            "(did you mean 'lit_offpolicy.losses.TOPR'?)",
        ),
        (
            ["--model.class_path", "lit_offpolicy.OffPolicyModul"],
            "(did you mean 'lit_offpolicy.OffPolicyModule'?)",
        ),
        (
            ["--rollout.sampling.temp", "0.5"],
            "Group 'sampling' does not accept option 'temp' (did you mean 'temperature'?)",
        ),
        (
            [
                "--rollout.reward.fn",
                "{class_path: lit_offpolicy.rewards.CodeExecutionReward, init_args: {timeout: 5}}",
            ],
            "reward.fn: lit_offpolicy.rewards.CodeExecutionReward does not accept option 'timeout' "
            "(did you mean 'timeout_s'?)",
        ),
    ],
)
def test_parser_errors_end_with_one_line_naming_the_option(options, message, tiny_model_dir, capsys):
    """jsonargparse reports these in 60 to 80 lines (the usage, then every Union alternative)."""
    error = fit_fails_with_one_line([*grpo_fit(tiny_model_dir), *options], capsys, alone=True)
    assert message in error and error.endswith("(options: lit-offpolicy fit --help)")


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: [1\n")
    error = fit_fails_with_one_line(["fit", "--config", str(broken)], capsys, alone=True)
    assert (
        error
        == f"lit-offpolicy: error: {broken}: line 3, column 1: expected ',' or ']', but got '<stream end>'"
    )
    assert fit_fails_with_one_line(["fit", f"--config={broken}"], capsys) == error


def bad_data_file(directory: Path, kind: str) -> Path:
    """A prompt file of the given ``kind`` of bad, under ``directory``."""
    row_without_prompt = {"question": "1+1=", "answer": "2"}
    if kind == "missing":
        return directory / "nothere.jsonl"
    if kind == "directory":
        (directory / "dir.jsonl").mkdir()
        return directory / "dir.jsonl"
    if kind == "empty":
        (directory / "empty.jsonl").write_text("")
        return directory / "empty.jsonl"
    if kind == "jsonl without prompt":
        (directory / "q.jsonl").write_text(json.dumps(row_without_prompt) + "\n")
        return directory / "q.jsonl"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([row_without_prompt]), directory / "q.parquet")
    return directory / "q.parquet"


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "nothere.jsonl does not exist"),
        ("directory", "dir.jsonl is a directory"),
        ("empty", "empty.jsonl has no rows"),
        ("jsonl without prompt", "q.jsonl, line 1: missing field 'prompt'"),
        ("parquet without prompt", "q.parquet: no column 'prompt'; columns: question, answer"),
    ],
)
def test_bad_data_files_end_with_one_line_before_the_model_loads(kind, message, tmp_path, cli_argv, capsys):
    """The model path does not exist: the data file's error comes first, so it came before loading."""
    files = json.dumps([str(bad_data_file(tmp_path, kind))])
    error = fit_fails_with_one_line([*grpo_fit(tmp_path / "no-model"), "--data.train_files", files], capsys)
    assert message in error


def test_weights_checkpoints_and_exports_get_the_mode_of_any_new_file(tiny_model_dir, tmp_path):
    """0644 under the usual umask, like the configs and tokenizers beside them (mkstemp and
    safetensors wrote 0600: others could read an export's tokenizer but not its weights)."""
    atomic_torch_save({"step": 1}, tmp_path / "last.ckpt")
    create_tiny_model(tmp_path / "tiny")
    export_hf(load_actor(tiny_model_dir), build_tokenizer(), tmp_path / "export")
    written = [tmp_path / "last.ckpt", *(tmp_path / "tiny").iterdir(), *(tmp_path / "export").iterdir()]
    assert any(path.suffix == ".safetensors" for path in written)
    assert {path.name: oct(path.stat().st_mode & 0o777) for path in written} == {
        path.name: oct(FILE_MODE) for path in written
    }


def test_a_corrupt_weight_file_ends_with_one_line_naming_the_model_directory(tmp_path, cli_argv, capsys):
    model = create_tiny_model(tmp_path / "corrupt")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    error = fit_fails_with_one_line(grpo_fit(model), capsys)
    assert f"could not load AutoModelForCausalLM from {model}: " in error


def test_condense_keeps_the_option_path_and_the_deepest_reason():
    """Hand-written reports in jsonargparse's shape (the CLI tests above use real ones)."""
    nested = (
        'Parser key "model":\n'
        "  Does not validate against any of the Union subtypes\n"
        "  Errors:\n"
        "    - Problem with given class_path 'pkg.Module':\n"
        '        Parser key "optim.lr":\n'
        "          Expected a <class 'float'>. Got value: abc\n"
        "    - Expected a <class 'NoneType'>\n"
        "  Given value type: <class 'str'>\n"
    )
    assert condense(nested) == "model.init_args.optim.lr: expected float, got abc"
    only_structure = 'Parser key "data":\n  Does not validate against any of the Union subtypes\n'
    assert condense(only_structure).startswith("data: invalid value (LIT_OFFPOLICY_TRACEBACK=1")
    unknown = "unrecognized arguments: --trainer.max_stepz 3"
    assert condense(unknown, ["--trainer.max_steps", "--trainer.min_steps"]).endswith(
        "(did you mean '--trainer.max_steps'?)"
    )
    assert condense(unknown, ["--data.batch_size"]) == unknown  # nothing close: no suggestion


def test_chat_rows_without_a_chat_template_end_with_one_line(tiny_model_dir, tmp_path, capsys):
    """Only the tokenizer can tell: the CLI prepares the data before training to find it."""
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}] * 4
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = ["--data.train_files", json.dumps([str(path)]), "--data.batch_size", "2"]
    error = fit_fails_with_one_line([*grpo_fit(tiny_model_dir), *options], capsys)
    assert "chat messages need the tokenizer's chat template: the tokenizer has no chat template" in error


def test_a_mini_batch_larger_than_a_step_ends_with_one_line(tiny_model_dir, capsys):
    """configs/grpo.yaml: 128 prompts x 4 samples a step = 512; 513 would quietly be one mini-batch."""
    error = fit_fails_with_one_line(
        [
            *grpo_fit(tiny_model_dir),
            "--model.init_args.update.mini_batch_size",
            "513",
            "--trainer.max_steps",
            "1",
        ],
        capsys,
    )
    assert error == (
        "lit-offpolicy: error: update.mini_batch_size=513 is more than a step's samples: data.batch_size=128 "
        "prompts x sampling.n=4 = 512 per rank; set it to at most 512, or null (the whole step)"
    )
