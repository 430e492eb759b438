"""SFTModule: a supervised warm-up of the actor on prompt/answer pairs, before RL."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from lit_offpolicy.core.attention import without_cudnn_attention
from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.memory import map_large_blocks
from lit_offpolicy.data.datamodule import prompt_special_tokens
from lit_offpolicy.data.sft import collate_sft, sft_examples
from lit_offpolicy.models import load_actor, load_tokenizer


class SFTModule(L.LightningModule):
    """Next-token cross-entropy on the answer and eos tokens only (the prompt is context, not target).

    Takes the same ``{"prompt": [...], "answer": [...]}`` batches as RL, so one data module serves both.
    Logs ``sft/loss`` and ``sft/token_accuracy``; pair it with ``HFExport`` to get a model directory
    that RL (``OffPolicyModule.model_path``) and vLLM load.
    """

    def __init__(self, model_path: str, lr: float = 1e-3, weight_decay: float = 0.0, warmup_steps: int = 0):
        super().__init__()
        map_large_blocks()  # as OffPolicyModule (core.memory)
        check_range("lr", lr, low=0.0, low_inclusive=False)
        check_range("weight_decay", weight_decay, low=0.0)
        check_range("warmup_steps", warmup_steps, low=0)
        self.save_hyperparameters()
        self.tokenizer = load_tokenizer(model_path)
        self.actor = load_actor(model_path)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        tokens = self._tokenize(batch["prompt"], batch["answer"])
        with without_cudnn_attention():  # its backward's NaN (core.attention)
            logits = self.actor(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).logits
        targets = tokens["input_ids"][:, 1:]
        target_mask = tokens["loss_mask"][:, 1:]
        logits = logits[:, :-1][target_mask]
        loss = F.cross_entropy(logits.float(), targets[target_mask])
        accuracy = (logits.argmax(-1) == targets[target_mask]).float().mean()
        self.log_dict(
            {"sft/loss": loss, "sft/token_accuracy": accuracy}, prog_bar=True, batch_size=len(targets)
        )
        return loss

    def _tokenize(self, prompts: list[str], answers: list[str]) -> dict[str, torch.Tensor]:
        add_special_tokens = prompt_special_tokens(self.trainer.datamodule)
        examples = sft_examples(prompts, answers, self.tokenizer, add_special_tokens)
        return {k: v.to(self.device) for k, v in collate_sft(examples, self.tokenizer.pad_token_id).items()}

    def configure_optimizers(self):
        h = self.hparams
        optimizer = torch.optim.AdamW(self.actor.parameters(), lr=h.lr, weight_decay=h.weight_decay)
        warmup = max(h.warmup_steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
