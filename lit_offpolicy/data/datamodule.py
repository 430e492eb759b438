"""Prompts for RL steps: ``PromptDataModule``, from a built-in task or prompt files.

Batches are plain lists: ``{"prompt": [...], "answer": [...], "raw_prompt": [...], "columns": [...]}``
(``collate_prompts``): the prompt as the engine reads it (chat template applied), the answer as a
string, the prompt as the row held it, and the row's other columns (for the reward functions). The
rollout callback tokenizes the prompts (with ``add_special_tokens=datamodule.add_special_tokens``).
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.data.files import FILE_FORMATS, ON_BAD_DATA, check_first_row, mix_files, read_file
from lit_offpolicy.data.prompts import collate_prompts, format_prompt, token_counts, uses_chat_template
from lit_offpolicy.data.sampler import ResumableShuffleSampler
from lit_offpolicy.data.tasks import Problem, get_task
from lit_offpolicy.models import load_tokenizer


class PromptDataModule(LightningDataModule):
    """Prompt/answer pairs for RL: a built-in ``task`` or ``train_files``/``val_files`` (JSONL or Parquet).

    Skipped rows and dropped prompts are logged at set-up (``data/skipped_{split}``,
    ``data/filtered_long_{split}``). Each epoch is one reshuffled pass over the training prompts, its
    incomplete last batch dropped, until ``max_steps``. In full: docs/data.md.

    Args:
        task: a built-in task, which gives both splits; ignored with ``train_files``.
        train_files: JSONL or Parquet files of training rows.
        train_file_weights: mix the train files in these proportions (a smaller file repeats).
        val_files: validation files; with ``train_files``, None means no validation.
        prompt_key: the prompt's field; a dotted key reaches a nested one.
        answer_key: the answer's field (``reward_model.ground_truth`` for verl's layout).
        tokenizer_path: the tokenizer's directory; None: the one ``set_tokenizer`` gives before ``setup``.
        max_prompt_length: longer prompts (in tokens, as rendered) are dropped.
        apply_chat_template: render string prompts as a user turn of the tokenizer's chat template.
        batch_size: prompts per RL step, per process.
        val_batch_size: prompts per validation batch.
        num_train_samples: at most this many training prompts; None: all.
        num_val_samples: at most this many validation prompts; None: all (a task's: its held-out pool).
        seed: seeds the shuffle, the files' mix and the task's sample of problems.
        num_workers: the loaders' worker processes.
        on_bad_data: a bad file row (not UTF-8 or JSON, a missing field, an empty prompt): "error" stops
            ``setup`` naming the file and line; "skip" skips and counts it.
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
        ``lit_offpolicy.rollout.evaluation.evaluate`` sums the counts over the ranks, so the whole set is
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
        lengths = token_counts(tokenizer, prompts, self.add_special_tokens)
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


def prompt_special_tokens(datamodule: PromptDataModule | None) -> bool:
    """``add_special_tokens`` for a batch's prompts: as the data module formatted them, True without one."""
    return datamodule.add_special_tokens if datamodule is not None else True
