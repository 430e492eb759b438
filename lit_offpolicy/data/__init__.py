"""Prompt data: built-in arithmetic tasks (``tasks.py``), JSONL/Parquet prompt files (``files.py``),
prompts formatted for the engine (``prompts.py``), the data module (``datamodule.py``), SFT examples
(``sft.py``) and ``prepare-data`` (``prepare.py``)."""

from lit_offpolicy.data.datamodule import PromptDataModule, prompt_special_tokens
from lit_offpolicy.data.files import read_file, read_problems
from lit_offpolicy.data.prompts import batch_problems, collate_prompts, format_prompt
from lit_offpolicy.data.sft import collate_sft, sft_examples
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
