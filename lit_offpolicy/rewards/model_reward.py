"""``ModelReward``: a local sequence-classification model scores each prompt + completion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.rewards.contract import RewardContractError, completion_text
from lit_offpolicy.rewards.verifiers import REWARDS


@REWARDS.register("model")
class ModelReward:
    """The score a local ``AutoModelForSequenceClassification`` gives each prompt + completion.

    The text: the prompt's messages (a string prompt is one user message) and the completion as the
    assistant's reply, rendered by the tokenizer's chat template; without one, the prompt's text
    (messages' contents joined by newlines) then the completion's, with the special tokens. The
    score: ``logits[:, 0]`` for a model with one label (a reward model as TRL trains them); with two
    labels, the log-odds of label 1, ``logits[:, 1] - logits[:, 0]``. The model loads at the first
    call, so the object pickles cheaply. Run it with ``reward.timeout: null`` (in the trainer's
    process, in batches) or ``reward.start_method: spawn``: ``start_method: fork`` is refused.

    Args:
        model_path: a local model directory (config, weights, tokenizer).
        batch_size: texts per forward (with ``reward.timeout`` set, workers score one at a time).
        device: where the model runs; None: "cuda" (the current device) where there is one, else "cpu".
        max_length: longer texts lose their beginning (the score is read at the end).
    """

    # A torch model does not survive fork: CUDA cannot be used in a forked worker, and on a CPU the
    # forward hangs once the trainer has run torch's threads (as an in-process vLLM engine does).
    fork_safe = False
    """A worker forked from the trainer cannot run it: ``RewardConfig`` refuses ``start_method: fork``."""

    def __init__(
        self, model_path: str, batch_size: int = 8, device: str | None = None, max_length: int = 1024
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        if not Path(model_path).is_dir():  # a local directory only: nothing is downloaded
            raise ValueError(f"model_path={model_path!r} is not a directory; give a local model directory")
        try:  # read here, in the trainer, so that a wrong directory stops the run at start-up
            config = AutoConfig.from_pretrained(model_path, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"model_path={model_path!r} is not a Hugging Face model directory with a tokenizer ({error})"
            ) from None
        if config.num_labels not in (1, 2):
            raise ValueError(
                f"model_path={model_path!r} has {config.num_labels} labels; ModelReward reads a model "
                "with 1 (the score) or 2 (the log-odds of label 1)"
            )
        pad = config.pad_token_id
        self._pad_id = next(
            (i for i in (pad, tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), None
        )
        if self._pad_id is None:
            raise ValueError(
                f"model_path={model_path!r} names no pad_token_id in config.json and its tokenizer has no "
                "pad or end token to pad batches with"
            )
        self.model_path = str(model_path)
        self.batch_size = int(check_range("batch_size", batch_size, low=1))
        self.device = device
        self.max_length = int(check_range("max_length", max_length, low=1))
        self._loaded: tuple[Any, Any, torch.device] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loaded": None}

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        model, _, device = self._load()
        pad = self._pad_id
        encoded = [self.encode(prompt, c) for prompt, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            batch = [ids or [pad] for ids in encoded[start : start + self.batch_size]]
            input_ids = torch.full((len(batch), max(map(len, batch))), pad, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            logits = logits.float()
            values = logits[:, 0] if logits.shape[1] == 1 else logits[:, 1] - logits[:, 0]
            scores.extend(values.tolist())
        return scores

    def render(self, prompt: str | list[dict], completion: str | list[dict]) -> str:
        """The text the model reads (before its special tokens, where there is no chat template)."""
        tokenizer = self._load()[1]
        text = completion_text(completion)
        if tokenizer.chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            reply = {"role": "assistant", "content": text}
            return tokenizer.apply_chat_template([*messages, reply], tokenize=False)
        if isinstance(prompt, list):
            prompt = "\n".join(str(message.get("content", "")) for message in prompt)
        return str(prompt) + text

    def encode(self, prompt: str | list[dict], completion: str | list[dict]) -> list[int]:
        """The token ids scored: the rendered text's last ``max_length``."""
        tokenizer = self._load()[1]
        text = self.render(prompt, completion)
        ids = tokenizer(text, add_special_tokens=not tokenizer.chat_template)["input_ids"]
        return ids[-self.max_length :]

    def _load(self) -> tuple[Any, Any, torch.device]:
        """The model, its tokenizer and the device, loaded at the first call."""
        if self._loaded is None:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            if device.type == "cuda" and torch.cuda._is_in_bad_fork():
                raise RewardContractError(
                    "ModelReward cannot use CUDA in a reward worker forked from a process that uses it; "
                    "set reward.timeout: null (score in the trainer's process) or reward.start_method: "
                    "spawn, or ModelReward's device: cpu"
                )
            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
            try:
                model = AutoModelForSequenceClassification.from_pretrained(
                    self.model_path, local_files_only=True
                )
            except (OSError, ValueError) as error:
                raise ValueError(f"model_path={self.model_path!r}: cannot load the model ({error})") from None
            model.config.pad_token_id = self._pad_id
            self._loaded = model.to(device).eval(), tokenizer, device
        return self._loaded
