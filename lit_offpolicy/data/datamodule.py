"""Prompts for RL steps (``PromptDataModule``) and tokenized examples for the SFT warm-up.

Prompts come from a built-in task or from JSONL/Parquet files with a prompt and an answer column.
Batches are plain lists: ``{"prompt": [...], "answer": [...], "raw_prompt": [...], "columns": [...]}``
(``collate_prompts``): the prompt as the engine reads it (chat template applied), the answer as a
string, the prompt as the row held it, and the row's other columns (for the reward functions). The
rollout callback tokenizes the prompts (with ``add_special_tokens=datamodule.add_special_tokens``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_offpolicy.checks import check_choice, check_range
from lit_offpolicy.data.sampler import ResumableShuffleSampler
from lit_offpolicy.data.tasks import Problem, get_task
from lit_offpolicy.models import load_tokenizer

FILE_FORMATS = (".jsonl", ".parquet")
ON_BAD_DATA = ("error", "skip")


class PromptDataModule(LightningDataModule):
    """Prompt/answer pairs for RL: a built-in ``task`` or ``train_files``/``val_files`` (JSONL or Parquet).

    With ``train_files`` the task is ignored, and validation uses ``val_files`` only (none: no
    validation). ``prompt_key`` and ``answer_key`` name the fields; a dotted key reaches a nested one
    (``answer_key: reward_model.ground_truth`` for verl's layout, a struct column in parquet).
    ``train_file_weights`` mixes the train files in proportion (``mix_files``: the same rows every
    epoch; a file smaller than its share repeats). Without files, ``task`` gives both splits.
    ``num_train_samples``/``num_val_samples`` cap the prompts taken (None: all of them; a task's
    validation set is at most its held-out pool).
    Prompts longer than ``max_prompt_length`` tokens are then dropped and counted in ``num_filtered``.
    A bad row of a file (not UTF-8, not JSON, not an object, a missing or mistyped field, an empty
    prompt) stops ``setup`` with a ``ValueError`` naming the file and line (``on_bad_data="error"``),
    or is skipped and counted in ``num_skipped`` (``"skip"``). Both counts are logged at set-up as
    ``data/skipped_{split}`` and ``data/filtered_long_{split}``.
    The training loader is finite (one pass over the prompts, reshuffled every epoch, incomplete last
    batch dropped); Lightning starts new epochs until ``Trainer(max_steps=...)`` is reached, so any
    number of steps works. A tokenizer is needed before ``setup``: ``tokenizer_path``, or
    ``set_tokenizer`` from the trainer.
    """

    def __init__(
        self,
        task: str | None = "addition",
        train_files: list[str] | None = None,
        train_file_weights: list[float] | None = None,
        val_files: list[str] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        tokenizer_path: str | None = None,
        max_prompt_length: int = 64,
        apply_chat_template: bool = True,
        batch_size: int = 64,
        val_batch_size: int = 256,
        num_train_samples: int | None = None,
        num_val_samples: int | None = 256,
        seed: int = 0,
        num_workers: int = 0,
        on_bad_data: str = "error",
    ):
        super().__init__()
        if task is None and not train_files:
            raise ValueError("PromptDataModule needs a task or train_files")
        if task is not None and not train_files:
            get_task(task)
        for path in [*(train_files or []), *(val_files or [])]:
            check_choice(f"file suffix of {path}", Path(path).suffix, FILE_FORMATS)
        if train_file_weights is not None:
            if len(train_file_weights) != len(train_files or []):
                raise ValueError(
                    f"train_file_weights has {len(train_file_weights)} values for {len(train_files or [])} "
                    "train_files; give one weight per file"
                )
            for weight in train_file_weights:
                check_range("train_file_weights", weight, low=0.0, low_inclusive=False)
        check_range("max_prompt_length", max_prompt_length, low=1)
        check_range("batch_size", batch_size, low=1)
        check_range("val_batch_size", val_batch_size, low=1)
        check_range("num_workers", num_workers, low=0)
        check_choice("on_bad_data", on_bad_data, ON_BAD_DATA)
        for option, value in (("num_train_samples", num_train_samples), ("num_val_samples", num_val_samples)):
            if value is not None:
                check_range(option, value, low=1)
        self.save_hyperparameters()
        self.task = task
        self.train_files = train_files
        self.train_file_weights = train_file_weights
        self.val_files = val_files
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.tokenizer_path = tokenizer_path
        self.max_prompt_length = max_prompt_length
        self.apply_chat_template = apply_chat_template
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.seed = seed
        self.num_workers = num_workers
        self.on_bad_data = on_bad_data
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.train_problems: list[Problem] | None = None
        self.val_problems: list[Problem] | None = None
        self.num_filtered: dict[str, int] = {}
        self.num_skipped: dict[str, int] = {"train": 0, "val": 0}

    def check_files(self) -> None:
        """Every train and val file exists, is a file, has rows and (with ``on_bad_data="error"``) a
        good first row: raises what reading it at ``setup`` would, at start-up (the CLI calls this
        before a model loads)."""
        for path in [*(self.train_files or []), *(self.val_files or [])]:
            check_first_row(path, self.prompt_key, self.answer_key, check_row=self.on_bad_data == "error")

    def set_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Use the trainer's tokenizer (instead of loading ``tokenizer_path``)."""
        self.tokenizer = tokenizer

    @property
    def add_special_tokens(self) -> bool:
        """How to tokenize the batch prompts: a chat template already holds its special tokens."""
        return not uses_chat_template(self._require_tokenizer(), self.apply_chat_template)

    def setup(self, stage: str | None = None) -> None:
        if self.train_problems is None and stage in ("fit", None):
            self.train_problems = self._prepare("train", self._raw_train())
            if len(self.train_problems) < self.batch_size:
                count, dropped = len(self.train_problems), self.num_filtered["train"]
                why = (
                    f" ({dropped} longer than max_prompt_length={self.max_prompt_length} tokens)"
                    if dropped
                    else ""
                )
                raise ValueError(
                    f"only {count} training prompts{why}, fewer than batch_size={self.batch_size}"
                )
        if self.val_problems is None and stage in ("fit", "validate", None):
            self.val_problems = self._prepare("val", self._raw_val())
        self._log_counts()

    def _log_counts(self) -> None:
        if self.trainer is None:
            return
        counts = {f"data/skipped_{split}": float(n) for split, n in self.num_skipped.items()}
        counts.update({f"data/filtered_long_{split}": float(n) for split, n in self.num_filtered.items()})
        for logger in self.trainer.loggers:
            logger.log_metrics(counts, step=0)

    def train_dataloader(self) -> DataLoader:
        """Shuffled anew each epoch from (seed, epoch); a resumed run continues its epoch's order.

        Under data parallelism each rank gets its own share of the prompts (``ResumableShuffleSampler``):
        ``batch_size`` is per rank, so one RL step trains on ``batch_size × world_size`` prompts.
        """
        num_replicas, rank = self._replicas()
        per_rank = len(self.train_problems) // num_replicas
        if per_rank < self.batch_size:
            raise ValueError(
                f"{len(self.train_problems)} training prompts shared by {num_replicas} ranks leave "
                f"{per_rank} per rank, fewer than batch_size={self.batch_size}"
            )
        sampler = ResumableShuffleSampler(len(self.train_problems), self.seed, num_replicas, rank)
        if self.trainer is not None:
            # batches whose training step ran; a checkpoint saved in on_train_batch_end has not yet
            # counted its batch as "completed", but has as "processed"
            done_this_epoch = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            sampler.skip_once(done_this_epoch * self.batch_size)
        return DataLoader(
            self.train_problems,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_prompts,
            num_workers=self.num_workers,
        )

    def _replicas(self) -> tuple[int, int]:
        """(world size, this rank) of the attached trainer; (1, 0) without one."""
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)

    def val_dataloader(self) -> DataLoader | list:
        """In order, without shuffling. Under data parallelism rank r of W gets problems r, r + W, …:
        ``lit_offpolicy.evaluation.evaluate`` sums the counts over the ranks, so the whole set is
        validated once, W times faster, and every rank gets the same metrics."""
        if not self.val_problems:
            return []
        num_replicas, rank = self._replicas()
        return DataLoader(
            self.val_problems[rank::num_replicas],
            batch_size=self.val_batch_size,
            collate_fn=collate_prompts,
            num_workers=self.num_workers,
        )

    def _raw_train(self) -> list[Problem]:
        if self.train_files:
            per_file = self._read_files("train", self.train_files)
            if self.train_file_weights is not None:
                return mix_files(per_file, self.train_file_weights, self.num_train_samples, self.seed)
            return [problem for problems in per_file for problem in problems][: self.num_train_samples]
        task = get_task(self.task)
        return task.train(self.num_train_samples or task.epoch_size, seed=self.seed)

    def _raw_val(self) -> list[Problem]:
        if self.val_files:
            return [p for problems in self._read_files("val", self.val_files) for p in problems][
                : self.num_val_samples
            ]
        if self.train_files:
            return []
        task = get_task(self.task)
        return task.val(min(self.num_val_samples or task.val_size, task.val_size), seed=self.seed)

    def _read_files(self, split: str, paths: list[str]) -> list[list[Problem]]:
        """Each file's good rows (bad ones skipped and counted, or raised: ``on_bad_data``)."""
        per_file, bad = [], []
        for path in paths:
            file_problems, file_bad = read_file(path, self.prompt_key, self.answer_key, self.on_bad_data)
            per_file.append(file_problems)
            bad += file_bad
        self.num_skipped[split] = len(bad)
        if bad:
            rank_zero_warn(f"skipped {len(bad)} bad {split} rows (on_bad_data='skip'); the first: {bad[0]}")
        return per_file

    def _prepare(self, split: str, problems: list[Problem]) -> list[Problem]:
        self.num_filtered[split] = 0
        if not problems:
            return []
        tokenizer = self._require_tokenizer()
        prompts = [format_prompt(tokenizer, p["prompt"], self.apply_chat_template) for p in problems]
        lengths = [
            len(ids) for ids in tokenizer(prompts, add_special_tokens=self.add_special_tokens).input_ids
        ]
        kept = [
            {**problem, "prompt": prompt, "raw_prompt": problem["prompt"]}
            for prompt, problem, length in zip(prompts, problems, lengths, strict=True)
            if length <= self.max_prompt_length
        ]
        self.num_filtered[split] = len(problems) - len(kept)
        if self.num_filtered[split]:
            rank_zero_warn(
                f"dropped {self.num_filtered[split]} of {len(problems)} {split} prompts longer than "
                f"max_prompt_length={self.max_prompt_length} tokens"
            )
        return kept

    def _require_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            if self.tokenizer_path is None:
                raise ValueError(
                    "PromptDataModule needs a tokenizer: set tokenizer_path or call set_tokenizer()"
                )
            self.tokenizer = load_tokenizer(self.tokenizer_path)
        return self.tokenizer


def mix_files(
    per_file: list[list[Problem]], weights: list[float], size: int | None, seed: int
) -> list[Problem]:
    """Training rows from several files in proportion to ``weights``: of ``size`` rows (None: as many
    as the files hold together) file i gives round(size · w_i / Σw), its rows in a seeded random
    order, repeated where the file has fewer (as ``interleave_datasets`` with probabilities gives
    in expectation, but exactly)."""
    size = sum(len(problems) for problems in per_file) if size is None else size
    total = sum(weights)
    mixed = []
    for index, (problems, weight) in enumerate(zip(per_file, weights, strict=True)):
        count = round(size * weight / total)
        if count and not problems:
            raise ValueError(f"train_files[{index}] has no rows but train_file_weights[{index}]={weight}")
        order = list(range(len(problems)))
        random.Random(f"mix/{seed}/{index}").shuffle(order)
        mixed += [problems[order[i % len(order)]] for i in range(count)]
    return mixed


def collate_prompts(problems: list[Problem]) -> dict[str, list]:
    """A batch of problems as lists: ``prompt``, ``answer``, ``raw_prompt`` (the prompt as its row
    held it; the prompt itself where set-up did not render it) and ``columns`` (the row's other
    columns; ``{}`` for a built-in task's problem)."""
    return {
        "prompt": [p["prompt"] for p in problems],
        "answer": [p["answer"] for p in problems],
        "raw_prompt": [p.get("raw_prompt", p["prompt"]) for p in problems],
        "columns": [p.get("columns", {}) for p in problems],
    }


def batch_problems(batch: dict[str, list]) -> list[Problem]:
    """The problems of a batch (``collate_prompts``'s inverse; a batch may lack the optional lists)."""
    count = len(batch["prompt"])
    raw = batch.get("raw_prompt", batch["prompt"])
    columns = batch.get("columns", [{}] * count)
    return [
        {"prompt": prompt, "answer": answer, "raw_prompt": raw[i], "columns": columns[i]}
        for i, (prompt, answer) in enumerate(zip(batch["prompt"], batch["answer"], strict=True))
    ]


def prompt_special_tokens(datamodule: PromptDataModule | None) -> bool:
    """``add_special_tokens`` for a batch's prompts: as the data module formatted them, True without one."""
    return datamodule.add_special_tokens if datamodule is not None else True


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool) -> bool:
    return apply_chat_template and bool(getattr(tokenizer, "chat_template", None))


def format_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict], apply_chat_template: bool = True
) -> str:
    """A string prompt as a user turn of the tokenizer's chat template, or unchanged when there is
    none; a list of chat messages (system prompt included) rendered by the template, which it needs.
    Both end with the template's generation prompt (the assistant turn's opening)."""
    if isinstance(prompt, list):
        if not uses_chat_template(tokenizer, apply_chat_template):
            has_template = getattr(tokenizer, "chat_template", None)
            why = "apply_chat_template=False" if has_template else "the tokenizer has no chat template"
            raise ValueError(f"prompts given as chat messages need the tokenizer's chat template: {why}")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if not uses_chat_template(tokenizer, apply_chat_template):
        return prompt
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def read_problems(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Prompt/answer rows of a JSONL or Parquet file (by suffix); answers are kept as strings.

    A bad row raises a ``ValueError`` naming the file and line; :func:`read_file` can skip them.
    """
    return read_file(path, prompt_key, answer_key, on_bad_data="error")[0]


def read_file(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", on_bad_data: str = "error"
) -> tuple[list[Problem], list[str]]:
    """The good rows of a prompt file, and one message (file, line, what is wrong) per skipped bad row.

    ``on_bad_data="error"`` raises the first bad row's message as a ``ValueError`` instead.
    """
    check_choice("on_bad_data", on_bad_data, ON_BAD_DATA)
    path = Path(path)
    problems, bad = [], []
    for where, row in _rows(path, prompt_key, answer_key):
        try:
            problems.append(_problem(row, prompt_key, answer_key, path, where))
        except ValueError as error:
            if on_bad_data == "error":
                raise
            bad.append(str(error))
    return problems, bad


def check_first_row(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", check_row: bool = True
) -> None:
    """Raise what ``read_file`` would about a file that is missing, is not a file, has no rows, or
    (``check_row``) whose first row is bad, reading only that row (a start-up check, before a model
    loads). ``check_row=False`` where bad rows are to be skipped."""
    path = Path(path)
    first = next(iter(_rows(path, prompt_key, answer_key)), None)
    if first is None:
        raise ValueError(f"prompt file {path} has no rows")
    if check_row:
        _problem(first[1], prompt_key, answer_key, path, first[0])


def _rows(path: Path, prompt_key: str, answer_key: str) -> Iterator[tuple[str, object]]:
    """A prompt file's rows, each with where it is ("line 3", "row 3"), read lazily."""
    suffix = check_choice(f"file suffix of {path}", path.suffix, FILE_FORMATS)
    if path.is_dir():
        raise IsADirectoryError(f"prompt file {path} is a directory; name the files in it")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    return _read_jsonl(path) if suffix == ".jsonl" else _read_parquet(path, [prompt_key, answer_key])


class _Unreadable(str):
    """A JSONL line that is not UTF-8 or not JSON: the reason, raised when the row is read."""


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield f"line {number}", _Unreadable(f"not valid UTF-8 ({error})")
                continue
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as error:
                yield f"line {number}", _Unreadable(f"not valid JSON ({error})")


def _read_parquet(path: Path, columns: list[str]) -> Iterator[tuple[str, object]]:
    """The rows with all their columns, read batch by batch; a missing one of ``columns`` (the
    prompt's and the answer's) raises before any row."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ImportError(f"reading {path} needs pyarrow; install it or convert the file to JSONL") from error
    schema_names = pq.read_schema(path).names
    # a dotted key names a field inside a struct column: read that column
    columns = list(dict.fromkeys(c if c in schema_names else c.split(".")[0] for c in columns))
    missing = [column for column in columns if column not in schema_names]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}; columns: {', '.join(schema_names)}")
    return _parquet_batches(pq.ParquetFile(path))


def _parquet_batches(file) -> Iterator[tuple[str, object]]:
    index = 0
    for batch in file.iter_batches():
        for row in batch.to_pylist():
            index += 1
            yield f"row {index}", row


def _problem(row: object, prompt_key: str, answer_key: str, path: Path, where: str) -> Problem:
    if isinstance(row, _Unreadable):
        raise ValueError(f"{path}, {where}: {row}")
    if not isinstance(row, dict):
        raise ValueError(f"{path}, {where}: expected a JSON object, got {type(row).__name__}")
    prompt, answer = (_field(row, key, f"{path}, {where}") for key in (prompt_key, answer_key))
    if isinstance(prompt, list):
        _check_messages(prompt, f"{path}, {where}: field {prompt_key!r}")
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{path}, {where}: field {prompt_key!r} must be a string or a list of chat messages, "
            f"got {prompt!r}"
        )
    elif not prompt.strip():
        raise ValueError(f"{path}, {where}: field {prompt_key!r} is empty")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{path}, {where}: field {answer_key!r} must be a string or number, got {answer!r}")
    columns = {name: value for name, value in row.items() if name != prompt_key}
    return {"prompt": prompt, "answer": str(answer), "columns": columns}


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(messages: list, where: str) -> None:
    """A chat prompt: a non-empty list of ``{"role": ..., "content": str}`` with known roles."""
    if not messages:
        raise ValueError(f"{where} is an empty list of messages")
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES or not isinstance(message.get("content"), str):
            allowed = ", ".join(repr(r) for r in CHAT_ROLES)
            raise ValueError(
                f"{where}, message {index}: expected {{'role': one of {allowed}, 'content': a string}}, "
                f"got {message!r}"
            )


def _field(row: dict, key: str, where: str) -> object:
    """``row[key]``; a dotted key (``reward_model.ground_truth``, verl's layout) that is not itself a
    field reaches into nested objects."""
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{where}: missing field {key!r}")
        value = value[part]
    return value


def sft_examples(
    prompts: list[str],
    answers: list[str],
    tokenizer: PreTrainedTokenizerBase,
    add_special_tokens: bool = True,
) -> list[dict[str, Tensor]]:
    """Token ids of prompt + answer + eos, with ``loss_mask`` true on the answer and eos tokens only.

    ``prompts`` are final text (chat template already applied, as the data module's batches are);
    ``add_special_tokens`` is how to tokenize them (``PromptDataModule.add_special_tokens``).
    ``loss_mask[i]`` marks token ``i`` as a target: the loss is on predicting ``input_ids[:, 1:]``
    from ``logits[:, :-1]``, weighted by ``loss_mask[:, 1:]``.
    """
    prompt_ids = tokenizer(list(prompts), add_special_tokens=add_special_tokens).input_ids
    answer_ids = tokenizer(list(answers), add_special_tokens=False).input_ids
    return [
        {
            "input_ids": torch.tensor([*p, *a, tokenizer.eos_token_id]),
            "loss_mask": torch.tensor([False] * len(p) + [True] * (len(a) + 1)),
        }
        for p, a in zip(prompt_ids, answer_ids, strict=True)
    ]


def collate_sft(examples: list[dict[str, Tensor]], pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` for a list of SFT examples."""
    input_ids = [e["input_ids"] for e in examples]
    return {
        "input_ids": pad_sequence(input_ids, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(ids) for ids in input_ids], batch_first=True),
        "loss_mask": pad_sequence([e["loss_mask"] for e in examples], batch_first=True),
    }
