"""The attention kernel that passes with a gradient must not use: cuDNN's.

On H100/H200 with torch ≥ 2.11, ``scaled_dot_product_attention`` with a mask dispatches to cuDNN by
default, and cuDNN's backward returns NaN in the query gradient when the sequence length is 64 past a
multiple of 128 and a row's logsumexp is below ln(FLT_MAX) ≈ −88.7; the forward is right
(pytorch/pytorch#196678, huggingface/trl#7181). Measured here on an H100 (torch 2.11): one update of
Qwen2.5-1.5B's shape in bfloat16, 8 sequences of 64 + 512 tokens, had 328 of 338 gradients non-finite
under the default backends and none with cuDNN's attention off, as under the memory-efficient, math or
eager kernels (docs/parameters.md, "attn_implementation"). The cost, on that H100 at 8 × 512 tokens:
a forward and backward 0.87× as fast as with cuDNN (benchmarks/pytorch/attention_backends.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    """Inside the block ``scaled_dot_product_attention`` never picks cuDNN (the flag is process-wide);
    the setting before it comes back after, also on an exception. No effect on a CPU."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
