"""A user's own assets, unchanged: a reward function written for TRL named by import path in a YAML
config, a verl-schema parquet and a TRL-schema jsonl dataset (chat prompts), per-source validation.

Each run is the CLI's ``fit`` on the built-in tiny Llama with a chat template added, 3 GRPO steps,
the HF engine, rewards isolated in a forked worker (the default): what a reward function receives
is recorded to a JSONL file, since it runs in another process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers.cli_runs import fit_fails_with_one_line

from lit_offpolicy.cli import main
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.models import create_tiny_model, load_tokenizer

CALLS_ENV = "LIT_OFFPOLICY_TEST_REWARD_CALLS"
ROLE_TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def _record(**kwargs) -> None:
    """Append what a reward function was called with (names, and the first entry's types) to the file
    named by the environment (written by the reward's worker process)."""
    summary = {name: type(values[0]).__name__ for name, values in kwargs.items()}
    summary["count"] = len(kwargs["completions"])
    summary["first"] = {name: values[0] for name, values in kwargs.items() if name != "completion_ids"}
    with open(os.environ[CALLS_ENV], "a") as file:
        file.write(json.dumps(summary) + "\n")


def verl_reward(prompts, completions, completion_ids, data_source, reward_model, extra_info, **kwargs):
    """A verl-style reward written against TRL's convention: parity of the completion's length on
    "add" rows, None (does not apply) on the others."""
    _record(
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        data_source=data_source,
        reward_model=reward_model,
        extra_info=extra_info,
        **kwargs,
    )
    return [
        float(len(ids) % 2) if source == "add" else None
        for ids, source in zip(completion_ids, data_source, strict=True)
    ]


def trl_accuracy_reward(completions, solution, **kwargs):
    """As TRL's docs write one for a conversational dataset: the completion's content against the
    ``solution`` column."""
    _record(completions=completions, solution=solution, **kwargs)
    return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution, strict=True)]


def trl_length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 5 for c in completions]


CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 3
  log_every_n_steps: 1
  enable_checkpointing: false
  enable_model_summary: false
  limit_val_batches: 0
  num_sanity_val_steps: 0
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {save_dir: LOGS, name: run}
  callbacks:
    - class_path: lit_offpolicy.callbacks.Rollout
      init_args:
        sampling: {n: 4, max_tokens: 5}
        reward: REWARD
        validation: {every_n_steps: 3}
model:
  class_path: lit_offpolicy.OffPolicyModule
  init_args:
    model_path: MODEL
    advantage: grpo
    optim: {lr: 1.0e-3}
data:
  train_files: [TRAIN]
  val_files: [VAL]
  answer_key: ANSWER_KEY
  batch_size: 4
  val_batch_size: 8
"""


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with a chat template (its character tokenizer reads any ASCII text)."""
    path = create_tiny_model(tmp_path_factory.mktemp("chat-model") / "tiny", seed=0)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = ROLE_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def _verl_rows(count: int, split: str) -> list[dict]:
    """verl's layout: data_source, chat prompt, ability, reward_model.ground_truth, extra_info."""
    rows = []
    for index in range(count):
        a, b = index % 10, (3 * index) % 10
        source, question, answer = ("add", f"{a}+{b}=", a + b) if index % 2 else ("double", f"2*{a}=", 2 * a)
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def _fit(tmp_path: Path, model: str, train: Path, val: Path, answer_key: str, reward: dict) -> Path:
    """``lit-offpolicy fit`` with CONFIG; returns the TensorBoard run directory."""
    values = {
        "LOGS": str(tmp_path / "logs"),
        "MODEL": model,
        "TRAIN": str(train),
        "VAL": str(val),
        "ANSWER_KEY": answer_key,
        "REWARD": json.dumps(reward),
    }
    config = CONFIG
    for name, value in values.items():
        config = config.replace(name, value)
    path = tmp_path / "user.yaml"
    path.write_text(config)
    main(["fit", "--config", str(path)])
    return latest_run(tmp_path / "logs" / "run")


def _calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_verl_parquet_trains_with_a_reward_by_import_path_and_logs_per_source(
    chat_model_dir, tmp_path, monkeypatch
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(calls))
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(16, "train")), train)
    pq.write_table(pa.Table.from_pylist(_verl_rows(6, "test")), val)
    reward = {"fn": [f"{__name__}:verl_reward", "exact"], "weights": [1.0, 0.5], "timeout": 30}
    run = _fit(tmp_path, chat_model_dir, train, val, "reward_model.ground_truth", reward)

    recorded = _calls(calls)
    step = [call for call in recorded if call["count"] > 1]  # the per-sample calls of isolation: count 1
    assert recorded and not step, "isolation scores one completion per call"
    first = recorded[0]
    expected_names = {"prompts", "completions", "completion_ids", "data_source", "reward_model", "extra_info"}
    assert expected_names | {"ability", "answer", "count", "first"} == set(first)
    assert first["prompts"] == "list" and first["completions"] == "list"  # chat prompt, chat completion
    assert first["first"]["completions"][0]["role"] == "assistant"
    assert first["reward_model"] == "dict" and first["extra_info"] == "dict"  # nested, as stored
    assert first["first"]["answer"] == first["first"]["reward_model"]["ground_truth"]
    assert {call["first"]["extra_info"]["split"] for call in recorded} == {"train", "test"}

    assert len(read_scalars(run, "reward/mean")) == 3
    assert len(read_scalars(run, "reward/fn/verl_reward/mean")) == 3  # over the "add" rows only
    assert len(read_scalars(run, "reward/fn/exact/mean")) == 3
    for source in ("add", "double"):
        assert [step for step, _ in read_scalars(run, f"val/{source}/accuracy")] == [0, 3]
        assert len(read_scalars(run, f"val/{source}/reward")) == 2
    overall = dict(read_scalars(run, "val/reward"))
    add, double = dict(read_scalars(run, "val/add/reward")), dict(read_scalars(run, "val/double/reward"))
    for at in (0, 3):  # 3 "add" and 3 "double" rows: the overall mean is their mean
        # TensorBoard keeps float32 scalars: three logged means of rewards ≤ 1.5, each rounded by ≤ 0.5
        # ulp(1.5) = 1.2e-7, and the regrouped means by as much: ≲ 5e-7 → 1e-6
        assert overall[at] == pytest.approx((add[at] + double[at]) / 2, abs=1e-6)


@pytest.mark.slow
def test_trl_jsonl_trains_with_trl_reward_functions(chat_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv(CALLS_ENV, str(calls))
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{a}="}], "solution": str(2 * a), "level": a % 3}
        for a in range(12)
    ]
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    val.write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    reward = {"fn": [f"{__name__}:trl_accuracy_reward", f"{__name__}:trl_length_reward"]}
    run = _fit(tmp_path, chat_model_dir, train, val, "solution", reward)

    first = _calls(calls)[0]
    assert {"completions", "solution", "level", "prompts", "completion_ids", "answer"} <= set(first)
    assert first["first"]["solution"] == first["first"]["answer"]
    lengths = dict(read_scalars(run, "reward/fn/trl_length_reward/mean"))
    accuracy = dict(read_scalars(run, "reward/fn/trl_accuracy_reward/mean"))
    total = dict(read_scalars(run, "reward/mean"))
    assert sorted(total) == sorted(lengths) == sorted(accuracy) and len(total) == 3
    for step in total:  # weights 1 and 1: the step's mean is the sum of the functions' means
        # three float32 scalars ≤ ~4 (a length / 5 plus 0 or 1), each rounded by ≤ 0.5 ulp(4) = 2.4e-7
        assert total[step] == pytest.approx(lengths[step] + accuracy[step], abs=1e-6)


def two_values_per_call(completions, **kwargs):
    """Breaks the contract: two values whatever the number of completions."""
    return [1.0, 0.0]


def test_a_reward_breaking_the_contract_ends_the_run_with_one_line(
    chat_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "argv", ["lit-offpolicy"])
    monkeypatch.delenv("LIT_OFFPOLICY_TRACEBACK", raising=False)
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = CONFIG
    values = {"LOGS": str(tmp_path / "logs"), "MODEL": chat_model_dir, "TRAIN": str(train), "VAL": str(train)}
    values |= {"ANSWER_KEY": "answer", "REWARD": json.dumps({"fn": f"{__name__}:two_values_per_call"})}
    for name, value in values.items():
        config = config.replace(name, value)
    (tmp_path / "bad.yaml").write_text(config)
    error = fit_fails_with_one_line(["fit", "--config", str(tmp_path / "bad.yaml")], capsys)
    assert error == (
        "lit-offpolicy: error: reward.fn: reward 'two_values_per_call' returned 2 values for 1 completions; "
        "expected one float or None per completion"
    )
