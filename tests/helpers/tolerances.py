"""Tolerances for comparing two computations of the same float values, derived from the dtype and the
length of the sums rather than tuned to pass.

Two computations that group their sums differently (another kernel or ISA, another shape, a fusion, a
chunked LM head, a KV cache, a thread count) round differently: a sum of K terms of size ≤ S is
within about eps·√K·S of the exact value (rounding errors of either sign add up as a random walk;
K·eps·S is the rare worst case), eps being the dtype's machine epsilon (float32: 1.19e-7, float64:
2.22e-16). Comparing two such results allows one error per path, and one per stage of reordered sums
the values pass in series (a model's layers).
"""

from __future__ import annotations

import math

import torch

EPS32 = torch.finfo(torch.float32).eps
"""1.19e-7"""
EPS64 = torch.finfo(torch.float64).eps
"""2.22e-16"""


def reordered_sums(reference: torch.Tensor, terms: int, stages: int = 1, paths: int = 2) -> float:
    """``paths × stages × eps × √terms × max|reference|``: the absolute tolerance between ``reference``
    and another computation of it whose sums of up to ``terms`` terms are grouped differently in
    ``stages`` stages in series; eps of ``reference``'s dtype (float32 for anything narrower)."""
    eps = torch.finfo(reference.dtype if reference.dtype == torch.float64 else torch.float32).eps
    return paths * stages * eps * math.sqrt(terms) * reference.detach().abs().max().item()
