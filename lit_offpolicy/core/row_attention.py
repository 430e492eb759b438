"""Which attention the forward under way runs over its packed row, kept for its recomputation.

``training.packed_attention`` switches a model's configs to an attention function of its own for one
forward and tells that function the row's sample lengths (and, for sequence parallelism, the process
group) through ``row_attention()``. Under gradient checkpointing the backward recomputes each block
after that forward has returned and the switch is undone: ``checkpoint_contexts``, the checkpoint's
``context_fn`` (``models.enable_checkpointing``), puts the forward's row attention back around the
recomputation, so the block recomputes what it computed (else it would attend across samples, and
``torch.utils.checkpoint`` stops on the differing saved tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class RowAttention:
    """A packed row's attention: over samples of ``lengths`` tokens, by the attention function
    ``implementation`` (set on ``configs``), over ``group`` (sequence parallelism; else None).
    ``shared``: a shared-prefix row's gathers (``training.packed_attention.SharedRowIndex``), whose
    ``lengths`` are each prompt's, then its responses'; None: every length is a sample's."""

    lengths: tuple[int, ...]
    implementation: str
    configs: tuple
    group: object = None
    shared: object = None


_row: ContextVar[RowAttention | None] = ContextVar("row_attention", default=None)


def row_attention() -> RowAttention | None:
    """The row attention of the forward under way; None outside ``attending``."""
    return _row.get()


@contextlib.contextmanager
def attending(row: RowAttention | None) -> Iterator[None]:
    """``row`` is the row attention inside the block, its configs switched to its implementation and
    back to "sdpa" after (the only attention they are switched from)."""
    token = _row.set(row)
    configs = () if row is None else row.configs
    for config in configs:
        config._attn_implementation = row.implementation
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"
        _row.reset(token)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``, called as a checkpointed block's forward starts: none
    around the forward; around its recomputation in the backward, the row attention of that forward."""
    return contextlib.nullcontext(), attending(_row.get())
