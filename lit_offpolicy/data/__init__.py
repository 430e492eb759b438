"""Prompt data: built-in arithmetic tasks, JSONL/Parquet prompt files, SFT examples."""

from lit_offpolicy.data.datamodule import (
    PromptDataModule,
    batch_problems,
    collate_prompts,
    collate_sft,
    format_prompt,
    prompt_special_tokens,
    read_file,
    read_problems,
    sft_examples,
)
from lit_offpolicy.data.tasks import TASKS, Task, get_task

__all__ = [
    "TASKS",
    "PromptDataModule",
    "Task",
    "batch_problems",
    "collate_prompts",
    "collate_sft",
    "format_prompt",
    "prompt_special_tokens",
    "get_task",
    "read_file",
    "read_problems",
    "sft_examples",
]
