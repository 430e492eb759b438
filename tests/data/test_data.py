import json
import re
from collections import Counter

import lightning.pytorch as pl
import pytest
import torch

from lit_offpolicy.data import (
    TASKS,
    PromptDataModule,
    collate_sft,
    get_task,
    read_problems,
    sft_examples,
)
from lit_offpolicy.data.prompts import token_counts
from lit_offpolicy.models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_is_deterministic_correct_and_split_disjoint(name):
    task = get_task(name)
    assert task.train(50, seed=3) == task.train(50, seed=3) != task.train(50, seed=4)
    assert task.val(50, seed=3) == task.val(50, seed=3)
    train_prompts = {p["prompt"] for p in task.train(task.epoch_size)}
    val_prompts = {p["prompt"] for p in task.val(task.val_size)}
    assert len(train_prompts) == task.train_size and len(val_prompts) == task.val_size
    assert not train_prompts & val_prompts
    for problem in task.train(200) + task.val(200):
        assert problem["prompt"].endswith("=")
        assert int(problem["answer"]) == eval(problem["prompt"][:-1])  # prompts are plain arithmetic


def test_addition_epoch_holds_each_problem_four_times_per_one_digit_operand():
    task = get_task("addition")
    epoch = Counter(p["prompt"] for p in task.train(task.epoch_size, seed=5))
    assert len(epoch) == task.train_size  # every training problem, none of the held-out ones
    for prompt, count in epoch.items():
        one_digit = sum(len(operand) == 1 for operand in prompt[:-1].split("+"))
        assert count == 4**one_digit, prompt
    # the hash split keeps 7278 two-digit pairs, 805 + 808 with one one-digit operand and 84 with two
    assert task.epoch_size == 7278 + 4 * (805 + 808) + 16 * 84


def test_task_train_repeats_the_pool_beyond_its_size_and_val_refuses_to():
    task = get_task("multistep")
    problems = task.train(task.train_size + 10)
    assert len(problems) == task.train_size + 10
    assert len({p["prompt"] for p in problems}) == task.train_size
    with pytest.raises(ValueError, match="390 validation problems; asked for 391"):
        task.val(task.val_size + 1)


def test_unknown_task_lists_the_names():
    with pytest.raises(ValueError, match="task='nope'.*'addition', 'multistep'"):
        get_task("nope")
    with pytest.raises(ValueError, match="task='nope'"):
        PromptDataModule(task="nope")


def test_datamodule_on_a_task_yields_string_batches(tokenizer):
    datamodule = PromptDataModule(
        task="addition", batch_size=8, val_batch_size=32, num_val_samples=40, seed=1
    )
    datamodule.set_tokenizer(tokenizer)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "raw_prompt", "columns"}
    assert all(len(values) == 8 for values in batch.values())
    assert all(isinstance(text, str) for text in batch["prompt"] + batch["answer"])
    assert batch["raw_prompt"] == batch["prompt"]  # no chat template: the prompt as the task wrote it
    assert batch["columns"] == [{}] * 8  # a task's rows have no other columns
    assert len(datamodule.train_dataloader()) == get_task("addition").epoch_size // 8
    assert [len(b["prompt"]) for b in datamodule.val_dataloader()] == [32, 8]
    assert datamodule.num_filtered == {"train": 0, "val": 0}
    assert datamodule.add_special_tokens


def test_training_loader_reshuffles_each_epoch_and_is_reproducible(tokenizer):
    def first_batches():
        datamodule = PromptDataModule(task="addition", batch_size=4, num_train_samples=8, seed=0)
        datamodule.set_tokenizer(tokenizer)
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
        batches = []
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)  # as Lightning does at the start of every epoch
            batches += [batch["prompt"] for batch in loader]
        return batches

    epochs = first_batches()
    assert epochs == first_batches()
    assert sorted(epochs[0] + epochs[1]) == sorted(epochs[2] + epochs[3])
    assert epochs[:2] != epochs[2:4]


class CountingModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_prompts = 0
        self.val_prompts = 0

    def training_step(self, batch, batch_idx):
        self.train_prompts += len(batch["prompt"])
        return (self.weight**2).sum()

    def validation_step(self, batch, batch_idx):
        self.val_prompts += len(batch["prompt"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("with_val", [True, False])
def test_trainer_runs_max_steps_past_one_epoch(tmp_path, tokenizer, with_val):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    datamodule = PromptDataModule(
        train_files=[write_jsonl(tmp_path / "train.jsonl", rows)],
        val_files=[write_jsonl(tmp_path / "val.jsonl", rows[:3])] if with_val else None,
        batch_size=4,
    )
    datamodule.set_tokenizer(tokenizer)
    module = CountingModule()
    trainer = pl.Trainer(
        max_steps=7,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 7 and module.train_prompts == 28  # 2 batches an epoch: 3.5 epochs
    assert module.val_prompts == (3 * 3 if with_val else 0)  # after each of the 3 complete epochs


def test_jsonl_and_parquet_files_with_custom_keys(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "1+2=", "solution": 3}, {"question": "4*5=", "solution": 20}]
    jsonl = write_jsonl(tmp_path / "train.jsonl", [rows[0], {"question": "4*5=", "solution": "20"}])
    parquet = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)  # an int64 answer column
    expected = [
        {"prompt": "1+2=", "answer": "3", "columns": {"solution": 3}},
        {"prompt": "4*5=", "answer": "20", "columns": {"solution": "20"}},
    ]
    assert read_problems(jsonl, "question", "solution") == expected
    expected[1]["columns"]["solution"] = 20  # as parquet stores it
    assert read_problems(parquet, "question", "solution") == expected
    datamodule = PromptDataModule(
        train_files=[jsonl, str(parquet)],
        val_files=[str(parquet)],
        prompt_key="question",
        answer_key="solution",
        batch_size=4,
    )
    datamodule.set_tokenizer(tokenizer)
    datamodule.setup("fit")
    pairs = [(p["prompt"], p["answer"]) for p in expected]
    assert [(p["prompt"], p["answer"]) for p in datamodule.train_problems] == pairs + pairs
    assert datamodule.val_problems == [{**p, "raw_prompt": p["prompt"]} for p in expected]


def test_a_dotted_key_reaches_a_nested_field_in_jsonl_and_parquet(tmp_path):
    """verl's layout keeps the answer in ``reward_model.ground_truth`` (a struct column in parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "1+2=", "reward_model": {"ground_truth": "3", "style": "rule"}, "data_source": "a"},
        {"prompt": "4*5=", "reward_model": {"ground_truth": "20", "style": "rule"}, "data_source": "b"},
    ]
    jsonl = write_jsonl(tmp_path / "verl.jsonl", rows)
    parquet = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    expected = [
        {"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"], "columns": r} for r in rows
    ]
    for row in rows:
        del row["prompt"]  # every column but the prompt's, nested ones as they are
    for path in (jsonl, parquet):
        assert read_problems(path, answer_key="reward_model.ground_truth") == expected
    # a field whose own name has a dot is taken as it is
    dotted = write_jsonl(tmp_path / "dotted.jsonl", [{"prompt": "1+1=", "a.b": "2", "a": {"b": "9"}}])
    assert [p["answer"] for p in read_problems(dotted, answer_key="a.b")] == ["2"]
    with pytest.raises(ValueError, match=f"{jsonl}, line 1: missing field 'reward_model.answer'"):
        read_problems(jsonl, answer_key="reward_model.answer")
    with pytest.raises(ValueError, match=f"{parquet}, row 1: missing field 'reward_model.answer'"):
        read_problems(parquet, answer_key="reward_model.answer")
    with pytest.raises(ValueError, match=f"{parquet}: no column 'extra_info'"):
        read_problems(parquet, answer_key="extra_info.answer")


def test_parquet_without_the_answer_column_names_file_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1="}]), path)
    with pytest.raises(ValueError, match=f"{path}: no column 'answer'; columns: prompt"):
        read_problems(path)


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 4 + [{"prompt": "1+" * 10 + "1=", "answer": "11"}] * 3
    datamodule = PromptDataModule(
        train_files=[write_jsonl(tmp_path / "t.jsonl", rows)], max_prompt_length=5, batch_size=2
    )
    datamodule.set_tokenizer(tokenizer)
    with pytest.warns(UserWarning, match="dropped 3 of 7 train prompts longer than max_prompt_length=5"):
        datamodule.setup("fit")
    assert len(datamodule.train_problems) == 4  # "1+1=" is 5 tokens with <bos>
    assert datamodule.num_filtered == {"train": 3, "val": 0}
    assert datamodule.val_dataloader() == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": 4\n', "line 3: not valid JSON"),
        (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', "line 2: missing field 'answer'"),
        (
            b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff", "answer": "2"}\n',
            "line 2: not valid UTF-8",
        ),
        (b'["1+1=", "2"]\n', "line 1: expected a JSON object, got list"),
        (b'{"prompt": 5, "answer": "2"}\n', "line 1: field 'prompt' must be a string"),
        (b'{"prompt": "1+1=", "answer": null}\n', "line 1: field 'answer' must be a string or number"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}, {message}"):
        read_problems(path)


def test_bad_settings_are_refused_early(tmp_path):
    with pytest.raises(ValueError, match="needs a task or train_files"):
        PromptDataModule(task=None)
    with pytest.raises(ValueError, match="'.csv' is not supported; allowed values: '.jsonl', '.parquet'"):
        PromptDataModule(train_files=["prompts.csv"])
    with pytest.raises(ValueError, match="batch_size=0 is out of range"):
        PromptDataModule(batch_size=0)
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        read_problems(tmp_path / "missing.jsonl")


def test_setup_needs_a_tokenizer_and_enough_prompts(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="set tokenizer_path or call set_tokenizer"):
        PromptDataModule().setup("fit")
    datamodule = PromptDataModule(
        train_files=[write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1=", "answer": "1"}])]
    )
    datamodule.set_tokenizer(tokenizer)
    with pytest.raises(ValueError, match="only 1 training prompts, fewer than batch_size=64"):
        datamodule.setup("fit")


def test_tokenizer_path_and_chat_template(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    datamodule = PromptDataModule(tokenizer_path=str(tmp_path), batch_size=2, num_train_samples=2, seed=5)
    datamodule.setup("fit")
    assert all(p["prompt"].startswith("<bos>") for p in datamodule.train_problems)
    assert not datamodule.add_special_tokens
    plain = PromptDataModule(
        tokenizer_path=str(tmp_path), apply_chat_template=False, batch_size=2, num_train_samples=2, seed=5
    )
    plain.setup("fit")
    assert [p["prompt"] for p in datamodule.train_problems] == [
        "<bos>" + p["prompt"] for p in plain.train_problems
    ]


ROLE_TEMPLATE = (
    "<bos>{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_chat_message_prompts_are_rendered_with_the_chat_template(tmp_path):
    """TRL's conversational ``prompt`` (and verl's): a list of messages, a system prompt included,
    rendered with the generation prompt; string prompts in the same file stay user turns."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ROLE_TEMPLATE
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    rows = [{"prompt": chat, "answer": "3"}, {"prompt": "4+5=", "answer": "9"}]
    datamodule = PromptDataModule(train_files=[write_jsonl(tmp_path / "chat.jsonl", rows)], batch_size=2)
    datamodule.set_tokenizer(tokenizer)
    datamodule.setup("fit")
    assert [p["prompt"] for p in datamodule.train_problems] == ["<bos>s:Add.\nu:1+2=\na:", "<bos>u:4+5=\na:"]
    assert read_problems(tmp_path / "chat.jsonl")[0]["prompt"] == chat  # kept as messages until set-up


UNKNOWN_ROLE = [{"role": "user", "content": "1+1="}, {"role": "robot", "content": "hi"}]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], " is an empty list of messages"),
        (UNKNOWN_ROLE, ", message 1: expected {'role': one of 'system', 'user', 'assistant', 'tool',"),
        ([{"role": "user", "content": 5}], ", message 0: expected"),
        ([{"content": "1+1="}], ", message 0: expected"),
    ],
)
def test_bad_chat_messages_name_file_line_and_message(tmp_path, prompt, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": prompt, "answer": "2"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 1: field 'prompt'{message}")):
        read_problems(path)


def test_chat_messages_without_a_chat_template_are_refused(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}] * 2
    datamodule = PromptDataModule(train_files=[write_jsonl(tmp_path / "chat.jsonl", rows)], batch_size=2)
    datamodule.set_tokenizer(tokenizer)  # the built-in tokenizer has no chat template
    with pytest.raises(
        ValueError, match="chat messages need the tokenizer's chat template: the tokenizer has no"
    ):
        datamodule.setup("fit")


def test_token_counts_are_the_tokenizers_lengths_whatever_its_last_call_set():
    """The backend's counts equal ``tokenizer(texts)``'s: with and without special tokens, special
    tokens written in the text (one token each, or split where the tokenizer splits them), an empty
    text; after a call that truncated or padded (the backend keeps that state), the tokenizer's own
    call counts, and in full."""
    tokenizer = build_tokenizer()
    texts = ["12+7=", "<bos>3+4=<eos>", "", "a long prompt " * 20]

    def expected(add_special_tokens):
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=add_special_tokens).input_ids]

    for add_special_tokens in (True, False):
        assert token_counts(tokenizer, texts, add_special_tokens) == expected(add_special_tokens)
    assert token_counts(tokenizer, ["<bos>"], False) == [1]
    tokenizer(texts, truncation=True, max_length=3, padding="max_length")
    assert tokenizer.backend_tokenizer.truncation is not None  # the state the counts must not inherit
    assert token_counts(tokenizer, texts, True) == expected(True)
    assert max(token_counts(tokenizer, texts, True)) > 3
    tokenizer.split_special_tokens = True
    assert token_counts(tokenizer, texts, False) == expected(False)
    assert token_counts(tokenizer, ["<bos>"], False)[0] > 1


def test_sft_examples_mask_only_answer_and_eos(tokenizer):
    examples = sft_examples(["1+2=", "10+20="], ["3", "30"], tokenizer)
    first = examples[0]
    assert tokenizer.decode(first["input_ids"]) == "<bos>1+2=3<eos>"
    assert first["loss_mask"].tolist() == [False] * 5 + [True, True]
    batch = collate_sft(examples, tokenizer.pad_token_id)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["loss_mask"].shape == (2, 10)
    assert batch["input_ids"][0, 7:].tolist() == [tokenizer.pad_token_id] * 3
    assert batch["attention_mask"][0].tolist() == [1] * 7 + [0] * 3
    assert batch["loss_mask"][1].tolist() == [False] * 7 + [True] * 3


def test_resumable_sampler_orders_by_seed_and_epoch_and_skips_once():
    from lit_offpolicy.data.sampler import ResumableShuffleSampler

    sampler = ResumableShuffleSampler(10, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and len(sampler) == 10
    assert list(ResumableShuffleSampler(10, seed=3)) == first  # the order depends on (seed, epoch) only
    sampler.set_epoch(1)
    second_epoch = list(sampler)
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first
    sampler.set_epoch(0)
    sampler.skip_once(4)
    assert list(sampler) == first[4:]  # a resumed epoch continues where the interrupted one stopped
    assert list(sampler) == first  # ... once


def test_the_start_up_check_leaves_a_bad_first_row_to_on_bad_data_skip(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"question": "1+1="}, {"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError, match="line 1: missing field 'prompt'"):
        PromptDataModule(train_files=[path]).check_files()
    PromptDataModule(train_files=[path], on_bad_data="skip").check_files()  # skipped at set-up
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="has no rows"):
        PromptDataModule(train_files=[str(empty)], on_bad_data="skip").check_files()


def test_train_files_mix_in_proportion_to_their_weights(tmp_path, tokenizer):
    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(3)])
    large = write_jsonl(
        tmp_path / "large.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(9)]
    )
    datamodule = PromptDataModule(train_files=[small, large], train_file_weights=[3.0, 1.0], batch_size=4)
    datamodule.set_tokenizer(tokenizer)
    datamodule.setup("fit")
    prompts = [p["prompt"] for p in datamodule.train_problems]
    # 12 rows in all: 3/4 of them (9) from the 3-row file, each of its rows 3 times; 3 from the other
    assert len(prompts) == 12
    assert sorted(p for p in prompts if p.endswith("+0=")) == sorted(["0+0=", "1+0=", "2+0="] * 3)
    from_large = [p for p in prompts if p.endswith("+1=")]
    assert len(from_large) == len(set(from_large)) == 3
    again = PromptDataModule(train_files=[small, large], train_file_weights=[3.0, 1.0], batch_size=4)
    again.set_tokenizer(tokenizer)
    again.setup("fit")
    assert [p["prompt"] for p in again.train_problems] == prompts, "seeded"
    capped = PromptDataModule(
        train_files=[small, large], train_file_weights=[1, 1], num_train_samples=4, batch_size=4
    )
    capped.set_tokenizer(tokenizer)
    capped.setup("fit")
    assert sorted(p["prompt"][-2] for p in capped.train_problems) == ["0", "0", "1", "1"]
    with pytest.raises(ValueError, match="train_file_weights has 1 values for 2 train_files"):
        PromptDataModule(train_files=[small, large], train_file_weights=[1.0])
    with pytest.raises(ValueError, match="train_file_weights=0.0 is out of range"):
        PromptDataModule(train_files=[small, large], train_file_weights=[1.0, 0.0])


def test_too_few_prompts_says_how_many_were_too_long(tokenizer):
    datamodule = PromptDataModule(task="addition", max_prompt_length=3, batch_size=4, num_train_samples=20)
    datamodule.set_tokenizer(tokenizer)
    with pytest.raises(
        ValueError, match=r"only \d+ training prompts \(\d+ longer than max_prompt_length=3 tokens\)"
    ):
        datamodule.setup("fit")
