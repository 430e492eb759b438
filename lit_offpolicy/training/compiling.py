"""``compile: true``: torch.compile of the transformer blocks, in effect during the training step only.

Regional compilation, as torchtune does it: each transformer block (a class named ``*DecoderLayer``,
as Llama, Qwen, Mistral... name theirs) is compiled rather than the whole model, so that one graph
serves every block and the model's own Python around them (masks, the chunked LM head of
``forward.chunked_log_probs``, peft's adapters switch) stays eager. The compiled blocks run only
inside ``CompiledBlocks.active()``, which ``OffPolicyModule.training_step`` enters: generation with the
actor itself (the HF engine, a new shape at every decoded token), evaluation, export and the engines'
deep copies see the plain modules.

Numerics: inductor fuses and reorders the blocks' float operations, so log-probs and gradients agree
with eager to rounding (about 1e-6 relative in float32), not to the bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: its modules whose class name ends in ``DecoderLayer``."""
    return [module for module in model.modules() if type(module).__name__.endswith("DecoderLayer")]


class CompiledBlocks:
    """torch.compile'd calls of the blocks of ``models`` (built once; compiled at their first call)."""

    def __init__(self, *models: nn.Module | None) -> None:
        self.blocks = [block for model in models if model is not None for block in transformer_blocks(model)]
        if not self.blocks:
            raise ValueError(
                "compile=True found no transformer block (a module class named '*DecoderLayer') to compile "
                "in this model; allowed values for it: False"
            )
        # nn.Module.compile stores exactly this in ``_compiled_call_impl``; holding our own lets the
        # blocks go back to eager outside the training step
        self._compiled = [torch.compile(block._call_impl) for block in self.blocks]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for block, compiled in zip(self.blocks, self._compiled, strict=True):
            block._compiled_call_impl = compiled
        try:
            yield
        finally:
            for block in self.blocks:
                block._compiled_call_impl = None
