"""Tokenized examples for the supervised warm-up: prompt + answer + eos, the loss on the answer."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedTokenizerBase


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
