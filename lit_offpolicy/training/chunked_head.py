"""The LM head's log-probs (and entropy) chunk by chunk, with a hand-written backward that accumulates
the head's weight gradient into one buffer.

For a linear head z = (h Wᵀ + b) / T over V tokens, per position n with target token y_n:

    log π_n = z_{n,y} − lse_n,        H_n = lse_n − Σ_v p_{n,v} z_{n,v},        p = softmax(z)

and, for upstream gradients g (of log π) and e (of H),

    ∂/∂z_{n,v} = g_n (1[v = y_n] − p_{n,v}) − e_n p_{n,v} (z_{n,v} − Σ_u p_{n,u} z_{n,u})

then ∂h = (∂z / T) W, ∂W = Σ_chunks (∂z / T)ᵀ h, ∂b = Σ_n ∂z / T.

Forward and backward each hold one chunk's N × V logits at a time (two with the entropy). The
backward recomputes them, forms ∂z in place and adds each chunk's ∂W into one V × H buffer (``addmm_``).
The generic path (``forward._chunk_statistics`` under activation checkpointing) gives the same values
but lets autograd build each chunk's ∂W as a new V × H tensor and add it to the running one, and holds
several N × V intermediates: at V = 151,936 and H = 512 in float32 that is 297 MiB more per chunk and
about three more logit-sized tensors (155 MiB each at 256 tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from lit_offpolicy.core.logprobs import at_least_float32


def applies(head: nn.Module) -> bool:
    """Whether ``head`` is a plain ``nn.Linear`` (not an adapter, a quantized layer or a subclass with its
    own forward) whose weight is an ordinary tensor, outside autocast: the cases the backward here
    computes exactly as autograd would. Others take the checkpointed generic path."""
    if type(head) is not nn.Linear or isinstance(head.weight, DTensor):
        return False
    return not torch.is_autocast_enabled(head.weight.device.type)


def head_statistics(
    head: nn.Linear, hidden: Tensor, tokens: Tensor, scale: float, chunk_size: int, with_entropy: bool
) -> Tensor:
    """log π of ``tokens`` (N,) under ``head`` applied to ``hidden`` (N, H), divided by ``scale``; with
    ``with_entropy``, (N, 2) pairs (log π, H). Float32 or wider."""
    return _HeadStatistics.apply(hidden, head.weight, head.bias, tokens, scale, chunk_size, with_entropy)


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, scale: float) -> Tensor:
    """z = (h Wᵀ + b) / T in float32 or wider, a fresh tensor (divided in place)."""
    scaled = at_least_float32(F.linear(hidden, weight, bias))
    return scaled.div_(scale) if scale != 1.0 else scaled


def _chunks(total: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, total, chunk_size)]


class _HeadStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, scale, chunk_size, with_entropy):
        total = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # as at_least_float32
        log_norm = hidden.new_empty(total, dtype=dtype)
        out = hidden.new_empty((total, 2) if with_entropy else (total,), dtype=dtype)
        for part in _chunks(total, chunk_size):
            z = _scaled_logits(hidden[part], weight, bias, scale)
            log_norm[part] = torch.logsumexp(z, dim=-1)
            log_prob = z.gather(-1, tokens[part].unsqueeze(-1)).squeeze(-1) - log_norm[part]
            if with_entropy:
                p = (z - log_norm[part].unsqueeze(-1)).exp_()
                out[part, 0] = log_prob
                out[part, 1] = log_norm[part] - p.mul_(z).sum(dim=-1)
            else:
                out[part] = log_prob
        ctx.save_for_backward(hidden, weight, bias, tokens, log_norm)
        ctx.scale, ctx.chunk_size, ctx.with_entropy = scale, chunk_size, with_entropy
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        hidden, weight, bias, tokens, log_norm = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        grad_log_prob = grad_out[:, 0] if ctx.with_entropy else grad_out
        for part in _chunks(hidden.shape[0], ctx.chunk_size):
            z = _scaled_logits(hidden[part], weight, bias, ctx.scale)
            if ctx.with_entropy:  # −e p (z − Σ p z) in z's storage, then − g p
                p = (z - log_norm[part].unsqueeze(-1)).exp_()
                mean_z = torch.einsum("nv,nv->n", p, z).unsqueeze(-1)
                grad_z = z.sub_(mean_z).mul_(p).mul_(-grad_out[part, 1].unsqueeze(-1))
                grad_z.sub_(p.mul_(grad_log_prob[part].unsqueeze(-1)))
            else:  # − g p, in z's storage
                grad_z = z.sub_(log_norm[part].unsqueeze(-1)).exp_().mul_(-grad_log_prob[part].unsqueeze(-1))
            rows = torch.arange(grad_z.shape[0], device=grad_z.device)
            grad_z[rows, tokens[part]] += grad_log_prob[part]
            grad_logits = grad_z.div_(ctx.scale).to(weight.dtype)
            if need_hidden:
                grad_hidden[part] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden[part])
            if need_bias:
                grad_bias += grad_logits.sum(dim=0)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
